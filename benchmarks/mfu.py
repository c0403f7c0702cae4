r"""Arithmetic rate and model FLOPs utilisation (MFU) of a step, for train_step.py.

One device's floating-point operations in a step as XLA counts them, and one chip's peak, so
that ``TFLOP/s / peak`` is the step's MFU (e.g. MoCo R50@224 bf16 per GPU). Run as a script,
it counts the operations of train_step.py's cases without running them (the step is lowered
on abstract shapes, on any backend: a CPU gives the count of a GPU step):

  python benchmarks/mfu.py --methods=moco --cases=r50_224_b256 --dtypes=bfloat16
"""

from __future__ import annotations

# Dense (no sparsity) bfloat16 peak TFLOP/s of one chip, from the vendors' data sheets, by a
# substring of jax's device_kind (first match). V100 has no bf16 units: its fp16 tensor peak.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("A100", 312.0),
    ("V100", 125.0),
    ("TPU v4", 275.0),
    ("TPU v5 lite", 197.0),
    ("TPU v5", 459.0),
    ("TPU v6 lite", 918.0),
)


def peak_tflops(device_kind: str, dtype: str, override: float | None = None) -> float | None:
    """One chip's peak for ``dtype``: ``override`` if given, else the table's bf16 figure."""
    if override:
        return override
    if dtype != "bfloat16":
        return None  # float32 peaks depend on TF32 and XLA's precision: pass --peak_tflops
    return next((v for k, v in PEAK_BF16_TFLOPS if k in device_kind), None)


def step_flops(lowered) -> float | None:
    """XLA's count of one step's floating-point operations on one device, or None.

    Counted on the lowered program, before any backend rewrites it (the same count on CPU, GPU
    and TPU). jssl's step body runs under ``shard_map`` on per-device shapes, so the count is
    per device. The compiled program's count is no substitute: on a GPU it leaves out the
    convolutions and matrix products that XLA hands to cuDNN and cuBLAS (MoCo v2 R50's step
    counted 0.2% MFU there); where the lowered program gives none (jax 0.11.2's CUDA backend),
    :func:`count_on_cpu` lowers the same case on the CPU.
    """
    try:
        cost = lowered.cost_analysis()
    except Exception:  # noqa: BLE001 - an estimate that a backend may not give
        return None
    cost = cost[0] if isinstance(cost, list) else cost
    value = (cost or {}).get("flops")
    return float(value) if value and value > 0 else None


def count_on_cpu(
    method: str, case: str, dtype: str, queue_size: int, on_device: bool
) -> float | None:
    """:func:`step_flops` of a train_step.py case lowered in a CPU process (this script), for
    a backend whose lowered program gives no count. The CPU's ResNet trains its 1x1
    convolutions as matrix products (jssl/models/cpu_ops.py): the same operations."""
    import os
    import subprocess
    import sys

    command = [sys.executable, os.path.abspath(__file__), f"--methods={method}", f"--cases={case}"]
    command += [f"--dtypes={dtype}", f"--queue_size={queue_size}", "--raw"]
    command += ["--on_device"] if on_device else []
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    lines = done.stdout.split()
    return float(lines[-1]) if done.returncode == 0 and lines and lines[-1] != "None" else None


def main() -> None:
    """Prints XLA's count of each case's step operations (one device, one step)."""
    import argparse
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax
    from step_cases import CASES, case_config, engine_step

    from jssl import data, parallel
    from jssl.engines import train
    from jssl.training.step import stop_flags

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="moco")
    p.add_argument("--cases", default="r50_224_b256")
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--queue_size", type=int, default=4096, help="MoCo's queue")
    p.add_argument("--on_device", action="store_true", help="augmentation in the step")
    p.add_argument("--raw", action="store_true", help="print the count alone (count_on_cpu)")
    args = p.parse_args()
    mesh = parallel.make_mesh()
    for method in args.methods.split(","):
        for case in args.cases.split(","):
            for dtype in args.dtypes.split(","):
                config = case_config(method, CASES[case], dtype, args.queue_size, args.on_device)
                state, step = engine_step(config, train.abstract_state, mesh)
                host = data.synthetic_batch(config.data, CASES[case]["batch"])
                batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host)
                flops = step_flops(step.lower(state, batch, stop_flags(mesh, False)))
                if args.raw:
                    print(flops, flush=True)
                    continue
                count = f"{flops / 1e12:.3f} TFLOP" if flops else "no count"
                print(f"{method} {case} {dtype}: {count} per device and step", flush=True)


if __name__ == "__main__":
    main()
