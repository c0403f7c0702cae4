"""Runs a few train steps of each named method on fixed global batches and saves loss, parameters
and the method's state.

Used by tests/test_parallel.py in subprocesses with different device and process counts
(the device count is fixed by XLA_FLAGS before JAX starts, hence a separate process). One
process runs every method asked for, so the suite pays JAX's start-up once per device count.

  python tests/support/step_parity.py OUT.npz --methods moco,simclr [--shard_params 1]
      [--accumulation_steps K] [--process_id I --num_processes N --port P]

OUT.npz holds ``devices`` and, per method m, ``m:loss`` (one per step), ``m:params``,
``m:ema`` (the momentum encoder / teacher, when the method has one) and ``m:state``
(``method_state`` flattened: queues, centres), each parameter tree flattened into one vector.
"""

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

GLOBAL_BATCH = 16
# Steps per method: SwAV's 4 cover its frozen prototypes (2 steps) and its queue (on from 3).
# BYOL's, SimSiam's, DINO's and MoCo v3's 3 let the target, predictor and centre move twice.
STEPS = {"swav": 4, "byol": 3, "simsiam": 3, "dino": 3, "mocov3": 3, "dino_vit": 2}


def without_batch_norm(config):
    """``config`` on a two-block ViT with BN-free heads: what exact gradient accumulation must
    reproduce to float rounding (batch norm normalises each micro-batch on its own). The second
    block drops its branches at 0.5, masks keyed by example, so they must not depend on the
    micro-batch either."""
    m = config.model
    m.trunk, m.vit_depth, m.patch_size, m.image_size = "vit_tiny", 2, 8, 16
    m.drop_path_rate = 0.5
    if m.head_dims:  # the ViT's 192 features feed the head (DINO's head is its own)
        m.head_dims = (192, *m.head_dims[1:])
    m.head_bn = m.head_last_bn = False
    for field in ("predictor_bn", "predictor_last_bn", "use_bn_in_head"):
        if field in config.method:
            config.method[field] = False
    return config


