"""What DINO, iBOT and DINOv2 share as self-distillation methods: DINO's head built from the
method's fields, the teacher's schedules (momentum, temperature warmup, the last layer's
freeze), its update after the step (EMA and centres), the collapse monitor's metrics and DINO's
start-up checks, which iBOT and DINOv2 extend. Each of the three imports this module, none of
them another (the masked student iBOT and DINOv2 share: jssl.methods.masked_student).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections

from jssl import losses
from jssl.methods import common, koleo
from jssl.models.heads import DINOHead
from jssl.parallel import DATA_AXIS


def dino_head(config: ml_collections.ConfigDict, **fields: Any) -> DINOHead:
    """DINO's head of the method's fields (``out_dim``, ``hidden_dim``, ``bottleneck_dim``,
    ``num_layers``, ``use_bn_in_head``, ``norm_last_layer``) in the model's dtype and
    batch-norm axis; ``fields`` go to ``DINOHead`` (iBOT's ``patch_out_dim``)."""
    m = config.method
    return DINOHead(
        out_dim=int(m.out_dim),
        hidden_dim=int(m.hidden_dim),
        bottleneck_dim=int(m.bottleneck_dim),
        num_layers=int(m.num_layers),
        use_bn=bool(m.use_bn_in_head),
        norm_last_layer=bool(m.norm_last_layer),
        dtype=jnp.bfloat16 if config.model.dtype == "bfloat16" else jnp.float32,
        bn_axis_name=DATA_AXIS if config.model.sync_bn else None,
        **fields,
    )


class Schedules(NamedTuple):
    """The teacher's schedules in steps. Without the epoch length (evaluation engines) all
    are 0, so they read as finished."""

    total_steps: int
    warmup_steps: int  # method.warmup_teacher_temp_epochs
    freeze_steps: int  # method.freeze_last_layer_epochs: the last layer held fixed

    def momentum_at(self, momentum: float) -> Callable[[jax.Array], jax.Array]:
        """``step -> teacher momentum``: cosine from ``momentum`` to 1 over the run."""
        return lambda step: common.cosine_momentum(step, self.total_steps, momentum)

    def temperature_at(self, initial: float, final: float) -> Callable[[jax.Array], jax.Array]:
        """``step -> teacher temperature``: :func:`teacher_temperature` over the warmup."""
        return lambda step: teacher_temperature(step, initial, final, self.warmup_steps)


def schedules(config: ml_collections.ConfigDict, steps_per_epoch: int | None) -> Schedules:
    m, spe = config.method, steps_per_epoch or 0
    return Schedules(
        total_steps=spe * config.num_epochs,
        warmup_steps=int(round(m.warmup_teacher_temp_epochs * spe)),
        freeze_steps=int(round(m.freeze_last_layer_epochs * spe)),
    )


def teacher_temperature(
    step: jax.Array, initial: float, final: float, warmup_steps: int
) -> jax.Array:
    """VISSL's ``linspace(initial, final, warmup_steps)[step]``, then ``final``."""
    step = jnp.asarray(step, jnp.float32)
    progress = step / max(warmup_steps - 1, 1)
    return jnp.where(step < warmup_steps, initial + (final - initial) * progress, final)


def teacher_copy(params: Any, batch_stats: Any) -> dict[str, Any]:
    """The teacher's first state, a copy of the student (DINO Alg. 1; MoCo's key encoder,
    MSN's target): ``ema_params`` and ``ema_batch_stats``."""
    return dict(
        ema_params=jax.tree.map(jnp.copy, params),
        ema_batch_stats=jax.tree.map(jnp.copy, batch_stats),
    )


def teacher_update(
    momentum_at: Callable[[jax.Array], jax.Array],
    centers: tuple[tuple[str, str, float], ...] = (),
) -> Callable[[Any, dict | None], Any]:
    """``after_update``: the teacher an EMA of the student at ``momentum_at(k)`` after
    iteration k, its batch-norm statistics the forward's (``carry["ema_batch_stats"]``, where
    it hands some), and each ``(method_state key, carry key, momentum)`` centre moved towards
    the batch's (``losses.dino_update_center``)."""

    def after_update(state, carry):
        carry = carry or {}
        # state.step counts this update already.
        momentum = momentum_at(state.step - 1)
        changes = dict(ema_params=common.ema(state.params, state.ema_params, momentum))
        if "ema_batch_stats" in carry:
            changes["ema_batch_stats"] = carry["ema_batch_stats"]
        if centers:
            changes["method_state"] = {
                key: losses.dino_update_center(state.method_state[key], carry[batch], m)
                for key, batch, m in centers
            }
        return state.replace(**changes)

    return after_update


def collapse_metrics(metrics: dict, outputs: int) -> dict[str, jax.Array]:
    """The collapse monitor's (jssl.training.collapse): the [CLS] teacher's entropies over
    log K, 1 for uniform targets, the mean's 0 when one output dominates (DINO Sec. 5.3)."""
    names = ("teacher_entropy", "teacher_mean_entropy")
    return {f"collapse/{name}": metrics[name] / math.log(outputs) for name in names}


def check_config(config: ml_collections.ConfigDict) -> None:
    """DINO's start-up checks (crops, temperatures, momenta, head sizes), which iBOT and DINOv2
    run before their own."""
    mcfg = config.method
    if koleo.enabled(config):
        koleo.check_group_size(config)
    if tuple(config.model.head_dims):
        raise ValueError(
            f"model.head_dims={tuple(config.model.head_dims)}: DINO puts its own head on the "
            "trunk (method.hidden_dim, method.bottleneck_dim, method.out_dim); set "
            "--config.model.head_dims='()'."
        )
    _check_teacher_crops(config)
    for field in ("student_temp", "teacher_temp", "warmup_teacher_temp"):
        if mcfg[field] <= 0:
            raise ValueError(
                f"method.{field}={mcfg[field]} must be positive (DINO: student 0.1, teacher "
                "0.04 to 0.07)."
            )
    for field in ("teacher_momentum", "center_momentum"):
        if not 0.0 <= mcfg[field] <= 1.0:
            raise ValueError(f"method.{field}={mcfg[field]} must lie in [0, 1].")
    for field in ("out_dim", "hidden_dim", "bottleneck_dim", "num_layers"):
        if int(mcfg[field]) < 1:
            raise ValueError(f"method.{field}={mcfg[field]} must be a positive integer.")
    for field in ("warmup_teacher_temp_epochs", "freeze_last_layer_epochs"):
        if mcfg[field] < 0:
            raise ValueError(f"method.{field}={mcfg[field]} must be >= 0 (0: none).")


def _check_teacher_crops(config: ml_collections.ConfigDict) -> None:
    """The teacher's crops: the leading crop groups, of one size, two crops at least in all."""
    from jssl import data

    groups = data.crop_groups(config.data)
    total = sum(g.num_crops for g in groups)
    teacher = int(config.method.teacher_crops)
    leading, sizes = 0, set()
    for group in groups:
        if leading >= teacher:
            break
        leading += group.num_crops
        sizes.add(group.size)
    if total < 2:
        raise ValueError(
            f"data.augment.num_crops={tuple(config.data.augment.num_crops)}: DINO compares "
            "different crops of an image, so it needs at least two crops per image."
        )
    if teacher < 1 or leading != teacher:
        raise ValueError(
            f"method.teacher_crops={teacher} must be the number of crops in the leading crop "
            f"groups (data.augment.num_crops={tuple(config.data.augment.num_crops)}): DINO's "
            "teacher sees the global crops, e.g. num_crops='(1, 1, 8)' (two global crops that "
            "differ in blur and solarisation, eight local ones) with "
            "--config.method.teacher_crops=2."
        )
    if len(sizes) > 1:
        raise ValueError(
            f"method.teacher_crops={teacher} spans crop groups of different sizes {sorted(sizes)}: "
            "the teacher's (global) crops must share one size (data.augment.crop_sizes)."
        )
