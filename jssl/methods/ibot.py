"""iBOT (Zhou et al. 2022, "iBOT: Image BERT Pre-Training with Online Tokenizer"), following
bytedance/ibot (main_ibot.py ``iBOTLoss`` and its training loop, loader.py ``ImageFolderMask``,
models/head.py ``iBOTHead``) and VISSL's port (vissl/losses/ibot_loss.py), with DINO's teacher,
schedules and checks (jssl.methods.distillation) and the masked student DINOv2 shares
(jssl.methods.masked_student).

Per step: each global crop of the student gets a blockwise mask (``jssl.methods.masking``) and
the mask token in the masked places; the teacher (EMA, no drop path) sees the global crops
unmasked. Two losses: DINO's [CLS] loss, and the patch loss (``losses.masked_patch_losses``)
of the student's patch outputs at a crop's masked places against the teacher's centred,
sharpened outputs there; each has its own centre and teacher temperature. The patch tokens get
their own last layer unless ``shared_head``, and the student's patch head runs on the masked
places only (the same loss). Terms per global crop (:func:`terms`).

Masks, head, recipes and deliberate differences: docs/methods.md#ibot.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jssl import losses
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
from jssl.methods.ibot_checks import check_config  # noqa: F401  (the registry's hook)
from jssl.parallel import DATA_AXIS


def terms(config: ml_collections.ConfigDict) -> tuple[common.LossTerm, ...]:
    """``cls_crop<t>`` (family ``cls``, iBOT's ``lambda1``) and ``patch_crop<t>`` (family
    ``patch``, ``lambda2``) for t < ``method.teacher_crops``, each at 1 / teacher_crops, so the
    families are iBOT's ``total_loss1`` and ``total_loss2``; per crop for DINO's reasons
    (:func:`jssl.methods.dino.terms`: the masked crop is target and prediction). With
    ``loss.weights.koleo`` set, KoLeo's ``koleo_crop<t>`` too (jssl.methods.koleo)."""
    crops = range(int(config.method.teacher_crops))
    terms = common.crop_terms("cls", crops) + common.crop_terms("patch", crops)
    return terms + koleo.optional_terms(config, crops)


