"""Learning-rate schedules as VISSL computes them (``config.optim``'s schedule fields).

VISSL's ``param_schedulers.lr`` maps onto ``schedule`` (``multistep`` | ``cosine`` |
``constant`` | ``cosine_warm_restart`` | ``inverse_sqrt``) with an optional linear warmup: its
``composite`` of a ``linear`` warmup and the schedule (fvcore ``CompositeParamScheduler``),
``interval_scaling`` of the part after the warmup (``[rescaled, fixed]`` in VISSL's SimCLR and
SwAV recipes: the cosine runs on the global progress, so the rate drops at the end of the
warmup) and ``update_interval: step | epoch``; ``auto_lr_scaling`` as
``vissl/utils/hydra_config.py`` rewrites the schedule (``peak_learning_rate``,
``warmup_start_learning_rate``, ``build_schedule``). The rate at optimizer step ``k`` is
VISSL's at ``where = k / total_steps`` (ClassyVision sets it from ``task.where`` right before
each update and counts the update afterwards); where VISSL's float64 arithmetic decides a jump
(the warmup's end, a restart), the step is found on the host in float64, so the jump falls on
VISSL's step. The restarts' waves are in :mod:`jssl.optim.restart_schedules`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging

from jssl.optim.restart_schedules import (
    RESTART_WAVE_TYPES,
    Schedule,
    cosine_warm_restart,
    first_step_where,
)

SCHEDULES = ("multistep", "cosine", "constant", "cosine_warm_restart", "inverse_sqrt")
LR_SCALINGS = ("linear", "sqrt")
INTERVAL_SCALINGS = ("rescaled", "fixed")

# fvcore/ClassyVision ParamScheduler.WHERE_EPSILON: the composite scheduler moves on to its
# next part once ``where + WHERE_EPSILON`` passes a boundary.
WHERE_EPSILON = 1e-6

# Fields added for VISSL's composite schedules, with the values that keep the older
# behaviour, so that a config saved before they existed (a workdir's) still builds.
_DEFAULTS = {
    "lr_scaling": "linear",
    "warmup_start_nodes": 0,
    "interval_scaling": "rescaled",
    "restart_interval_length": 0.5,
    "restart_wave_type": "half",
    "restart_lr_multiplier": 1.0,
    "restart_adaptive": False,
}


def _get(optim_config: ml_collections.ConfigDict, name: str) -> Any:
    return optim_config.get(name, _DEFAULTS[name])


def _choice(optim_config: ml_collections.ConfigDict, name: str, choices: tuple[str, ...]) -> str:
    value = _get(optim_config, name)
    if value not in choices:
        raise ValueError(
            f"optim.{name}={value!r} is not one of {choices}; set --config.optim.{name}."
        )
    return value


def peak_learning_rate(optim_config: ml_collections.ConfigDict, global_batch: int) -> float:
    """VISSL's auto_lr_scaling: ``base_lr * (batch / base_lr_batch_size)``, the factor under a
    square root with ``lr_scaling="sqrt"`` (linear rule: Goyal et al. 2017).
    ``base_lr_batch_size <= 0`` turns scaling off."""
    ref = optim_config.base_lr_batch_size
    if not (ref and ref > 0):
        return optim_config.base_lr
    factor = global_batch / ref
    if _choice(optim_config, "lr_scaling", LR_SCALINGS) == "sqrt":
        factor = math.sqrt(factor)
    return optim_config.base_lr * factor


def warmup_start_learning_rate(optim_config: ml_collections.ConfigDict, global_batch: int) -> float:
    """Where the linear warmup starts.

    ``warmup_start_lr`` as given, unless auto-scaling is on and ``warmup_start_nodes > 0``:
    then VISSL's ``resolve_linear_schedule`` overwrites the warmup's start with the base rate
    scaled LINEARLY (whatever ``lr_scaling`` says) to the batch of ONE node,
    ``base_lr * (global_batch / nodes) / base_lr_batch_size`` (0.6 for SimCLR's 4096 on 8
    nodes). The node count is a config field, not the machine's, so that the curve does not
    depend on the topology a run happens to use.
    """
    nodes = _get(optim_config, "warmup_start_nodes")
    ref = optim_config.base_lr_batch_size
    if nodes and nodes > 0 and ref and ref > 0:
        return optim_config.base_lr * (global_batch / nodes) / ref
    return optim_config.warmup_start_lr


def build_schedule(
    optim_config: ml_collections.ConfigDict,
    *,
    steps_per_epoch: int,
    num_epochs: int,
    global_batch: int,
) -> Schedule:
    """The learning rate as a function of the optimizer step.

    Milestones and warmup are given in epochs (VISSL's ``lengths`` are fractions of the run:
    ``warmup_epochs = lengths[0] * num_epochs``). The rate at step ``k`` is VISSL's at
    ``where = k / total_steps`` (ClassyVision steps the schedule before the update); with
    ``update_interval="epoch"`` it changes only at epoch boundaries. The cosine ends at
    ``peak * final_lr_fraction`` (VISSL keeps the YAML's ``end_value / start_value``); on one
    node (``warmup_start_nodes=1``) a warmup that would not climb is dropped, as VISSL's
    ``resolve_linear_schedule`` does.
    """
    scaling = _choice(optim_config, "interval_scaling", INTERVAL_SCALINGS)
    peak = peak_learning_rate(optim_config, global_batch)
    start = warmup_start_learning_rate(optim_config, global_batch)
    total = max(steps_per_epoch * num_epochs, 1)
    warmup_epochs = optim_config.warmup_epochs
    name = optim_config.schedule
    nodes = _get(optim_config, "warmup_start_nodes")
    if warmup_epochs > 0 and nodes == 1 and optim_config.base_lr_batch_size > 0 and start <= peak:
        # resolve_linear_schedule on one node: a warmup that would not climb is dropped and
        # the main schedule alone covers the whole run.
        logging.info("optim: warmup from %g to %g does not climb on one node; dropped", start, peak)
        warmup_epochs = 0.0
    if name == "cosine":
        fraction = warmup_epochs / max(num_epochs, 1)
        schedule = _vissl_cosine(optim_config, scaling, peak, start, fraction, total)
    elif name in ("cosine_warm_restart", "inverse_sqrt"):
        fraction = warmup_epochs / max(num_epochs, 1)
        # inverse_sqrt's warmup_interval_length is the configured warmup, kept when the
        # one-node rule drops the warmup itself (VISSL leaves the YAML's value alone).
        configured_fraction = optim_config.warmup_epochs / max(num_epochs, 1)
        schedule = _vissl_composite(
            optim_config, scaling, peak, start, fraction, configured_fraction, total
        )
    elif name in ("multistep", "constant"):
        schedule = _warmup_then(optim_config, peak, start, warmup_epochs, steps_per_epoch)
    else:
        raise ValueError(
            f"optim.schedule={name!r} is not one of {SCHEDULES}; set --config.optim.schedule."
        )
    if optim_config.update_interval == "epoch":
        return lambda step: schedule((step // steps_per_epoch) * steps_per_epoch)
    if optim_config.update_interval != "step":
        raise ValueError(
            f"optim.update_interval={optim_config.update_interval!r} must be 'step' or 'epoch'."
        )
    return schedule


def _vissl_cosine(
    optim_config: ml_collections.ConfigDict,
    scaling: str,
    peak: float,
    start: float,
    warmup_fraction: float,
    total: int,
) -> Schedule:
    """fvcore's CompositeParamScheduler of LinearParamScheduler(start, peak) over
    ``warmup_fraction`` of the run (rescaled) and CosineParamScheduler(peak, end) over the
    rest; with ``interval_scaling="fixed"`` the cosine reads the global progress, so the rate
    drops at the end of the warmup instead of starting over from the peak."""
    _check_warmup_fraction(optim_config, warmup_fraction)
    end = peak * optim_config.final_lr_fraction  # VISSL: scaled_lr * end_value / start_value
    # The warmup holds while where + WHERE_EPSILON <= fraction, i.e. up to this step; the
    # bound is computed in float64 here rather than compared in float32 inside the step.
    last_warmup_step = (warmup_fraction - WHERE_EPSILON) * total if warmup_fraction > 0 else -1.0

    def schedule(step):
        where = jnp.clip(jnp.asarray(step, jnp.float32) / total, 0.0, 1.0)
        if scaling == "fixed":
            cosine_where = where
        else:
            cosine_where = (where - warmup_fraction) / (1.0 - warmup_fraction)
        # fvcore: end + 0.5 * (peak - end) * (1 + cos(pi * w)); 1 + cos(x) = 2 cos(x / 2)^2
        # keeps float32 accurate near the end of the run, where 1 + cos(x) cancels.
        cosine = end + (peak - end) * jnp.square(jnp.cos(0.5 * jnp.pi * cosine_where))
        if warmup_fraction <= 0:
            return cosine
        linear_where = where / warmup_fraction
        linear = peak * linear_where + start * (1.0 - linear_where)
        return jnp.where(step <= last_warmup_step, linear, cosine)

    return schedule


def _check_warmup_fraction(optim_config: ml_collections.ConfigDict, fraction: float) -> None:
    if not 0.0 <= fraction < 1.0:
        raise ValueError(
            f"optim.warmup_epochs={optim_config.warmup_epochs} leaves no epoch for the "
            f"{optim_config.schedule} after it; set it below num_epochs."
        )


def _vissl_composite(
    optim_config: ml_collections.ConfigDict,
    scaling: str,
    peak: float,
    start: float,
    warmup_fraction: float,
    configured_fraction: float,
    total: int,
) -> Schedule:
    """fvcore's CompositeParamScheduler of LinearParamScheduler(start, peak) over
    ``warmup_fraction`` of the run and ``cosine_warm_restart`` or ``inverse_sqrt`` over the
    rest, which reads ``where`` (``interval_scaling="fixed"``, or no warmup) or
    ``(where - begin) / length`` with fvcore's ``begin = running_total - length``.

    ``inverse_sqrt`` is VISSL's InverseSqrtScheduler
    (``vissl/optimizers/param_scheduler/inverse_sqrt_decay.py``, ``start_value`` = the peak):
    ``decay * where**-0.5``, ``decay`` at ``where == 0``, ``decay = peak * sqrt(W)`` with
    ``W = warmup_interval_length`` (``peak`` when 0), here the configured warmup fraction. After
    that warmup it is ``peak * sqrt(W / where)``; without one, ``peak / sqrt(where)``: above
    the peak all run, as in VISSL.
    """
    _check_warmup_fraction(optim_config, warmup_fraction)
    length, begin = 1.0, 0.0
    if warmup_fraction > 0 and scaling == "rescaled":
        length = 1.0 - warmup_fraction
        begin = (warmup_fraction + length) - length  # as fvcore rounds it
    first_main_step = 0
    if warmup_fraction > 0:  # fvcore moves on once where + WHERE_EPSILON passes the warmup
        first_main_step = first_step_where(
            total, lambda k: k / total + WHERE_EPSILON > warmup_fraction
        )
    if optim_config.schedule == "cosine_warm_restart":
        main = cosine_warm_restart(
            peak,
            peak * optim_config.final_lr_fraction,  # VISSL: scaled_lr * end_value / start_value
            total,
            first_main_step,
            begin,
            length,
            interval=float(_get(optim_config, "restart_interval_length")),
            wave=_choice(optim_config, "restart_wave_type", RESTART_WAVE_TYPES),
            adaptive=_get(optim_config, "restart_adaptive"),
            multiplier=_get(optim_config, "restart_lr_multiplier"),
        )
    elif warmup_fraction > 0 and scaling == "rescaled":
        raise ValueError(
            "optim.schedule='inverse_sqrt' after a warmup needs the global progress: rescaled, "
            "its where restarts at ~0 and the rate spikes to decay / sqrt(where) (VISSL's too). "
            "Set --config.optim.interval_scaling=fixed."
        )
    else:
        decay = peak * math.sqrt(configured_fraction) if configured_fraction > 0 else peak

        def main(step):
            where = jnp.maximum(step, 1).astype(jnp.float32) / total
            return jnp.where(step > 0, decay * jax.lax.rsqrt(where), decay)

    def schedule(step):
        step = jnp.clip(jnp.asarray(step, jnp.int32), 0, total)
        if warmup_fraction <= 0:
            return main(step)
        linear_where = step.astype(jnp.float32) / total / warmup_fraction
        linear = peak * linear_where + start * (1.0 - linear_where)
        return jnp.where(step < first_main_step, linear, main(step))

    return schedule


def _warmup_then(
    optim_config: ml_collections.ConfigDict,
    peak: float,
    start: float,
    warmup_epochs: float,
    steps_per_epoch: int,
) -> Schedule:
    """A multistep or constant rate after an optional linear warmup. ``interval_scaling``
    does not apply: multistep milestones always count from the start of training."""
    if optim_config.schedule == "multistep":
        boundaries = {int(m * steps_per_epoch): optim_config.gamma for m in optim_config.milestones}
        main = optax.piecewise_constant_schedule(peak, boundaries)
    else:
        main = optax.constant_schedule(peak)
    warmup = int(round(warmup_epochs * steps_per_epoch))
    if warmup <= 0:
        return main
    warm = optax.linear_schedule(start, peak, warmup)
    return lambda step: jnp.where(step < warmup, warm(step), main(step))


def computed_once(schedule: Schedule) -> Schedule:
    """``schedule`` with the same values, computed once per step instead of once per parameter.

    XLA's CPU fusion copies cheap scalar arithmetic into each consumer, so every parameter's
    update fusion would recompute the rate (a fifth of ResNet-18's MoCo step in HLO
    instructions). ``jax.lax.optimization_barrier`` does not stop it (the CPU pipeline expands
    barriers before fusing) and an identity ``cond`` is simplified away; a sort of two copies of
    the rate is neither fused nor simplified, so the rate's ops run once, in their own fusion.
    """

    def once(step):
        value = jnp.asarray(schedule(step))
        return jnp.sort(jnp.stack([value, value]))[0]

    return once


RAMP_KINDS = ("constant", "linear", "cosine")
RAMP_UNITS = ("epochs", "steps")


def ramp(kind: str, initial: float, final: float, begin: int, end: int) -> Schedule:
    """A value that holds ``initial`` up to step ``begin``, moves to ``final`` by step ``end``
    (a straight line, or half a cosine period: slow at both ends) and holds ``final`` after;
    ``kind="constant"`` is ``final`` throughout. The loss-term weights' schedules (a KL weight
    warmed up over training, DINO's teacher temperature warmup)."""
    if kind not in RAMP_KINDS:
        raise ValueError(f"ramp kind {kind!r} is not one of {RAMP_KINDS}")
    if kind == "constant":
        return lambda step: jnp.asarray(final, jnp.float32)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        if end <= begin:  # a step at ``begin``
            progress = (step >= begin).astype(jnp.float32)
        else:
            progress = jnp.clip((step - begin) / (end - begin), 0.0, 1.0)
        if kind == "linear":
            return initial + (final - initial) * progress
        return final + (initial - final) * jnp.square(jnp.cos(0.5 * jnp.pi * progress))

    return schedule
