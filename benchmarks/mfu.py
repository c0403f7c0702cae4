"""Arithmetic rate and model FLOPs utilisation (MFU) of a step, for train_step.py.

One device's floating-point operations in a step as XLA counts them, and one chip's peak, so
that ``TFLOP/s / peak`` is the step's MFU (e.g. MoCo R50@224 bf16 per GPU).
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
    """XLA's count of one step's floating-point operations on one device.

    Counted on the lowered program, before any backend rewrites it (the same count on CPU, GPU
    and TPU). jssl's step body runs under ``shard_map`` on per-device shapes, so the count is
    per device.
    """
    try:
        cost = lowered.cost_analysis()
    except Exception:  # noqa: BLE001 - an estimate that a backend may not give
        return None
    cost = cost[0] if isinstance(cost, list) else cost
    value = (cost or {}).get("flops")
    return float(value) if value and value > 0 else None
