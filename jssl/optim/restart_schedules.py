"""VISSL's cosine warm-restart schedule, and the host-side search that places its jumps.

``optim.schedule="cosine_warm_restart"``: jssl.optim.schedules reads the config and composes it
after fvcore's linear warmup (as it does ``inverse_sqrt``); this module holds the waves. VISSL
decides in float64 which wave and which interval of length ``L`` a step is in; those decisions
are made here once per run, on the host in float64 (``first_step_where``), so every restart
falls on VISSL's step, and the compiled schedule only looks them up.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

Schedule = Callable[[jax.Array], jax.Array]  # step -> value (jssl.optim.schedules' alias)

RESTART_WAVE_TYPES = ("half", "full")


def first_step_where(total: int, reached: Callable[[int], bool]) -> int:
    """The first step in ``[0, total]`` at which ``reached`` (monotone, evaluated on the host in
    float64 as VISSL evaluates it) holds; ``total + 1`` if none."""
    low, high = 0, total + 1
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if reached(middle) else (middle + 1, high)
    return low


def _changes(total: int, first: int, value_at: Callable[[int], int]) -> tuple[jax.Array, list]:
    """``value_at`` (integer, non-decreasing in the step) from step ``first`` on, as the steps
    where it changes and its values: at ``step`` it is ``values[sum(step >= changes)]``."""
    values, changes = [value_at(first)], []
    while (step := first_step_where(total, lambda k, v=values[-1]: value_at(k) > v)) <= total:
        changes.append(step)
        values.append(value_at(step))
    return jnp.asarray(changes, jnp.int32), values


def cosine_warm_restart(
    peak: float,
    end: float,
    total: int,
    first_step: int,
    begin: float,
    length: float,
    *,
    interval: float,
    wave: str,
    adaptive: bool,
    multiplier: float,
) -> Schedule:
    """VISSL's CosineWarmRestartScheduler
    (``vissl/optimizers/param_scheduler/cosine_warm_restart_scheduler.py``) from ``peak`` to
    ``end`` (``get_scaled_lr_scheduler`` scales it as a cosine), on
    ``where = (k / total - begin) / length`` from ``first_step`` on.

    With ``L = interval`` (``restart_interval_length``) the restarts are
    ``[0] + arange(L, 1, L)`` (``wave="half"``) or ``[0] + arange(L, 1, 2L)`` (full); restart
    ``i = max(bisect(restarts, where) - 1, 0)`` has the peak ``peak * multiplier**i``, or with
    ``adaptive`` the plain cosine's value at the restart (half) or at ``L + restart`` (full, the
    first wave too, which so starts below ``peak``). The rate is
    ``end + 0.5 * (wave_peak - end) * (1 + cos(pi * w))`` with ``w = (where % L) / L`` (half:
    falls, jumps back) or ``where / L`` (full: falls and rises, the peak changing at the
    troughs).
    """
    if not interval > 0:
        raise ValueError(
            f"optim.restart_interval_length={interval} must be > 0 (a fraction of the run "
            "after the warmup); set --config.optim.restart_interval_length."
        )
    restarts = [0.0] + np.arange(interval, 1.0, interval * (1 if wave == "half" else 2)).tolist()
    if adaptive:
        shift = 0.0 if wave == "half" else interval
        peaks = [end + 0.5 * (peak - end) * (1 + math.cos(math.pi * (shift + r))) for r in restarts]
    else:
        peaks = [peak * multiplier**i for i in range(len(restarts))]

    def where(k: int) -> float:  # the host float64 where, as fvcore computes it
        return (k / total - begin) / length

    # The wave (bisect) and the interval of length L (Python's float %, i.e. divmod) each step
    # is in, as VISSL's float64 decides them.
    wave_changes, waves = _changes(
        total, first_step, lambda k: max(bisect.bisect(restarts, where(k)) - 1, 0)
    )
    interval_changes, intervals = _changes(
        total, first_step, lambda k: int(divmod(where(k), interval)[0])
    )
    wave_peaks = jnp.asarray([peaks[i] for i in waves], jnp.float32)
    # The step (float64) at which each interval begins, as whole steps and a fraction so that
    # the step's offset from it is accurate in float32 late in a long run.
    starts = [total * (begin + length * n * interval) for n in intervals]
    starts_whole = jnp.asarray([math.floor(x) for x in starts], jnp.int32)
    starts_fraction = jnp.asarray([x - math.floor(x) for x in starts], jnp.float32)
    odd = jnp.asarray([n % 2 == 1 for n in intervals])

    def schedule(step):
        i = jnp.sum(step >= interval_changes)
        offset = (step - starts_whole[i]).astype(jnp.float32) - starts_fraction[i]
        within = jnp.clip(offset / (total * length * interval), 0.0, 1.0)  # (where % L) / L
        # 0.5 * (1 + cos(pi * (n + within))), n intervals in (0 for half waves), as cos^2 or,
        # n odd, sin^2 of pi / 2 * within: accurate in float32 near the troughs.
        factor = jnp.square(jnp.cos(0.5 * jnp.pi * within))
        if wave == "full":
            factor = jnp.where(odd[i], jnp.square(jnp.sin(0.5 * jnp.pi * within)), factor)
        return end + (wave_peaks[jnp.sum(step >= wave_changes)] - end) * factor

    return schedule
