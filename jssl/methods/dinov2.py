"""DINOv2 (Oquab et al. 2023, "DINOv2: Learning Robust Visual Features without Supervision"),
following facebookresearch/dinov2 (dinov2/train/ssl_meta_arch.py ``forward_backward``,
dinov2/loss/{dino_clstoken_loss,ibot_patch_loss,koleo_loss}.py, dinov2/data/masking.py and
collate.py, dinov2/configs/ssl_default_config.yaml), with iBOT's masked student
(jssl.methods.masked_student) and DINO's teacher, schedules and checks
(jssl.methods.distillation).

Per step: the student sees its global crops with DINOv2's blockwise masks
(``masking.dinov2_spec``), the local crops unmasked; the teacher (EMA, no drop path) the global
crops unmasked. Three terms per global crop (:func:`terms`): ``dino`` (DINO's [CLS] loss),
``ibot`` (iBOT's masked-patch loss) and ``koleo`` (KoLeo on the student's class tokens, in
groups of ``koleo_group_size`` examples). The teacher's targets come from Sinkhorn-Knopp over
the global batch or DINO's EMA centres (``method.centering``); ``separate_head`` gives the
patches their own head. As DINOv2, the presets exempt LayerScale from weight decay.
Presets, epochs, numerics and deliberate differences: docs/methods.md#dinov2.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jssl import losses, parallel
from jssl.methods import (
    Forward,
    Method,
    Objective,
    common,
    distillation,
    koleo,
    masked_student,
    masking,
)
from jssl.models.heads import ClsPatchHeads, DINOHead
from jssl.parallel import DATA_AXIS

CENTERINGS = ("sinkhorn_knopp", "centering")


def terms(config: ml_collections.ConfigDict) -> tuple[common.LossTerm, ...]:
    """``dino_crop<t>``, ``ibot_crop<t>`` (shares 1 / T) and ``koleo_crop<t>`` (shares 1)."""
    crops = range(int(config.method.teacher_crops))
    terms = common.crop_terms("dino", crops) + common.crop_terms("ibot", crops)
    return terms + koleo.crop_terms(crops)


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    mcfg = config.method
    dtype = jnp.bfloat16 if config.model.dtype == "bfloat16" else jnp.float32

    def dino_head(prefix: str = "") -> DINOHead:
        return DINOHead(
            out_dim=int(mcfg[prefix + "out_dim"]),
            hidden_dim=int(mcfg[prefix + "hidden_dim"]),
            bottleneck_dim=int(mcfg[prefix + "bottleneck_dim"]),
            num_layers=int(mcfg[prefix + "num_layers"]),
            norm_last_layer=bool(mcfg.norm_last_layer),
            dtype=dtype,
        )

    head = ClsPatchHeads(dino_head(), dino_head("patch_")) if mcfg.separate_head else dino_head()
    model = masked_student.student_model(config, head)
    teacher = common.without_drop_path(model)
    spec = masking.dinov2_spec(mcfg.mask_ratio_min_max, mcfg.mask_sample_probability)
    teacher_crops, patch_size = int(mcfg.teacher_crops), int(config.model.patch_size)
    sinkhorn = mcfg.centering == "sinkhorn_knopp"
    plan = distillation.schedules(config, steps_per_epoch)
    temperature_at = plan.temperature_at(mcfg.warmup_teacher_temp, mcfg.teacher_temp)
    momentum_at = plan.momentum_at(mcfg.teacher_momentum)
    term_specs = terms(config)

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        params = masked_student.init_variables(model, rng, images)["params"]
        centers = {}
        if not sinkhorn:
            centers = {
                "center": jnp.zeros((int(mcfg.out_dim),), jnp.float32),
                "patch_center": jnp.zeros((patch_dim(config),), jnp.float32),
            }
        return dict(
            params=params,
            batch_stats={},
            **distillation.teacher_copy(params, {}),
            method_state=centers,
        )

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        views = masked_student.split_views(batch, teacher_crops)
        masks, slots, valid = masked_student.draw_masks(
            spec, views, patch_size, rng, batch["index"], True
        )
        student, _ = masked_student.apply_student(
            model, params, {}, views, masks, slots, rng, batch["index"], train
        )
        out = teacher.apply(
            {"params": state.ema_params},
            views.globals_,
            slots.reshape(-1, slots.shape[-1]),
            train,
            method=_teacher_masked_patches,
        )
        embeddings = masked_student.distillation_embeddings(student, out, valid, teacher_crops)
        return Forward(
            embeddings=dict(embeddings, cls_tokens=student["cls_tokens"].astype(jnp.float32)),
            features=student["features"],
            batch_stats={},
        )

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        temperature = temperature_at(state.step)
        teacher, teacher_patch = embeddings["teacher"], embeddings["teacher_patch"]
        mask = embeddings["mask"]
        carry = None
        if sinkhorn:
            iters = int(mcfg.sinkhorn_iterations)
            targets = losses.sinkhorn_centering(teacher, temperature, None, iters, DATA_AXIS)
            # Sinkhorn's targets into DINO's loss: logits log q at centre 0, temperature 1.
            cls_args = (losses.as_teacher_logits(targets), 0.0, mcfg.student_temp, 1.0)
            # The two Sinkhorn loops, then KoLeo's gathers, in one order (parallel.after).
            patch_targets = losses.sinkhorn_centering(
                parallel.after(teacher_patch, targets), temperature, mask > 0, iters, DATA_AXIS
            )
        else:
            center, patch_center = state.method_state["center"], state.method_state["patch_center"]
            cls_args = (teacher, center, mcfg.student_temp, temperature)
            patch_targets = losses.centred_probs(teacher_patch, patch_center, temperature)
            carry = {
                "batch_center": losses.dino_batch_center(teacher, DATA_AXIS),
                "patch_batch_center": losses.masked_batch_center(teacher_patch, mask, DATA_AXIS),
            }
        per_teacher, metrics = losses.dino_teacher_crop_losses(
            embeddings["student"], *cls_args, axis_name=DATA_AXIS
        )
        per_crop = losses.masked_patch_losses(
            embeddings["student_patch"], patch_targets, mask, mcfg.student_temp
        )
        spread = koleo.crop_losses(
            embeddings["cls_tokens"], int(mcfg.koleo_group_size), patch_targets
        )
        crops = range(teacher_crops)
        values = [per_teacher[t] for t in crops] + [per_crop[t] for t in crops] + spread
        metrics = dict(
            metrics,
            **masked_student.patch_metrics(embeddings, patch_targets),
            **distillation.collapse_metrics(metrics, teacher.shape[-1]),
            teacher_temp=temperature,
            teacher_momentum=momentum_at(state.step),
        )
        return Objective(
            terms={term.name: value for term, value in zip(term_specs, values, strict=True)},
            metrics=metrics,
            carry=carry,
        )

    centers = (
        ("center", "batch_center", mcfg.center_momentum),
        ("patch_center", "patch_batch_center", mcfg.center_momentum),
    )
    # Sinkhorn-Knopp centres each batch on its own: no centre to move.
    after_update = distillation.teacher_update(momentum_at, () if sinkhorn else centers)

    return Method(
        init=init,
        forward=forward,
        objective=objective,
        after_update=after_update,
        model=model,
        frozen_params=masked_student.last_layer_freeze(head, plan.freeze_steps),
    )


def patch_dim(config: ml_collections.ConfigDict) -> int:
    m = config.method
    return int(m.patch_out_dim if m.separate_head else m.out_dim)


def _teacher_masked_patches(module, images, slots, train):
    """DINOv2's teacher: the head on the class token and on the masked patches only."""
    taps = module.trunk(images, train=train)
    patches = jnp.take_along_axis(taps["patch_tokens"], slots[..., None], axis=1)
    return {
        "cls": module.head(taps["avgpool"], train=train),
        "patch": module.head(patches, train=train, patches=True),
    }


