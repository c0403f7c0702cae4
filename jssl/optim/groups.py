"""Parameters treated apart by the optimizer: learning rates per parameter-path prefix
(PyTorch parameter groups, VISSL's head optimizer params), a ViT's layer-wise learning-rate
decay (BEiT, MAE's fine-tuning) and parameters frozen for their first steps (VISSL
``MODEL.TEMP_FROZEN_PARAMS_ITER_MAP``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import traverse_util

from jssl.optim.schedules import Schedule, peak_learning_rate
from jssl.optim.transforms import build_optimizer


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
    weight_decay: float | None = None  # the group's own decay; None: the run's


def param_groups(optim_config: ml_collections.ConfigDict) -> tuple[ParamGroup, ...]:
    """``optim.param_groups`` validated: entries ``(prefix, lr_multiplier[, schedule]
    [, weight_decay])``, e.g. ``(("head", 10.0),)``, ``(("head", 1.0, 1e-6),)`` or
    ``(("head", 10.0, "constant", 0.0),)``: a string after the multiplier is the schedule, a
    number the group's weight decay. Errors name the field."""
    entries = tuple(optim_config.get("param_groups", ()) or ())
    example = (
        "--config.optim.param_groups=\"(('head', 10.0), ('predictor', 1.0, 'constant'), "
        "('head', 1.0, 1e-6))\""
    )
    groups = []
    for entry in entries:
        entry = tuple(entry) if isinstance(entry, (list, tuple)) else (entry,)
        rest = entry[2:]
        schedule = rest[0] if rest and isinstance(rest[0], str) else "schedule"
        if rest and isinstance(rest[0], str):
            rest = rest[1:]
        decay = rest[0] if rest else None
        valid = (
            len(entry) in (2, 3, 4)
            and isinstance(entry[0], str)
            and entry[0].strip("/")
            and _is_number(entry[1])
            and entry[1] >= 0
            and schedule in GROUP_SCHEDULES
            and len(rest) <= 1
            and (decay is None or (_is_number(decay) and decay >= 0))
        )
        if not valid:
            raise ValueError(
                f"optim.param_groups entry {entry!r}: each entry is (prefix, lr_multiplier"
                f"[, schedule][, weight_decay]) with a non-empty parameter-path prefix, a "
                f"multiplier >= 0, schedule one of {GROUP_SCHEDULES} and weight_decay >= 0; "
                f"e.g. {example}."
            )
        groups.append(
            ParamGroup(
                entry[0].strip("/"),
                float(entry[1]),
                schedule,
                None if decay is None else float(decay),
            )
        )
    prefixes = [g.prefix for g in groups]
    if len(set(prefixes)) < len(prefixes):
        raise ValueError(f"optim.param_groups names a prefix twice: {prefixes}.")
    return tuple(groups)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _with_weight_decay(
    optim_config: ml_collections.ConfigDict, weight_decay: float
) -> ml_collections.ConfigDict:
    """``optim_config`` with a group's own, constant weight decay."""
    group_config = ml_collections.ConfigDict(optim_config.to_dict())
    group_config.weight_decay = weight_decay
    # VISSL's head_optimizer_params.weight_decay is a value: without a
    # param_schedulers.weight_decay_head the head keeps it while the trunk's follows
    # param_schedulers.weight_decay (vissl/optimizers/param_groups/default.py).
    group_config.weight_decay_schedule = "constant"
    return group_config


# --------------------------------------------------------------------------------------------
# Layer-wise learning-rate decay (BEiT; MAE's util/lr_decay.py, DINOv2's fine-tuning)

# Trunk parameters before the first block: layer 0 (MAE's get_layer_id_for_vit; DINOv2's
# get_vit_lr_decay_rate adds the mask token and the register tokens).
LAYER_ZERO = ("patch_embed", "cls_token", "pos_embed", "mask_token", "register_tokens")
_BLOCK = re.compile(r"blocks_(\d+)")


def layer_decay(optim_config: ml_collections.ConfigDict) -> float:
    """``optim.layer_decay`` validated (1.0, the default and a config without the field: off)."""
    decay = optim_config.get("layer_decay", 1.0)
    if not _is_number(decay) or not 0.0 < decay <= 1.0:
        raise ValueError(
            f"optim.layer_decay={decay!r} must lie in (0, 1]: block i = 1..L of a ViT of depth L "
            "learns at decay ** (L + 1 - i) times the rate (MAE's ViT-B fine-tuning: 0.65, "
            "ViT-L: 0.75); 1.0 turns it off. Set --config.optim.layer_decay."
        )
    return float(decay)


