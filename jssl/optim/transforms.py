"""The optax chain of each optimizer VISSL names, with its weight-decay and trust-ratio
masks, LARC, the weight-decay schedule and per-parameter gradient clipping (the mapping from
VISSL's optimizer block is in :mod:`jssl.optim`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import traverse_util

from jssl.optim.schedules import (  # noqa: F401  (the schedule API, re-exported)
    SCHEDULES,
    Schedule,
    build_schedule,
    computed_once,
    peak_learning_rate,
    warmup_start_learning_rate,
)

OPTIMIZERS = ("sgd", "larc", "lars", "adamw")
TRUST_RATIO_EXCLUDES = ("no_decay", "bias_and_norm", "none")

# Fields added for LARC, with the values that keep the older behaviour, so that a config
# saved before they existed (a workdir's) still builds.
_DEFAULTS = {
    "larc_clip": False,
    "larc_eps": 1e-8,
    "trust_ratio_exclude": "no_decay",
    "weight_decay_schedule": "constant",
    "weight_decay_end": None,  # None: optim.weight_decay
    "grad_clip_per_parameter": 0.0,
}
WEIGHT_DECAY_SCHEDULES = ("constant", "cosine")


def _get(optim_config: ml_collections.ConfigDict, name: str) -> Any:
    return optim_config.get(name, _DEFAULTS[name])


# --------------------------------------------------------------------------------------------
# Masks


def weight_decay_mask(params: Any, *, regularize_bn: bool, regularize_bias: bool) -> Any:
    """True where weight decay applies, by VISSL's rule (``_get_norm_optimizer_params`` in
    ``vissl/optimizers/param_groups/default.py``): regularize_bn covers the scale of
    normalisation layers (batch norm; a ViT's LayerNorms ``norm``, ``norm1``, ``norm2``) and
    LayerScale's ``gamma`` (a per-channel scale, which DINOv2's and MAE's groups exempt too);
    regularize_bias covers the biases of the other layers; a norm layer's bias is decayed only
    when both are on (it is a norm parameter and a bias)."""

    def is_norm(part: str) -> bool:
        lower = part.lower()
        return "bn" in lower or lower.startswith(("norm", "batchnorm", "layernorm"))

    def decide(path: tuple[str, ...]) -> bool:
        in_bn = any(is_norm(part) for part in path[:-1]) or path[-1] == "gamma"
        if in_bn:
            return regularize_bn and (path[-1] != "bias" or regularize_bias)
        if path[-1] == "bias":
            return regularize_bias
        return True

    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({k: decide(k) for k in flat})


def trust_ratio_mask(params: Any, exclude: str, decay_mask: Any) -> Any:
    """True where LARS/LARC adapt the step by the trust ratio; elsewhere the (decayed)
    gradient goes to momentum unscaled.

    ``"none"``: every parameter (apex LARC; VISSL LARS ``exclude_bias_and_norm: False``);
    ``"bias_and_norm"``: all but 1-D parameters, biases and norm scales/offsets (VISSL LARS
    ``exclude_bias_and_norm: True``); ``"no_decay"``: those weight decay applies to (SimCLR's
    and BYOL's papers)."""
    if exclude == "none":
        return jax.tree.map(lambda _: True, params)
    if exclude == "bias_and_norm":
        return jax.tree.map(lambda p: len(getattr(p, "shape", ())) > 1, params)
    if exclude == "no_decay":
        return decay_mask
    raise ValueError(
        f"optim.trust_ratio_exclude={exclude!r} is not one of {TRUST_RATIO_EXCLUDES}; "
        "set --config.optim.trust_ratio_exclude."
    )


# --------------------------------------------------------------------------------------------
# LARC


class ScaleByLarcState(NamedTuple):
    count: jax.Array  # optimizer steps taken; the clip mode reads the rate at this step


def _norm(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32))))