def check_config(config: ml_collections.ConfigDict) -> None:
    """DINO's start-up checks (crops, temperatures, momenta, head sizes), then DINOv2's."""
    distillation.check_config(config)
    masked_student.check_vit(config)
    m = config.method
    if m.get("use_bn_in_head", False):
        raise ValueError(
            "method.use_bn_in_head=True: DINOv2's heads have no batch norm (its recipes never "
            "set one; iBOT's --norm_in_head is configs/ibot.py's); set it False."
        )
    if m.centering not in CENTERINGS:
        raise ValueError(
            f"method.centering={m.centering!r}: use 'sinkhorn_knopp' (DINOv2's ViT-L/14 and "
            "ViT-g/14) or 'centering' (DINO's EMA centre; DINOv2's default config)."
        )
    if int(m.sinkhorn_iterations) < 1:
        raise ValueError(f"method.sinkhorn_iterations={m.sinkhorn_iterations} must be >= 1.")
    low, high = (float(r) for r in m.mask_ratio_min_max)
    if not 0.0 <= low <= high <= 1.0 or not 0.0 <= m.mask_sample_probability <= 1.0:
        raise ValueError(
            f"method.mask_ratio_min_max={tuple(m.mask_ratio_min_max)} must satisfy 0 <= min <= "
            f"max <= 1 and method.mask_sample_probability={m.mask_sample_probability} lie in "
            "[0, 1] (DINOv2: (0.1, 0.5) and 0.5)."
        )
    if m.separate_head:
        for field in ("patch_out_dim", "patch_hidden_dim", "patch_bottleneck_dim"):
            if int(m[field]) < 1:
                raise ValueError(f"method.{field}={m[field]} must be a positive integer.")
        if int(m.patch_num_layers) < 1:
            raise ValueError(f"method.patch_num_layers={m.patch_num_layers} must be >= 1.")
    koleo.check_group_size(config)