def mask_spec(config: ml_collections.ConfigDict) -> masking.MaskSpec:
    m = config.method
    return masking.ibot_spec(m.pred_ratio, m.pred_ratio_var, m.pred_shape)


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    mcfg = config.method
    head = distillation.dino_head(
        config, patch_out_dim=0 if mcfg.shared_head else int(mcfg.patch_out_dim)
    )
    model = masked_student.student_model(config, head)
    teacher_head = head.clone(patch_out_dim=0 if mcfg.shared_head_teacher else head.patch_out_dim)
    teacher = common.without_drop_path(model).clone(head=teacher_head)
    spec, teacher_crops = mask_spec(config), int(mcfg.teacher_crops)
    patch_size = int(config.model.patch_size)
    plan = distillation.schedules(config, steps_per_epoch)
    start = int(round(mcfg.pred_start_epoch * (steps_per_epoch or 0)))
    momentum_at = plan.momentum_at(mcfg.teacher_momentum)
    cls_temperature_at = plan.temperature_at(mcfg.warmup_teacher_temp, mcfg.teacher_temp)
    term_specs = terms(config)
    spread = koleo.enabled(config)

    def temperatures(step):
        cls = cls_temperature_at(step)
        # iBOT's teacher_temp2_schedule: held at the warmup value until masking starts.
        patch = distillation.teacher_temperature(
            jnp.maximum(step - start, 0),
            mcfg.warmup_teacher_patch_temp,
            mcfg.teacher_patch_temp,
            plan.warmup_steps,
        )
        return cls, patch

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        variables = masked_student.init_variables(model, rng, images)
        params, batch_stats = variables["params"], variables.get("batch_stats", {})
        return dict(
            params=params,
            batch_stats=batch_stats,
            **distillation.teacher_copy(params, batch_stats),
            method_state={
                "center": jnp.zeros((int(mcfg.out_dim),), jnp.float32),
                "patch_center": jnp.zeros((teacher_patch_dim(config),), jnp.float32),
            },
        )

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        views = masked_student.split_views(batch, teacher_crops)
        masks, slots, valid = masked_student.draw_masks(
            spec, views, patch_size, rng, batch["index"], state.step >= start
        )
        student, batch_stats = masked_student.apply_student(
            model, params, state.batch_stats, views, masks, slots, rng, batch["index"], train
        )
        # A teacher head's batch norm normalises with its batch's statistics (as DINO's).
        out, ema_batch_stats = common.apply_variables(
            teacher,
            {"params": state.ema_params, "batch_stats": state.ema_batch_stats},
            train,
            views.globals_,
            slots.reshape(-1, slots.shape[-1]),
            train,
            method=_teacher_all_patches,
        )
        embeddings = masked_student.distillation_embeddings(student, out, valid, teacher_crops)
        mean = common.split_crops(out["patch_mean"].astype(jnp.float32), teacher_crops)
        embeddings["teacher_patch_mean"] = jax.lax.stop_gradient(mean)
        if spread:
            embeddings["cls_tokens"] = student["cls_tokens"].astype(jnp.float32)
        return Forward(
            embeddings=embeddings,
            features=student["features"],
            batch_stats=batch_stats,
            carry={"ema_batch_stats": common.mean_over_devices(ema_batch_stats)},
        )

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        cls_temp, patch_temp = temperatures(state.step)
        center, patch_center = state.method_state["center"], state.method_state["patch_center"]
        per_teacher, metrics = losses.dino_teacher_crop_losses(
            embeddings["student"],
            embeddings["teacher"],
            center,
            mcfg.student_temp,
            cls_temp,
            axis_name=DATA_AXIS,
        )
        targets = losses.centred_probs(embeddings["teacher_patch"], patch_center, patch_temp)
        per_crop = losses.masked_patch_losses(
            embeddings["student_patch"], targets, embeddings["mask"], mcfg.student_temp
        )
        crops = range(int(mcfg.teacher_crops))
        values = [per_teacher[t] for t in crops] + [per_crop[t] for t in crops]
        if spread:
            group = int(mcfg.koleo_group_size)
            values += koleo.crop_losses(embeddings["cls_tokens"], group, per_crop)
        metrics = dict(
            metrics,
            **masked_student.patch_metrics(embeddings, targets),
            teacher_temp=cls_temp,
            teacher_patch_temp=patch_temp,
            teacher_momentum=momentum_at(state.step),
            center_norm=jnp.linalg.norm(center),
            patch_center_norm=jnp.linalg.norm(patch_center),
            **distillation.collapse_metrics(metrics, embeddings["teacher"].shape[-1]),
        )
        return Objective(
            terms={term.name: value for term, value in zip(term_specs, values, strict=True)},
            metrics=metrics,
            carry={
                "batch_center": losses.dino_batch_center(embeddings["teacher"], DATA_AXIS),
                "patch_batch_center": losses.dino_batch_center(
                    embeddings["teacher_patch_mean"], DATA_AXIS
                ),
            },
        )

    after_update = distillation.teacher_update(
        momentum_at,
        (
            ("center", "batch_center", mcfg.center_momentum),
            ("patch_center", "patch_batch_center", mcfg.patch_center_momentum),
        ),
    )

    return Method(
        init=init,
        forward=forward,
        objective=objective,
        after_update=after_update,
        model=model,
        frozen_params=masked_student.last_layer_freeze(head, plan.freeze_steps),
    )


def teacher_patch_dim(config: ml_collections.ConfigDict) -> int:
    m = config.method
    return int(m.out_dim if m.shared_head_teacher else m.patch_out_dim)


def _teacher_all_patches(module, images, slots, train):
    """iBOT's teacher: the head on the class token and on EVERY patch token (their mean feeds
    the patch centre), the patch outputs also taken at the masked places."""
    taps = module.trunk(images, train=train)
    patch = module.head(taps["patch_tokens"], train=train, patches=True)  # (rows, P, K')
    return {
        "cls": module.head(taps["avgpool"], train=train),
        "patch": jnp.take_along_axis(patch, slots[..., None], axis=1),
        "patch_mean": jnp.mean(patch.astype(jnp.float32), axis=1),
    }