def scale_by_larc(
    learning_rate: float | Schedule,
    *,
    trust_coefficient: float = 0.001,
    clip: bool = False,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Any = None,
    trust_ratio_mask: Any = None,
) -> optax.GradientTransformation:
    """apex's LARC step (``apex/parallel/LARC.py``, VISSL's ``larc_fsdp.py``), before momentum.

    For each parameter ``p`` with gradient ``g`` and its weight decay ``wd`` (0 where
    ``weight_decay_mask`` is False):

        ratio = trust_coefficient * |p| / (|g| + wd * |p| + eps)     # |g| of the RAW gradient
        ratio = min(ratio / lr, 1)                                   # clip=True only
        update = (g + wd * p) * ratio

    LARC absorbs the optimizer's weight decay, so the SGD that follows must not decay again.
    Where ``|p| == 0`` or ``|g| == 0`` apex leaves the gradient as it is: ratio 1 and NO weight
    decay. Where ``trust_ratio_mask`` is False the update is ``g + wd * p`` (decayed, not
    adapted: VISSL's ``exclude_bias_and_norm``). ``lr`` is ``learning_rate`` at this step,
    the rate the SGD that follows applies.
    """

    def init_fn(params):
        del params
        return ScaleByLarcState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "scale_by_larc needs the params: call tx.update(grads, state, params)."
            )
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        decay = weight_decay_mask(params) if callable(weight_decay_mask) else weight_decay_mask
        adapt = trust_ratio_mask(params) if callable(trust_ratio_mask) else trust_ratio_mask
        decay = jax.tree.map(lambda _: True, params) if decay is None else decay
        adapt = jax.tree.map(lambda _: True, params) if adapt is None else adapt

        def one(g, p, decayed, adapted):
            wd = weight_decay * decayed  # a Python bool: 0 where the mask is False
            with_decay = g + wd * p
            if not adapted:
                return with_decay
            p_norm, g_norm = _norm(p), _norm(g)
            ratio = trust_coefficient * p_norm / (g_norm + p_norm * wd + eps)
            if clip:
                ratio = jnp.minimum(ratio / lr, 1.0)
            scaled = (with_decay * ratio).astype(g.dtype)
            return jnp.where((p_norm != 0) & (g_norm != 0), scaled, g)

        new = jax.tree.map(one, updates, params, decay, adapt)
        return new, ScaleByLarcState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------------------------
# Weight-decay schedule and per-parameter gradient clipping (DINO)


def weight_decay_schedule(
    optim_config: ml_collections.ConfigDict,
    steps_per_epoch: int | None = None,
    num_epochs: int | None = None,
) -> float | Schedule:
    """``optim.weight_decay`` as a float, or with ``weight_decay_schedule="cosine"`` a function
    of the optimizer step from ``weight_decay`` to ``weight_decay_end`` over the run:
    ``end + (start - end) * (1 + cos(pi * k / total)) / 2`` (DINO ``utils.cosine_scheduler``
    0.04 -> 0.4; VISSL ``param_schedulers.weight_decay`` cosine). ``update_interval="epoch"``
    holds it for an epoch, as the learning rate."""
    start = optim_config.weight_decay
    kind = _get(optim_config, "weight_decay_schedule")
    if kind == "constant":
        return start
    if kind != "cosine":
        raise ValueError(
            f"optim.weight_decay_schedule={kind!r} is not one of {WEIGHT_DECAY_SCHEDULES}; set "
            "--config.optim.weight_decay_schedule."
        )
    if not steps_per_epoch or not num_epochs:
        raise ValueError(
            "optim.weight_decay_schedule='cosine' needs the run's length; this engine builds "
            "its optimizer without it: set --config.optim.weight_decay_schedule=constant."
        )
    end = _get(optim_config, "weight_decay_end")
    end = start if end is None else end
    total = steps_per_epoch * num_epochs
    per_epoch = optim_config.update_interval == "epoch"

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        if per_epoch:
            step = jnp.floor(step / steps_per_epoch) * steps_per_epoch
        where = jnp.clip(step / total, 0.0, 1.0)
        return end + (start - end) * jnp.square(jnp.cos(0.5 * jnp.pi * where))

    return schedule


