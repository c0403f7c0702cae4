"""Optimizers, learning-rate schedules and weight-decay masks, all from optax.

VISSL's optimizer block (sgd / lars / adamw, ``regularize_bn``, ``regularize_bias``,
``param_schedulers.lr`` with ``update_interval: epoch | step`` and ``auto_lr_scaling``) maps
onto ``config.optim`` here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import traverse_util

Schedule = Callable[[jax.Array], jax.Array]

OPTIMIZERS = ("sgd", "lars", "adamw")
SCHEDULES = ("multistep", "cosine", "constant")


def peak_learning_rate(optim_config: ml_collections.ConfigDict, global_batch: int) -> float:
    """VISSL's auto_lr_scaling: base_lr * batch / base_lr_batch_size (linear scaling rule,
    Goyal et al. 2017). ``base_lr_batch_size <= 0`` turns scaling off."""
    ref = optim_config.base_lr_batch_size
    if ref and ref > 0:
        return optim_config.base_lr * global_batch / ref
    return optim_config.base_lr


def build_schedule(
    optim_config: ml_collections.ConfigDict,
    *,
    steps_per_epoch: int,
    num_epochs: int,
    global_batch: int,
) -> Schedule:
    """The learning rate as a function of the optimizer step.

    Milestones and warmup are given in epochs (as VISSL's configs do); with
    ``update_interval="epoch"`` the rate changes only at epoch boundaries.
    """
    peak = peak_learning_rate(optim_config, global_batch)
    total = steps_per_epoch * num_epochs
    warmup = int(round(optim_config.warmup_epochs * steps_per_epoch))
    name = optim_config.schedule
    if name == "multistep":
        boundaries = {int(m * steps_per_epoch): optim_config.gamma for m in optim_config.milestones}
        main = optax.piecewise_constant_schedule(peak, boundaries)
    elif name == "cosine":
        main = optax.cosine_decay_schedule(
            peak, decay_steps=max(total - warmup, 1), alpha=optim_config.final_lr_fraction
        )
    elif name == "constant":
        main = optax.constant_schedule(peak)
    else:
        raise ValueError(
            f"optim.schedule={name!r} is not one of {SCHEDULES}; set --config.optim.schedule."
        )
    schedule = main
    if warmup > 0:
        warm = optax.linear_schedule(optim_config.warmup_start_lr, peak, warmup)
        # Multistep milestones count from the start of training; a decay starts after warmup.
        after = main if name == "multistep" else (lambda s: main(s - warmup))

        def schedule(step):
            return jnp.where(step < warmup, warm(step), after(step))

    if optim_config.update_interval == "epoch":
        return lambda step: schedule((step // steps_per_epoch) * steps_per_epoch)
    if optim_config.update_interval != "step":
        raise ValueError(
            f"optim.update_interval={optim_config.update_interval!r} must be 'step' or 'epoch'."
        )
    return schedule


def weight_decay_mask(params: Any, *, regularize_bn: bool, regularize_bias: bool) -> Any:
    """True where weight decay applies. VISSL's regularize_bn covers batch-norm scale and
    bias; regularize_bias covers the biases of the other layers."""

    def decide(path: tuple[str, ...]) -> bool:
        in_bn = any("bn" in part.lower() or part.startswith("BatchNorm") for part in path[:-1])
        if in_bn:
            return regularize_bn
        if path[-1] == "bias":
            return regularize_bias
        return True

    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({k: decide(k) for k in flat})


def build_optimizer(
    optim_config: ml_collections.ConfigDict, params: Any, schedule: Schedule
) -> optax.GradientTransformation:
    """The optax chain for ``optim.name``. Weight decay is coupled (added to the gradient)
    for SGD and LARS, as in PyTorch's SGD that VISSL wraps, and decoupled for AdamW."""
    mask = weight_decay_mask(
        params,
        regularize_bn=optim_config.regularize_bn,
        regularize_bias=optim_config.regularize_bias,
    )
    wd = optim_config.weight_decay
    name = optim_config.name
    if name == "sgd":
        tx = optax.chain(
            optax.add_decayed_weights(wd, mask),
            optax.sgd(schedule, momentum=optim_config.momentum, nesterov=optim_config.nesterov),
        )
    elif name == "lars":
        # LARS excludes the same parameters from adaptation as from weight decay (SimCLR, BYOL).
        tx = optax.lars(
            schedule,
            weight_decay=wd,
            weight_decay_mask=mask,
            trust_coefficient=optim_config.lars_eta,
            trust_ratio_mask=mask,
            momentum=optim_config.momentum,
            nesterov=optim_config.nesterov,
        )
    elif name == "adamw":
        tx = optax.adamw(
            schedule, b1=optim_config.betas[0], b2=optim_config.betas[1], weight_decay=wd, mask=mask
        )
    else:
        raise ValueError(
            f"optim.name={name!r} is not one of {OPTIMIZERS}; set --config.optim.name."
        )
    if optim_config.grad_clip_norm and optim_config.grad_clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(optim_config.grad_clip_norm), tx)
    return tx
