"""iBOT (Zhou et al. 2022, "iBOT: Image BERT Pre-Training with Online Tokenizer"), following
bytedance/ibot (main_ibot.py ``iBOTLoss`` and its training loop, loader.py ``ImageFolderMask``,
models/head.py ``iBOTHead``) and VISSL's port (vissl/losses/ibot_loss.py), on top of DINO
(jssl.methods.dino: its loss, teacher, schedules and start-up checks).

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

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections

from jssl import losses, models
from jssl.methods import Forward, Method, Objective, common, dino, koleo, masking

# The start-up checks the method registry and DINOv2 call on this module.
from jssl.methods.ibot_checks import check_config, check_vit  # noqa: F401
from jssl.models.heads import DINOHead
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
    dtype = jnp.bfloat16 if config.model.dtype == "bfloat16" else jnp.float32
    head = DINOHead(
        out_dim=int(mcfg.out_dim),
        hidden_dim=int(mcfg.hidden_dim),
        bottleneck_dim=int(mcfg.bottleneck_dim),
        num_layers=int(mcfg.num_layers),
        use_bn=bool(mcfg.use_bn_in_head),
        norm_last_layer=bool(mcfg.norm_last_layer),
        dtype=dtype,
        bn_axis_name=DATA_AXIS if config.model.sync_bn else None,
        patch_out_dim=0 if mcfg.shared_head else int(mcfg.patch_out_dim),
    )
    model = student_model(config, head)
    teacher_head = head.clone(patch_out_dim=0 if mcfg.shared_head_teacher else head.patch_out_dim)
    teacher = common.without_drop_path(model).clone(head=teacher_head)
    spec, teacher_crops = mask_spec(config), int(mcfg.teacher_crops)
    patch_size = int(config.model.patch_size)
    spe = steps_per_epoch or 0  # no epoch length (evaluation engines): schedules read as done
    total_steps = spe * config.num_epochs
    warmup = int(round(mcfg.warmup_teacher_temp_epochs * spe))
    start = int(round(mcfg.pred_start_epoch * spe))
    freeze_steps = int(round(mcfg.freeze_last_layer_epochs * spe))
    term_specs = terms(config)
    spread = koleo.enabled(config)

    def temperatures(step):
        cls = dino.teacher_temperature(step, mcfg.warmup_teacher_temp, mcfg.teacher_temp, warmup)
        # iBOT's teacher_temp2_schedule: held at the warmup value until masking starts.
        patch = dino.teacher_temperature(
            jnp.maximum(step - start, 0),
            mcfg.warmup_teacher_patch_temp,
            mcfg.teacher_patch_temp,
            warmup,
        )
        return cls, patch

    def momentum_at(step):
        return common.cosine_momentum(step, total_steps, mcfg.teacher_momentum)

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        variables = model.init(rng, images, method=_init_both_paths)
        params, batch_stats = variables["params"], variables.get("batch_stats", {})
        return dict(
            params=params,
            batch_stats=batch_stats,
            ema_params=jax.tree.map(jnp.copy, params),
            ema_batch_stats=jax.tree.map(jnp.copy, batch_stats),
            method_state={
                "center": jnp.zeros((int(mcfg.out_dim),), jnp.float32),
                "patch_center": jnp.zeros((teacher_patch_dim(config),), jnp.float32),
            },
        )

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        views = split_views(batch, teacher_crops)
        masks, slots, valid = draw_masks(
            spec, views, patch_size, rng, batch["index"], state.step >= start
        )
        student, batch_stats = apply_student(
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
        embeddings = distillation_embeddings(student, out, valid, teacher_crops)
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
            **patch_metrics(embeddings, targets),
            teacher_temp=cls_temp,
            teacher_patch_temp=patch_temp,
            teacher_momentum=momentum_at(state.step),
            center_norm=jnp.linalg.norm(center),
            patch_center_norm=jnp.linalg.norm(patch_center),
            **collapse_metrics(metrics, embeddings["teacher"].shape[-1]),
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

    def after_update(state, carry):
        # state.step counts this update already; the EMA after iteration k uses m(k).
        momentum = momentum_at(state.step - 1)
        method_state = {
            "center": losses.dino_update_center(
                state.method_state["center"], carry["batch_center"], mcfg.center_momentum
            ),
            "patch_center": losses.dino_update_center(
                state.method_state["patch_center"],
                carry["patch_batch_center"],
                mcfg.patch_center_momentum,
            ),
        }
        return state.replace(
            ema_params=common.ema(state.params, state.ema_params, momentum),
            ema_batch_stats=carry["ema_batch_stats"],
            method_state=method_state,
        )

    return Method(
        init=init,
        forward=forward,
        objective=objective,
        after_update=after_update,
        model=model,
        frozen_params=last_layer_freeze(head, freeze_steps),
    )


def teacher_patch_dim(config: ml_collections.ConfigDict) -> int:
    m = config.method
    return int(m.out_dim if m.shared_head_teacher else m.patch_out_dim)


# ---------------------------------------------------------------------------------------------
# Pieces DINOv2 shares (jssl.methods.dinov2)


def student_model(config: ml_collections.ConfigDict, head: Any) -> Any:
    """The trunk of ``models.build_model`` with a mask token, ``head`` on it."""
    model = models.build_model(config.model)
    return model.clone(trunk=model.trunk.clone(mask_token=True), head=head)


def init_params(model: Any, rng: jax.Array, images: jax.Array) -> Any:
    """Every parameter, those of the patch path included (``_init_both_paths``)."""
    return model.init(rng, images, method=_init_both_paths)["params"]


def _init_both_paths(module, images):
    taps = module.trunk(images, train=False)
    return module.head(taps["avgpool"], train=False), module.head(
        taps["patch_tokens"], train=False, patches=True
    )


def last_layer_freeze(head: Any, steps: int) -> tuple[tuple[str, int], ...]:
    """The head's last layers held for ``steps`` (iBOT and DINOv2: every parameter named
    ``last_layer``, the patch one included)."""
    if steps <= 0:
        return ()
    if isinstance(head, DINOHead):
        names = ["head/last_layer"] + (["head/last_layer2"] if head.patch_out_dim else [])
    else:  # ClsPatchHeads
        names = ["head/cls/last_layer", "head/patch/last_layer"]
    return tuple((name, steps) for name in names)


class Views(NamedTuple):
    """The crops as the trunk takes them: ``globals_`` (T * n, S, S, 3) the teacher's crops,
    crop-major; ``locals_``: one (crops * n, s, s, 3) batch per further resolution."""

    globals_: jax.Array
    locals_: list[jax.Array]


def split_views(batch: dict, teacher_crops: int) -> Views:
    """The leading crop groups holding the ``teacher_crops`` global crops (checked at start-up
    to share one size), then the rest, consecutive groups of one size together."""
    glob, rest, count = [], [], 0
    for group in batch["crops"]:
        (glob if count < teacher_crops else rest).append(group)
        count += group.shape[1]
    by_size: list[list[jax.Array]] = []
    for group in rest:
        if by_size and by_size[-1][0].shape[2:] == group.shape[2:]:
            by_size[-1].append(group)
        else:
            by_size.append([group])

    def crop_major(groups):
        stacked = jnp.concatenate(groups, axis=1)
        return jnp.swapaxes(stacked, 0, 1).reshape(-1, *stacked.shape[2:])

    return Views(crop_major(glob), [crop_major(g) for g in by_size])


def draw_masks(spec: masking.MaskSpec, views: Views, patch_size: int, rng, index, active):
    """``(masks (T*n, P) bool, slots (T, n, K) int32, valid (T, n, K) bool)``: each global
    crop's mask keyed by (step, example, crop), all False while ``active`` is False, and the
    places of its masked patches (``masking.masked_slots``)."""
    n = index.shape[0]
    crops = views.globals_.shape[0] // n
    grid = (views.globals_.shape[1] // patch_size, views.globals_.shape[2] // patch_size)
    keys = common.example_keys(rng, index, common.MASK_STREAM)
    masks = masking.sample_masks(spec, keys, crops, grid) & active  # (T, n, P)
    slots, valid = masking.masked_slots(masks, masking.max_masked(spec, grid[0] * grid[1]))
    return masks.reshape(crops * n, -1), slots, valid


def distillation_embeddings(student: dict, teacher: dict, valid, teacher_crops: int) -> dict:
    """What iBOT's and DINOv2's forward hand their objective: the student's [CLS] and
    masked-patch outputs, the teacher's (stop-gradient, laid out per teacher crop) and the
    mask of the patch slots that hold a masked patch."""
    split = lambda x: common.split_crops(x.astype(jnp.float32), teacher_crops)  # noqa: E731
    return {
        "student": student["cls"],
        "teacher": jax.lax.stop_gradient(split(teacher["cls"])),
        "student_patch": student["patch"],
        "teacher_patch": jax.lax.stop_gradient(split(teacher["patch"])),
        "mask": valid.astype(jnp.float32),
    }


def apply_student(
    model, params, batch_stats, views: Views, masks, slots, rng, index, train: bool
) -> tuple[dict, Any]:
    """The student on every crop (the global ones masked) and its new ``batch_stats``: ``cls``
    (C, n, K) head outputs of every crop, ``patch`` (T, n, slots, K') at the masked places,
    ``cls_tokens`` (T, n, D) the global crops' normed class tokens, ``features`` (n, D) crop
    0's, without gradient."""
    n = index.shape[0]
    crops = views.globals_.shape[0] // n + sum(x.shape[0] for x in views.locals_) // n
    keys = None
    if train and common.uses_drop_path(model):
        keys = common.drop_path_keys(rng, index, crops)
    out, batch_stats = common.apply_variables(
        model,
        {"params": params, "batch_stats": batch_stats},
        train,
        views.globals_,
        views.locals_,
        masks,
        slots.reshape(-1, slots.shape[-1]),
        keys,
        train,
        method=_student,
    )
    t = slots.shape[0]
    cls_tokens = common.split_crops(out["cls_tokens"], t)
    return dict(
        cls=common.split_crops(out["cls"].astype(jnp.float32), crops),
        patch=common.split_crops(out["patch"].astype(jnp.float32), t),
        cls_tokens=cls_tokens,
        features=jax.lax.stop_gradient(cls_tokens[0]),
    ), batch_stats


def _student(module, globals_, locals_, mask, slots, keys, train):
    rows = globals_.shape[0]
    taps = module.trunk(
        globals_, train=train, mask=mask, row_keys=None if keys is None else keys[:rows]
    )
    tokens = [taps["avgpool"]]
    for images in locals_:
        row_keys = None if keys is None else keys[rows : rows + images.shape[0]]
        tokens.append(module.trunk(images, train=train, row_keys=row_keys)["avgpool"])
        rows += images.shape[0]
    cls = module.head(jnp.concatenate(tokens), train=train)
    patches = jnp.take_along_axis(taps["patch_tokens"], slots[..., None], axis=1)
    patch = module.head(patches, train=train, patches=True)
    return {"cls": cls, "patch": patch, "cls_tokens": taps["avgpool"]}


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


def collapse_metrics(metrics: dict, outputs: int) -> dict[str, jax.Array]:
    """The collapse monitor's (jssl.training.collapse), as DINO's: the [CLS] teacher's entropies
    over log K, 1 for uniform targets, the mean's 0 when one output dominates."""
    names = ("teacher_entropy", "teacher_mean_entropy")
    return {f"collapse/{name}": metrics[name] / math.log(outputs) for name in names}


def patch_metrics(embeddings: dict, targets: jax.Array) -> dict[str, jax.Array]:
    """``masked_patches`` (per global crop, this replica's mean) and ``patch_acc`` (VISSL's
    ``acc_ptc``: the student's arg-max at a masked patch is the teacher's target's)."""
    mask = embeddings["mask"] > 0
    agree = jnp.argmax(embeddings["student_patch"], -1) == jnp.argmax(targets, -1)
    return {
        "masked_patches": jnp.sum(mask) / (mask.shape[0] * mask.shape[1]),
        "patch_acc": jnp.sum(agree & mask) / jnp.maximum(jnp.sum(mask), 1),
    }
