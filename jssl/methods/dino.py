"""DINO (Caron et al. 2021, "Emerging Properties in Self-Supervised Vision Transformers"), as
VISSL trains it (vissl/losses/dino_loss.py, vissl/hooks/dino_hooks.py,
vissl/models/heads/dino_head.py, configs/config/pretrain/dino/*.yaml) and as the DINO
repository trains a ResNet-50 (main_dino.py, its README's ResNet-50 command).

Per step: the student (trunk + ``DINOHead``) runs on every crop; the teacher, its EMA, on the
first ``method.teacher_crops`` (global) crops, in train mode and without gradient. The loss is
the cross-entropy of the teacher's centred, sharpened distribution against the student's over
every pair of different crops, one term per teacher crop (:func:`terms`). The forward stops at
the head's 256-d bottleneck and the objective applies the 65536-wide last layer, so exact
accumulation keeps narrow embeddings. After the step the teacher moves towards the student and
the centre follows the teacher's global-batch mean; temperature warmup and the last layer's
freeze are per step. Recipes and deliberate differences: docs/methods.md#dino.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jssl import losses, models
from jssl.methods import Forward, Method, Objective, common, distillation, koleo
from jssl.methods.distillation import check_config  # noqa: F401  (the registry's hook)
from jssl.models.heads import dino_last_layer
from jssl.parallel import DATA_AXIS

LAST_LAYER = "head/last_layer"


def terms(config: ml_collections.ConfigDict) -> tuple[common.LossTerm, ...]:
    """One term per teacher crop: ``cross_entropy_crop<t>`` for t < ``method.teacher_crops``,
    the student's cross-entropy against teacher crop t's distribution over the other crops,
    each weighing 1 / teacher_crops by default (their sum is DINO's mean over all pairs);
    ``loss.weights.cross_entropy`` scales them all; to float32 rounding, not bit for bit (each
    teacher crop's sum is divided by C - 1 first: at most 2.2e-7 relative per example). Per
    teacher crop because the teacher crop is the target (as SwAV's assignment crop), and the
    global crops differ (blur 1.0 / 0.1, solarisation on the second), so weighing the clean
    against the solarised target is a real choice, one field per term known when the config is
    written; local crops are exchangeable, and weighing them against global ones is not offered.
    With ``loss.weights.koleo`` set, KoLeo's ``koleo_crop<t>`` too (jssl.methods.koleo)."""
    crops = range(int(config.method.teacher_crops))
    return common.crop_terms("cross_entropy", crops) + koleo.optional_terms(config, crops)


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    mcfg = config.method
    head = distillation.dino_head(config)
    # The trunk (and its taps) of models.build_model, DINO's head in place of the MLP head.
    model = models.build_model(config.model, bn_axis_name=head.bn_axis_name).clone(head=head)
    # The forward's networks stop at the bottleneck (the objective applies the last layer).
    # DINO builds its teacher without stochastic depth (main_dino.py: only the student gets
    # drop_path_rate), so the teacher's forward is the same network with none.
    student_model = model.clone(head=head.clone(last_layer=False))
    teacher_model = common.without_drop_path(student_model)
    teacher_crops = int(mcfg.teacher_crops)
    plan = distillation.schedules(config, steps_per_epoch)
    teacher_temp_at = plan.temperature_at(mcfg.warmup_teacher_temp, mcfg.teacher_temp)
    momentum_at = plan.momentum_at(mcfg.teacher_momentum)
    term_specs = terms(config)
    spread = koleo.enabled(config)

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        variables = model.init(rng, images, train=False)
        batch_stats = variables.get("batch_stats", {})  # none in a ViT with a BN-free head
        return dict(
            params=variables["params"],
            batch_stats=batch_stats,
            **distillation.teacher_copy(variables["params"], batch_stats),
            method_state={"center": jnp.zeros((int(mcfg.out_dim),), jnp.float32)},
        )

    def teacher_groups(crops):
        """The leading crop groups that hold the teacher's crops (checked at start-up)."""
        groups, count = [], 0
        for group in crops:
            if count >= teacher_crops:
                break
            groups.append(group)
            count += group.shape[1]
        return tuple(groups)

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        count = common.num_crops(batch)
        # The student's drop path, keyed by (step, crop, example index).
        out, batch_stats = common.forward_crops(
            student_model, params, state.batch_stats, batch["crops"], train, rng, batch.get("index")
        )
        student = common.split_crops(out["head"].astype(jnp.float32), count)  # (C, n, bottleneck)
        teacher_out, ema_batch_stats = common.forward_crops(
            teacher_model,
            state.ema_params,
            state.ema_batch_stats,
            teacher_groups(batch["crops"]),
            train,
        )
        teacher = jax.lax.stop_gradient(
            common.split_crops(teacher_out["head"].astype(jnp.float32), teacher_crops)
        )
        embeddings = {"student": student, "teacher": teacher}
        if spread:  # KoLeo's input: the student's trunk output on the teacher's crops
            tokens = common.split_crops(out["avgpool"].astype(jnp.float32), count)
            embeddings["tokens"] = tokens[:teacher_crops]
        return Forward(
            # The normalised bottlenecks, (C, n, bottleneck_dim) and (T, n, bottleneck_dim).
            embeddings=embeddings,
            features=out["avgpool"][: student.shape[1]],
            batch_stats=batch_stats,
            # No per-example head output: it is out_dim (65536) wide.
            carry={"ema_batch_stats": common.mean_over_devices(ema_batch_stats)},
        )

    def logits(params, bottleneck):
        last = params["head"]["last_layer"]
        return dino_last_layer(last, bottleneck, int(mcfg.out_dim), bool(mcfg.norm_last_layer))

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        teacher = jax.lax.stop_gradient(logits(state.ema_params, embeddings["teacher"]))
        temperature = teacher_temp_at(state.step)
        per_teacher, metrics = losses.dino_teacher_crop_losses(
            logits(state.params, embeddings["student"]),
            teacher,
            state.method_state["center"],
            mcfg.student_temp,
            temperature,
            axis_name=DATA_AXIS,
        )
        metrics = dict(
            metrics,
            teacher_temp=temperature,
            teacher_momentum=momentum_at(state.step),
            center_norm=jnp.linalg.norm(state.method_state["center"]),
            **distillation.collapse_metrics(metrics, teacher.shape[-1]),
        )
        values = [per_teacher[t] for t in range(teacher_crops)]
        if spread:
            group = int(mcfg.koleo_group_size)
            values += koleo.crop_losses(embeddings["tokens"], group, per_teacher)
        return Objective(
            terms={term.name: value for term, value in zip(term_specs, values, strict=True)},
            metrics=metrics,
            carry={"batch_center": losses.dino_batch_center(teacher, DATA_AXIS)},
        )

    after_update = distillation.teacher_update(
        momentum_at, (("center", "batch_center", mcfg.center_momentum),)
    )

    return Method(
        init=init,
        forward=forward,
        objective=objective,
        after_update=after_update,
        model=model,
        frozen_params=((LAST_LAYER, plan.freeze_steps),) if plan.freeze_steps > 0 else (),
    )