def configure(method: str):
    """The method's "test" preset, made a non-chaotic recipe for an invariance test."""
    # dino_vit: DINO's "test_vit" preset, a 2-block ViT with the student's drop path 0.1;
    # moco_larc: MoCo with VISSL's LARC, whose trust ratios are norms of whole parameters;
    # <method>_accum: the method without batch norm (``without_batch_norm``), for runs with
    # --accumulation_steps.
    module, preset = {"dino_vit": ("dino", "test_vit"), "moco_larc": ("moco", "test")}.get(
        method, (method.removesuffix("_accum"), "test")
    )
    config = importlib.import_module(f"configs.{module}").get_config(preset)
    if method.endswith("_accum"):
        without_batch_norm(config)
    # No BN in the projector, T 0.1 and plain SGD (MoCo v2's own head, not the demo's BN
    # projector): an output BN makes the trunk's gradient a sum of nearly cancelling
    # per-example terms on these noise images, so float32 reduction order alone moves it by
    # ~0.4% (measured), which would hide real sharding bugs.
    config.model.head_bn = False
    config.model.head_last_bn = False
    if "temperature" in config.method:
        config.method.temperature = 0.1
    config.optim.name = "larc" if method == "moco_larc" else "sgd"
    config.optim.base_lr = 0.06
    config.optim.warmup_epochs = 0
    config.data.batch_size = GLOBAL_BATCH
    if module == "moco":
        config.method.queue_size = 32  # two batches: the second step sees enqueued keys
    if method == "swav":
        # Multi-crop (2x16 px + 4x8 px); prototypes frozen for 2 steps; the queue (two
        # batches) full after step 2 and on from step 2 (epoch 0.5 of 4 steps).
        config.method.queue_length = 32
        config.method.queue_start_epoch = 0.5
    return config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--methods", default="moco", help="comma-separated method names")
    p.add_argument("--process_id", type=int, default=0)
    p.add_argument("--num_processes", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--sync_bn", type=int, default=1)
    p.add_argument("--shard_params", type=int, default=0, help="1: parallel.shard_params")
    p.add_argument("--shard_min_size", type=int, default=256, help="parallel.shard_min_size")
    p.add_argument("--remat", default="none", help="model.remat (none, full, dots)")
    p.add_argument(
        "--accumulation_steps", type=int, default=1, help="optim.accumulation_steps of *_accum"
    )
    p.add_argument("--steps", type=int, default=0, help="0: each method's own (STEPS, else 2)")
    p.add_argument("--save", default="", help="a workdir: checkpoint the state after --save_after")
    p.add_argument("--save_after", type=int, default=2)
    p.add_argument("--resume", default="", help="a workdir: start from its newest checkpoint")
    args = p.parse_args()

    from jssl import parallel

    if args.num_processes > 1:
        parallel.initialize(f"localhost:{args.port}", args.num_processes, args.process_id)
    import jax
    import numpy as np
    from jax.flatten_util import ravel_pytree

    from jssl import data, methods
    from jssl.checkpoints import manager as checkpoint
    from jssl.engines.train import init_state, make_optimizer
    from jssl.training.state import specs_of
    from jssl.training.step import make_train_step

    mesh = parallel.make_mesh()
    rows = slice(
        jax.process_index() * GLOBAL_BATCH // jax.process_count(),
        (jax.process_index() + 1) * GLOBAL_BATCH // jax.process_count(),
    )
    saved = {"devices": jax.device_count()}
    for name in args.methods.split(","):
        config = configure(name)
        config.model.sync_bn = bool(args.sync_bn)
        config.parallel.shard_params = bool(args.shard_params)
        config.parallel.shard_min_size = args.shard_min_size  # 256: the tiny kernels split too
        config.model.remat = args.remat
        if name.endswith("_accum"):
            config.optim.accumulation_steps = args.accumulation_steps
        method = methods.get(config, steps_per_epoch=4)
        tx, schedule = make_optimizer(config, method, steps_per_epoch=4)
        state = init_state(config, method, tx, mesh)
        manager = None
        if args.save or args.resume:  # one method: its state in the workdir's checkpoints
            manager, state, _, _ = checkpoint.resume(
                args.save or args.resume, config.checkpoint, state
            )
        step = make_train_step(
            method,
            tx,
            schedule,
            mesh,
            accumulation_steps=config.optim.accumulation_steps,
            state_specs=specs_of(state),
        )
        losses = []
        for i in range(int(state.step), args.steps or STEPS.get(name, 2)):
            if args.save and i == args.save_after:
                checkpoint.save(manager, state, checkpoint.DataPosition())
                checkpoint.finish(manager)
                host = parallel.global_to_host(state.params)
                saved[f"{name}:saved_params"] = ravel_pytree(host)[0]
            full = data.synthetic_batch(config.data, GLOBAL_BATCH, seed=i)
            # Every class, in a different order each step (for the supervised method).
            full["label"] = (np.arange(GLOBAL_BATCH, dtype=np.int32) * (i + 1)) % 10
            local = jax.tree.map(lambda x: x[rows], full)
            state, metrics = step(state, parallel.host_batch_to_global(local, mesh))
            losses.append(float(parallel.global_to_host(metrics)["loss"]))
        host = parallel.global_to_host(
            {"params": state.params, "ema": state.ema_params, "state": state.method_state}
        )
        saved[f"{name}:loss"] = np.array(losses)
        saved[f"{name}:accumulation_steps"] = config.optim.accumulation_steps
        for key in ("params", "ema", "state"):
            if jax.tree.leaves(host[key]):
                saved[f"{name}:{key}"] = ravel_pytree(host[key])[0]
    if jax.process_index() == 0:
        np.savez(args.out, **saved)


if __name__ == "__main__":
    main()
