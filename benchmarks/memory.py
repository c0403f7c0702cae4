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

  python benchmarks/memory.py [--compiler cpu|h100] [--sync_collectives] [--devices 8]
      [--method dino] [--preset vit_large] [--trunk vit_tiny] [--batch 64] [--buffers 8]
      [--no_results]

``--compiler cpu`` (the default) compiles for N host CPU devices (made by XLA_FLAGS before JAX
starts). XLA's CPU pipeline drops the optimisation barriers that keep a recomputed block from
being merged back into the forward pass, so remat changes nothing there. ``--compiler h100``
compiles for N H100 GPUs without one: XLA's GPU compiler, ahead of time, for a described
device (``gpu_specs/h100_sxm.txtpb``; JAX's CUDA plugin must be installed:
``pip install "jax[cuda12]"``, several GB); autotuning is off (it runs kernels), which may
choose other kernels than a real GPU but not a different buffer plan; the device is described
with 1 TiB of memory, so that XLA's own rematerialisation (at the device's size) stays out of
the rows. ``--sync_collectives`` compiles the collectives synchronous
(``--xla_gpu_disable_async_collectives``): what the asynchronous gradient all-reduce, which
overlaps the backward pass, costs in memory (jssl.models.remat says how remat keeps it small).
Nothing is allocated: the state is abstract (``jssl.training.fresh.abstract_state``).
``--buffers K`` prints each row's K largest allocations from XLA's buffer assignment (their sizes
and the shapes of the values that share them), to find what a row's temporaries hold.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import sys
import tempfile

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


SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs")


def _compile_only_devices(compiler: str, count: int) -> list:
    """``count`` devices of a compile-only GPU topology (no GPU needed), or the host's CPUs."""
    import jax

    if compiler == "cpu":
        return jax.devices()
    from jax.experimental import topologies

    with open(os.path.join(SPECS, f"{compiler}_sxm.txtpb")) as f:
        spec = f.read()
    # XLA rematerialises on its own when a program exceeds the device's memory: describe a
    # device large enough that the figures are what the step needs, not what XLA cut it to.
    spec = re.sub(r"device_memory_size: \d+", f"device_memory_size: {2**40}", spec)
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=spec, topology=f"1x1x{count}"
        )
    except (NotImplementedError, RuntimeError) as e:
        raise SystemExit(
            f'--compiler {compiler} needs JAX\'s CUDA plugin (pip install "jax[cuda12]"): {e}'
        ) from e
    return list(topology.devices)


def _print_largest(dump: str, count: int) -> None:
    """The ``count`` largest allocations of the newest step XLA compiled into ``dump``."""
    reports = glob.glob(os.path.join(dump, "*jit_step*memory-usage-report.txt"))
    if not reports:
        print(f"  (XLA wrote no memory-usage report to {dump})")
        return
    newest = max(reports, key=os.path.getmtime)
    with open(newest) as f:
        lines = [line.rstrip() for line in f if re.match(r"\s*[\d.]+[KMG]?i?B\(", line)]
    os.remove(newest)  # the next row's report is then the newest
    # Each line, largest first: cumulative size; size; offset; values sharing it; their shapes.
    for line in lines[:count]:
        fields = [field.strip() for field in line.split(";")]
        print(f"  {fields[1]:>10}  {fields[4][:200]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--compiler", default="cpu", choices=("cpu", "h100"), help="XLA backend to compile for"
    )
    p.add_argument(
        "--sync_collectives",
        action="store_true",
        help="GPU: collectives run synchronously (XLA's async all-reduce keeps the backward "
        "pass's activation gradients alive until it, which undoes most of remat's saving)",
    )
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--method", default="dino", help="configs/<method>.py")
    p.add_argument("--preset", default="vit_large", help="configs/<method>.py's preset")
    p.add_argument("--trunk", default="", help="model.trunk ('': the preset's)")
    p.add_argument("--patch_size", type=int, default=0, help="0: the preset's")
    p.add_argument("--batch", type=int, default=0, help="global batch (0: the preset's)")
    p.add_argument(
        "--buffers", type=int, default=0, help="print each row's K largest XLA allocations"
    )
    results.add_flags(p)
    args = p.parse_args()
    # The step is compiled, never run: LLVM's optimisation level changes the machine code, not
    # XLA's buffer assignment (the same temporaries either way), so the fastest level serves.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={args.devices}"
        + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
        # Compile-only GPU: no kernel can run, so no autotuning (cuBLAS' default algorithms).
        + " --xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false"
        + (
            " --xla_gpu_disable_async_collectives=ALLREDUCE,ALLGATHER,REDUCESCATTER"
            if args.sync_collectives
            else ""
        )
    )
    dump = tempfile.mkdtemp(prefix="memory-") if args.buffers else None
    if dump:  # XLA writes each compiled step's buffer assignment there
        os.environ["XLA_FLAGS"] += (
            f" --xla_dump_to={dump} --xla_dump_hlo_module_re=jit_step --xla_dump_hlo_pass_re=NONE"
        )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the GPU target needs no GPU backend
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check

    import importlib

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jssl import data, parallel
    from jssl.engines import train

    mesh = parallel.make_mesh(_compile_only_devices(args.compiler, args.devices))
    platforms = ("cuda",) if args.compiler != "cpu" else ("cpu",)
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
        stop = jax.ShapeDtypeStruct((args.devices,), np.int32, sharding=sharding)
        traced = step.trace(state, batch, stop)
        compiled = traced.lower(lowering_platforms=platforms).compile()
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
        if dump:
            _print_largest(dump, args.buffers)

    if dump:
        shutil.rmtree(dump, ignore_errors=True)
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
    on_gpu = args.compiler != "cpu"
    target = (
        f"{args.devices} H100 GPUs (compiled ahead of time for gpu_specs/h100_sxm.txtpb, no GPU "
        "used; autotuning off"
        + (
            "; all-reduce, all-gather and reduce-scatter synchronous"
            if args.sync_collectives
            else ""
        )
        + ")"
        if on_gpu
        else f"{args.devices} CPU devices"
    )
    results.record(
        "memory"
        + (f"-{args.compiler}" if on_gpu else "")
        + ("-sync_collectives" if on_gpu and args.sync_collectives else ""),
        rows,
        args=args,
        measures=(
            f"Bytes per device of the {args.method} train step ({config.model.trunk}/"
            f"{config.model.patch_size}, {args.preset} preset, global batch "
            f"{config.data.batch_size}) on {target}, from XLA's compiled memory analysis: the "
            "train state's part on each device, the step's arguments (state and batch) and its "
            "temporaries."
        ),
        headline=headline,
        notes=(
            None
            if on_gpu
            else "XLA's CPU pipeline drops the optimisation barriers that keep a recomputed "
            "block apart from the forward pass, so remat lowers nothing there (the remat row is "
            "the CPU compiler's figure); `--compiler h100` gives a GPU compiler's."
        ),
    )


if __name__ == "__main__":
    main()