def vit_layer_ids(params: Any) -> tuple[Any, int]:
    """``(tree of layer ids like params, depth)``: MAE's ``get_layer_id_for_vit`` on jssl's
    parameter paths. ``trunk/{patch_embed,cls_token,pos_embed,mask_token,register_tokens}``: 0;
    ``trunk/blocks_<i>/...``: i + 1; everything else (the final norm, heads, classifiers on
    taps, a predictor): depth + 1, at the full rate.

    A trunk without ``blocks_<i>`` (a ResNet or a RegNet) is refused: BEiT and MAE define the
    decay for ViT blocks only, and a ResNet's stages are not one layer each."""
    trunk = params.get("trunk", {}) if hasattr(params, "get") else {}
    blocks = [int(m.group(1)) for m in map(_BLOCK.fullmatch, trunk) if m]
    if not blocks:
        raise ValueError(
            "optim.layer_decay < 1: layer-wise learning-rate decay is defined for ViT "
            "trunks (parameters trunk/blocks_<i>), and this model's trunk has "
            f"{sorted(trunk)[:8]}. Set --config.optim.layer_decay=1.0 (off), or fine-tune a "
            "ViT (--config.model.trunk=vit_base)."
        )
    depth = max(blocks) + 1

    def layer(path, _) -> int:
        keys = [str(getattr(k, "key", k)) for k in path]
        if len(keys) < 2 or keys[0] != "trunk":
            return depth + 1
        if keys[1] in LAYER_ZERO:
            return 0
        block = _BLOCK.fullmatch(keys[1])
        return int(block.group(1)) + 1 if block else depth + 1

    return jax.tree_util.tree_map_with_path(layer, params), depth


def layer_scales(params: Any, decay: float) -> Any:
    """The learning-rate multiplier of every parameter under layer decay ``decay``:
    ``decay ** (depth + 1 - layer id)`` (MAE's ``layer_scales``), a tree like ``params``."""
    if decay == 1.0:
        return jax.tree.map(lambda _: 1.0, params)
    ids, depth = vit_layer_ids(params)
    return jax.tree.map(lambda layer: decay ** (depth + 1 - layer), ids)


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

    A group's weight decay (VISSL ``head_optimizer_params.use_different_wd`` and
    ``weight_decay``) replaces ``optim.weight_decay`` for its parameters, wherever the
    optimizer applies decay: added to the gradient for SGD and LARS, inside LARC's trust ratio,
    decoupled (times the group's rate) for AdamW, and only where ``regularize_bn`` /
    ``regularize_bias`` allow. It is constant: under ``weight_decay_schedule="cosine"`` the
    other parameters follow the schedule and the group keeps its value, as VISSL's head keeps
    ``head_optimizer_params.weight_decay`` when only ``param_schedulers.weight_decay`` is set.
    A group without one decays as the run does (schedule included).

    ``optim.layer_decay`` below 1 (a ViT trunk only: :func:`vit_layer_ids`) multiplies each
    parameter's rate, its group's included, by :func:`layer_scales`: MAE's ``param_groups_lrd``
    (``util/lr_decay.py``), a PyTorch group per layer whose ``lr_scale`` the schedule multiplies.
    Every (group, layer) pair is an optimizer of its own, so AdamW's decoupled decay is scaled
    with the rate as in PyTorch. Weight decay is not what sets the layers apart: biases and
    norms follow ``regularize_bias`` / ``regularize_bn``, and MAE's no-decay position embeddings
    and class token are groups with weight decay 0 (``configs/supervised.py:finetune_vit``).
    Without groups and layer decay this is exactly ``build_optimizer`` (same state, so old
    checkpoints load).
    """
    length = dict(steps_per_epoch=steps_per_epoch, num_epochs=num_epochs)  # weight-decay schedule
    groups = param_groups(optim_config)
    decay = layer_decay(optim_config)
    if not groups and decay == 1.0:
        return build_optimizer(optim_config, params, schedule, **length)
    names = _leaf_names(params)
    for group in groups:
        if not _any_leaf_under(params, group.prefix):
            raise ValueError(
                f"optim.param_groups prefix {group.prefix!r} matches no parameter; the "
                f"parameters are {sorted(names)[:8]}... (paths joined by '/')."
            )
    labels = jax.tree_util.tree_map_with_path(lambda path, _: _group_of(path, groups), params)
    # With layer decay, each (group, layer) pair is its own optimizer: label group * L + layer.
    layers, scale_of = 1, lambda layer: 1.0
    if decay != 1.0:
        layer_ids, depth = vit_layer_ids(params)
        layers, scale_of = depth + 2, lambda layer: decay ** (depth + 1 - layer)
        labels = jax.tree.map(lambda group, layer: group * layers + layer, labels, layer_ids)
    peak = peak_learning_rate(optim_config, global_batch)

    def group_schedule(group: ParamGroup) -> Schedule:
        if group.schedule == "constant":
            return optax.constant_schedule(group.lr_multiplier * peak)
        return lambda step, m=group.lr_multiplier: m * schedule(step)

    used = sorted(set(jax.tree.leaves(labels)))
    transforms = {}
    for label in used:
        sub_params = _select(params, labels, label)
        group, layer = divmod(label, layers)
        rate, group_config = schedule, optim_config
        if group < len(groups):
            rate = group_schedule(groups[group])
            if groups[group].weight_decay is not None:
                group_config = _with_weight_decay(optim_config, groups[group].weight_decay)
        scale = scale_of(layer)
        if scale != 1.0:
            rate = lambda step, r=rate, s=scale: s * r(step)  # noqa: E731
        transforms[label] = build_optimizer(group_config, sub_params, rate, **length)
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
