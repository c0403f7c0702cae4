"""Memory per device of a train step, from XLA's compiled memory analysis (compiled, never run).

The rows are the ways jssl fits a large model and batch on few devices, for one method, trunk
and global batch (default: ``configs/dino.py:vit_large``, DINO's ViT-L/16 at batch 1024, 2 x
224 px + 10 x 96 px crops, on 8 devices; each row sets the three fields it names, whatever the
preset sets): the state replicated; split over the devices (``parallel.shard_params``); split
with every trunk block recomputed in the backward pass (``model.remat=full``); and that with
the batch in 4 micro-batches (``optim.accumulation_steps=4``). For each, the bytes per device
of the step's arguments (the train state's part on the device, and the batch's) and of its
temporaries (activations, gradients, collectives' buffers), and the ratios the issue's targets
name: the split state against a replicated state / N plus the leaves left replicated, remat's
and accumulation's temporaries against the row before.

  python benchmarks/memory.py [--devices 8] [--method dino] [--preset vit_large]
      [--trunk vit_tiny] [--batch 64] [--no_results]

The devices are the host CPU's, N of them made by XLA_FLAGS before JAX starts, so the analysis
is XLA's CPU compiler's. On that backend remat does not lower the temporaries (a ViT-S/16
gradient at batch 64: 8.7 GiB without remat, 9.6 GiB with it), so the remat row shows what the
CPU compiler makes of it, not what a GPU's compiler does; the GPU figure needs a GPU. Nothing
is allocated: the state is abstract (``jssl.training.fresh.abstract_state``).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import results  # noqa: E402
import step_cases  # noqa: E402


def _row(shard: bool, remat: str, accumulation: int) -> dict:
    return {
        "parallel.shard_params": shard,
        "model.remat": remat,
        "optim.accumulation_steps": accumulation,
    }


# Every row sets all three fields, whatever the preset sets.
ROWS = (
    ("replicated", _row(False, "none", 1)),
    ("split", _row(True, "none", 1)),
    ("split + remat", _row(True, "full", 1)),
    ("split + remat + accumulation 4", _row(True, "full", 4)),
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--method", default="dino", help="configs/<method>.py")
    p.add_argument("--preset", default="vit_large", help="configs/<method>.py's preset")
    p.add_argument("--trunk", default="", help="model.trunk ('': the preset's)")
    p.add_argument("--patch_size", type=int, default=0, help="0: the preset's")
    p.add_argument("--batch", type=int, default=0, help="global batch (0: the preset's)")
    results.add_flags(p)
    args = p.parse_args()
    # The step is compiled, never run: LLVM's optimisation level changes the machine code, not
    # XLA's buffer assignment (the same temporaries either way), so the fastest level serves.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={args.devices}"
        + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import importlib

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jssl import data, parallel
    from jssl.engines import train
    from jssl.training.step import stop_flags

    mesh = parallel.make_mesh()
    rows, state_bytes = [], {}
    for name, overrides in ROWS:
        config = importlib.import_module(f"configs.{args.method}").get_config(args.preset)
        config.model.trunk = args.trunk or config.model.trunk
        config.model.patch_size = args.patch_size or config.model.patch_size
        config.data.batch_size = args.batch or config.data.batch_size
        config.probe.num_classes = 0
        config.update_from_flattened_dict(overrides)
        state, step = step_cases.engine_step(config, train.abstract_state, mesh)
        host = data.synthetic_batch(config.data, args.devices)  # the layout; shapes below
        size, sharding = config.data.batch_size, parallel.data_sharding(mesh)
        batch = jax.tree.map(
            lambda x, size=size, sharding=sharding: jax.ShapeDtypeStruct(
                (size, *x.shape[1:]), x.dtype, sharding=sharding
            ),
            host,
        )
        compiled = step.lower(state, batch, stop_flags(mesh, False)).compile()
        analysis = compiled.memory_analysis()

        def per_device(x) -> int:
            shape = x.sharding.shard_shape(x.shape)
            return int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize

        leaves = jax.tree.leaves(state)
        state_bytes[name] = sum(per_device(x) for x in leaves)
        replicated_small = sum(
            per_device(x)
            for x in leaves
            if isinstance(x.sharding, NamedSharding) and x.sharding.spec == P()
        )
        rows.append(
            {
                "layout": name,
                "state GiB/device": state_bytes[name] / 2**30,
                "replicated leaves GiB": replicated_small / 2**30,
                "arguments GiB/device": analysis.argument_size_in_bytes / 2**30,
                "temporaries GiB/device": analysis.temp_size_in_bytes / 2**30,
            }
        )
        print(rows[-1], flush=True)

    replicated, split = rows[0], rows[1]
    target = replicated["state GiB/device"] / args.devices + split["replicated leaves GiB"]
    headline = [
        f"split state / (replicated / {args.devices} + replicated leaves): "
        f"{split['state GiB/device'] / target:.3f} (target <= 1.15)",
        "remat temporaries / split temporaries: "
        f"{rows[2]['temporaries GiB/device'] / split['temporaries GiB/device']:.3f} "
        "(target <= 0.5)",
        "accumulation 4 temporaries / remat temporaries: "
        f"{rows[3]['temporaries GiB/device'] / rows[2]['temporaries GiB/device']:.3f} "
        "(target <= 0.35)",
    ]
    for line in headline:
        print(line)
    results.record(
        "memory",
        rows,
        args=args,
        measures=(
            f"Bytes per device of the {args.method} train step ({config.model.trunk}/"
            f"{config.model.patch_size}, {args.preset} preset, global batch "
            f"{config.data.batch_size}) on {args.devices} CPU devices, "
            "from XLA's compiled memory analysis: the train state's part on each device, the "
            "step's arguments (state and batch) and its temporaries."
        ),
        headline=headline,
        notes=(
            "On XLA's CPU backend remat does not lower the temporaries (a ViT-S/16 gradient at "
            "batch 64: 8.7 GiB without, 9.6 GiB with remat), so the remat row is the CPU "
            "compiler's figure; a GPU's needs a GPU."
        ),
    )


if __name__ == "__main__":
    main()
