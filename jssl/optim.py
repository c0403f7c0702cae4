"""Optimizers and their weight-decay and trust-ratio masks, built from optax.

VISSL's optimizer block maps onto ``config.optim``:

- ``sgd`` / ``adamw``: PyTorch's SGD (coupled weight decay, momentum on the raw step) and
  AdamW (decoupled decay).
- ``larc``: VISSL's ``sgd`` with ``use_larc: True``, i.e. apex's LARC wrapped around SGD
  (``apex/parallel/LARC.py``, ``vissl/optimizers/larc_fsdp.py``); see :func:`scale_by_larc`.
- ``lars``: VISSL's ``lars`` (``vissl/optimizers/lars.py``, from Barlow Twins): the trust ratio
  of the decayed gradient, momentum on the scaled step, the learning rate last.
- ``regularize_bn`` / ``regularize_bias`` become a weight-decay mask; ``exclude_bias_and_norm``
  and friends a trust-ratio mask (``trust_ratio_exclude``).
- ``param_schedulers.lr`` is :mod:`jssl.schedules`; its API is re-exported here
  (``optim.build_schedule``); ``param_schedulers.weight_decay`` (a cosine, DINO's ViT recipe)
  is :func:`weight_decay_schedule`.
- ``grad_clip_norm`` clips the global gradient norm (VISSL ``GRAD_CLIP``);
  ``grad_clip_per_parameter`` clips each parameter's gradient separately (DINO ``clip_grad``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import traverse_util

from jssl.schedules import (  # noqa: F401  (the schedule API, re-exported)
    SCHEDULES,
    Schedule,
    build_schedule,
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


class FrozenState(NamedTuple):
    count: jax.Array  # updates applied so far
    inner: optax.OptState


def freeze_for_steps(
    tx: optax.GradientTransformation, params: Any, frozen: Sequence[tuple[str, int]]
) -> optax.GradientTransformation:
    """``tx`` with the parameters under each path prefix held fixed for their first N steps
    (VISSL ``MODEL.TEMP_FROZEN_PARAMS_ITER_MAP``: SwAV's prototypes for 313 iterations).

    While frozen, a parameter's gradient is zeroed before ``tx`` and its update after it, so
    it does not move and the loss does not steer ``tx``'s state for it. Deliberate
    difference: PyTorch skips a parameter whose grad is None altogether, while here coupled
    weight decay still enters its momentum buffer during the freeze (``wd * p`` per step,
    1e-6 in VISSL's SwAV recipe, negligible).
    """
    frozen = tuple((str(prefix).strip("/"), int(steps)) for prefix, steps in frozen)
    if not frozen:
        return tx

    def until(path, _) -> int:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        matches = [n for prefix, n in frozen if name == prefix or name.startswith(prefix + "/")]
        return max(matches, default=0)

    steps_of = jax.tree_util.tree_map_with_path(until, params)
    unmatched = [p for p, _ in frozen if not _any_leaf_under(params, p)]
    if unmatched:
        raise ValueError(
            f"Frozen parameter prefix(es) {unmatched} match no parameter; the parameters are "
            f"{sorted(_leaf_names(params))[:8]}..."
        )

    def hold(tree, count):
        return jax.tree.map(lambda x, n: jnp.where(count < n, jnp.zeros_like(x), x), tree, steps_of)

    def init_fn(params):
        return FrozenState(jnp.zeros([], jnp.int32), tx.init(params))

    def update_fn(updates, state, params=None):
        updates, inner = tx.update(hold(updates, state.count), state.inner, params)
        return hold(updates, state.count), FrozenState(state.count + 1, inner)

    return optax.GradientTransformation(init_fn, update_fn)


def _leaf_names(params: Any) -> list[str]:
    return [
        "/".join(str(getattr(k, "key", k)) for k in path)
        for path, _ in jax.tree_util.tree_leaves_with_path(params)
    ]


def _any_leaf_under(params: Any, prefix: str) -> bool:
    return any(n == prefix or n.startswith(prefix + "/") for n in _leaf_names(params))


# --------------------------------------------------------------------------------------------
# Parameter groups: learning rates per parameter-path prefix

GROUP_SCHEDULES = ("schedule", "constant")


class ParamGroup(NamedTuple):
    prefix: str  # parameter path prefix, "head" or "trunk/layer4_1"
    lr_multiplier: float
    schedule: str  # "schedule": multiplier x the run's schedule; "constant": x its peak, always


def param_groups(optim_config: ml_collections.ConfigDict) -> tuple[ParamGroup, ...]:
    """``optim.param_groups`` validated: entries ``(prefix, lr_multiplier)`` or ``(prefix,
    lr_multiplier, "constant")``, e.g. ``(("head", 10.0),)``. Errors name the field."""
    entries = tuple(optim_config.get("param_groups", ()) or ())
    example = "--config.optim.param_groups=\"(('head', 10.0), ('predictor', 1.0, 'constant'))\""
    groups = []
    for entry in entries:
        entry = tuple(entry) if isinstance(entry, (list, tuple)) else (entry,)
        valid = (
            len(entry) in (2, 3)
            and isinstance(entry[0], str)
            and entry[0].strip("/")
            and isinstance(entry[1], (int, float))
            and entry[1] >= 0
            and (len(entry) == 2 or entry[2] in GROUP_SCHEDULES)
        )
        if not valid:
            raise ValueError(
                f"optim.param_groups entry {entry!r}: each entry is (prefix, lr_multiplier) or "
                f"(prefix, lr_multiplier, schedule) with a non-empty parameter-path prefix, a "
                f"multiplier >= 0 and schedule one of {GROUP_SCHEDULES}; e.g. {example}."
            )
        schedule = entry[2] if len(entry) == 3 else "schedule"
        groups.append(ParamGroup(entry[0].strip("/"), float(entry[1]), schedule))
    prefixes = [g.prefix for g in groups]
    if len(set(prefixes)) < len(prefixes):
        raise ValueError(f"optim.param_groups names a prefix twice: {prefixes}.")
    return tuple(groups)


def build_grouped_optimizer(
    optim_config: ml_collections.ConfigDict,
    params: Any,
    schedule: Schedule,
    global_batch: int,
    *,
    steps_per_epoch: int | None = None,
    num_epochs: int | None = None,
) -> optax.GradientTransformation:
    """:func:`build_optimizer`, with each ``optim.param_groups`` group as its own optimizer
    (PyTorch parameter groups: VISSL's ``head_optimizer_params`` with ``param_schedulers.lr_head``
    for the head, or any other prefix).

    A parameter belongs to the group of the longest prefix its path starts with (path
    components joined by "/"); the others form the default group at the run's schedule. A group's
    rate is ``lr_multiplier * schedule(step)``, or with ``"constant"`` ``lr_multiplier * peak``
    at every step, no warmup and no decay (``peak`` the batch-scaled ``base_lr``, as SimSiam's
    fixed predictor rate: ``(("head/predictor", 1.0, "constant"),)``). Each group runs the whole
    optimizer (weight-decay mask, momentum, LARC's clip at the group's rate, AdamW's decay times
    the group's rate) on its own parameters, as a PyTorch optimizer does per group.
    Without groups this is exactly ``build_optimizer`` (same state, so old checkpoints load).
    """
    length = dict(steps_per_epoch=steps_per_epoch, num_epochs=num_epochs)  # weight-decay schedule
    groups = param_groups(optim_config)
    if not groups:
        return build_optimizer(optim_config, params, schedule, **length)
    names = _leaf_names(params)
    for group in groups:
        if not _any_leaf_under(params, group.prefix):
            raise ValueError(
                f"optim.param_groups prefix {group.prefix!r} matches no parameter; the "
                f"parameters are {sorted(names)[:8]}... (paths joined by '/')."
            )
    labels = jax.tree_util.tree_map_with_path(lambda path, _: _group_of(path, groups), params)
    peak = peak_learning_rate(optim_config, global_batch)

    def group_schedule(group: ParamGroup) -> Schedule:
        if group.schedule == "constant":
            return optax.constant_schedule(group.lr_multiplier * peak)
        return lambda step, m=group.lr_multiplier: m * schedule(step)

    used = sorted(set(jax.tree.leaves(labels)))
    transforms = {}
    for label in used:
        sub_params = _select(params, labels, label)
        rate = schedule if label == len(groups) else group_schedule(groups[label])
        transforms[label] = build_optimizer(optim_config, sub_params, rate, **length)
    return _partition(transforms, labels)


def _group_of(path, groups: Sequence[ParamGroup]) -> int:
    """Index of the group with the longest prefix matching ``path``; len(groups) if none."""
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    matches = [
        (len(g.prefix), i)
        for i, g in enumerate(groups)
        if name == g.prefix or name.startswith(g.prefix + "/")
    ]
    return max(matches)[1] if matches else len(groups)


def _select(tree: Any, labels: Any, label: int) -> dict:
    """The nested dict of the leaves of ``tree`` labelled ``label`` (paths kept)."""
    flat = traverse_util.flatten_dict(tree)
    flat_labels = traverse_util.flatten_dict(labels)
    return traverse_util.unflatten_dict({k: v for k, v in flat.items() if flat_labels[k] == label})


class PartitionState(NamedTuple):
    inner: tuple  # one optimizer state per group present, in label order


def _partition(transforms: dict[int, optax.GradientTransformation], labels: Any):
    """Each labelled part of the tree through its own transformation, merged back in place.
    (optax.multi_transform masks with placeholder nodes, which the weight-decay and
    trust-ratio masks built on the full tree cannot follow; sub-trees keep them exact.)"""
    order = sorted(transforms)

    def init_fn(params):
        return PartitionState(
            tuple(transforms[label].init(_select(params, labels, label)) for label in order)
        )

    def update_fn(updates, state, params=None):
        merged, inner = {}, []
        for label, part_state in zip(order, state.inner, strict=True):
            part_params = None if params is None else _select(params, labels, label)
            part, new_state = transforms[label].update(
                _select(updates, labels, label), part_state, part_params
            )
            merged.update(traverse_util.flatten_dict(part))
            inner.append(new_state)
        # Laid out as the incoming tree (its dict types and key order) for the caller.
        out = jax.tree_util.tree_map_with_path(
            lambda path, _: merged[tuple(getattr(k, "key", k) for k in path)], updates
        )
        return out, PartitionState(tuple(inner))

    return optax.GradientTransformation(init_fn, update_fn)
