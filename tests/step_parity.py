"""Runs a few MoCo train steps on a fixed global batch and saves loss and parameters.

Used by tests/test_parallel.py in subprocesses with different device and process counts
(the device count is fixed by XLA_FLAGS before JAX starts, hence a separate process).

  python tests/step_parity.py OUT.npz [--process_id I --num_processes N --port P]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--process_id", type=int, default=0)
    p.add_argument("--num_processes", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--sync_bn", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--method", default="moco", choices=("moco", "simclr", "swav", "dino"))
    args = p.parse_args()

    from jssl import parallel

    if args.num_processes > 1:
        parallel.initialize(f"localhost:{args.port}", args.num_processes, args.process_id)
    import jax
    import numpy as np
    from jax.flatten_util import ravel_pytree

    from configs import dino, moco, simclr, swav
    from jssl import data, methods
    from jssl.engines.train import init_state, make_optimizer
    from jssl.train_step import make_train_step

    config = {"moco": moco, "simclr": simclr, "swav": swav, "dino": dino}[args.method].get_config(
        "test"
    )
    config.model.sync_bn = bool(args.sync_bn)
    # MoCo v2's head, T and lr, not the demo's BN projector: its output BN makes the trunk's
    # gradient a sum of nearly cancelling per-example terms on these noise images, so float32
    # reduction order alone moves it by ~0.4% (measured), which would hide real sharding bugs.
    config.model.head_bn = False
    config.model.head_last_bn = False
    config.method.temperature = 0.1
    config.optim.name = "sgd"
    config.optim.base_lr = 0.06
    config.optim.warmup_epochs = 0
    config.data.batch_size = 16
    if args.method == "moco":
        config.method.queue_size = 32  # two batches: the second step sees enqueued keys
    if args.method == "swav":
        # Multi-crop (2x16 px + 4x8 px); prototypes frozen for 2 steps; the queue (two
        # batches) full after step 2 and on from step 2 (epoch 0.5 of 4 steps).
        config.method.queue_length = 32
        config.method.queue_start_epoch = 0.5
    mesh = parallel.make_mesh()
    method = methods.get(config, steps_per_epoch=4)
    tx, schedule = make_optimizer(config, method, steps_per_epoch=4)
    state = init_state(config, method, tx, mesh)
    step = make_train_step(method, tx, schedule, mesh)

    losses = []
    for i in range(args.steps):
        full = data.synthetic_batch(config.data, 16, seed=i)
        rows = slice(
            jax.process_index() * 16 // jax.process_count(),
            (jax.process_index() + 1) * 16 // jax.process_count(),
        )
        local = jax.tree.map(lambda x, rows=rows: x[rows], full)
        state, metrics = step(state, parallel.host_batch_to_global(local, mesh))
        losses.append(float(parallel.global_to_host(metrics)["loss"]))
    host = parallel.global_to_host(
        {"params": state.params, "ema": state.ema_params, "method_state": state.method_state}
    )
    if jax.process_index() == 0:
        extra = {}
        if args.method == "moco":
            extra = dict(ema=ravel_pytree(host["ema"])[0], queue=host["method_state"]["queue"])
        if args.method == "swav":
            extra = dict(queue=host["method_state"]["queue"])
        if args.method == "dino":
            center = host["method_state"]["center"]
            extra = dict(teacher=ravel_pytree(host["ema"])[0], center=center)
        np.savez(
            args.out,
            loss=np.array(losses),
            params=ravel_pytree(host["params"])[0],
            devices=jax.device_count(),
            **extra,
        )


if __name__ == "__main__":
    main()