def clip_by_parameter_norm(max_norm: float) -> optax.GradientTransformation:
    """Each parameter's gradient scaled to an L2 norm of at most ``max_norm``, separately (DINO
    ``utils.clip_gradients``: ``g *= max_norm / (|g| + 1e-6)`` where that factor is below 1),
    unlike ``optax.clip_by_global_norm`` (PyTorch ``clip_grad_norm_``, VISSL ``GRAD_CLIP``)."""

    def clip(g):
        scale = max_norm / (_norm(g) + 1e-6)
        return jnp.where(scale < 1.0, g * scale.astype(g.dtype), g)

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


# --------------------------------------------------------------------------------------------
# Optimizers


def build_optimizer(
    optim_config: ml_collections.ConfigDict,
    params: Any,
    schedule: Schedule,
    *,
    steps_per_epoch: int | None = None,
    num_epochs: int | None = None,
) -> optax.GradientTransformation:
    """The optax chain for ``optim.name``. Weight decay is coupled (added to the gradient)
    for SGD, LARC and LARS, as in the PyTorch optimizers VISSL wraps, and decoupled for AdamW.
    Momentum accumulates the step before the learning rate scales it, as PyTorch's does
    (``buf = m * buf + d; p -= lr * buf``), which matters while the rate changes. The run's
    length (``steps_per_epoch``, ``num_epochs``) is needed by a weight-decay schedule only."""
    mask = weight_decay_mask(
        params,
        regularize_bn=optim_config.regularize_bn,
        regularize_bias=optim_config.regularize_bias,
    )
    wd = weight_decay_schedule(optim_config, steps_per_epoch, num_epochs)
    # Each rate computed once per step, not inside every parameter's update (computed_once).
    schedule = computed_once(schedule) if callable(schedule) else schedule
    wd = computed_once(wd) if callable(wd) else wd
    name = optim_config.name
    if callable(wd) and name == "larc":
        raise ValueError(
            "optim.weight_decay_schedule='cosine' is not supported with optim.name='larc' "
            "(LARC folds a constant decay into its trust ratio); use sgd, lars or adamw."
        )
    momentum = optax.trace(decay=optim_config.momentum, nesterov=optim_config.nesterov)
    if name == "sgd":
        tx = optax.chain(
            optax.add_decayed_weights(wd, mask),
            optax.sgd(schedule, momentum=optim_config.momentum, nesterov=optim_config.nesterov),
        )
    elif name == "larc":
        exclude = trust_ratio_mask(params, _get(optim_config, "trust_ratio_exclude"), mask)
        tx = optax.chain(
            scale_by_larc(
                schedule,
                trust_coefficient=optim_config.lars_eta,
                clip=_get(optim_config, "larc_clip"),
                eps=_get(optim_config, "larc_eps"),
                weight_decay=wd,
                weight_decay_mask=mask,
                trust_ratio_mask=exclude,
            ),
            momentum,
            optax.scale_by_learning_rate(schedule),
        )
    elif name == "lars":
        # VISSL's _LARS: ratio = eta * |p| / |g + wd * p| (no eps), 1 where a norm is zero.
        exclude = trust_ratio_mask(params, _get(optim_config, "trust_ratio_exclude"), mask)
        tx = optax.chain(
            optax.add_decayed_weights(wd, mask),
            optax.masked(
                optax.scale_by_trust_ratio(trust_coefficient=optim_config.lars_eta), exclude
            ),
            momentum,
            optax.scale_by_learning_rate(schedule),
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
    per_parameter = _get(optim_config, "grad_clip_per_parameter")
    if per_parameter and per_parameter > 0:
        tx = optax.chain(clip_by_parameter_norm(per_parameter), tx)
    return tx
