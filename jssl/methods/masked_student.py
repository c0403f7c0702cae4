"""The masked student iBOT and DINOv2 share: the trunk with a mask token, its views (the
global crops the teacher sees, then the local ones), each global crop's patch mask keyed by
(step, example, crop), the student's pass over masked global and unmasked local crops, the
embeddings it hands the objective, the masked-patch metrics, the last layers' freeze and the
ViT the masks need. jssl.methods.ibot and jssl.methods.dinov2 import it; neither imports the
other.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections

from jssl import models
from jssl.methods import common, masking
from jssl.models.heads import DINOHead


def student_model(config: ml_collections.ConfigDict, head: Any) -> Any:
    """The trunk of ``models.build_model`` with a mask token, ``head`` on it."""
    model = models.build_model(config.model)
    return model.clone(trunk=model.trunk.clone(mask_token=True), head=head)


def init_variables(model: Any, rng: jax.Array, images: jax.Array) -> dict:
    """Every variable, those of the patch path included (``_init_both_paths``)."""
    return model.init(rng, images, method=_init_both_paths)


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


def patch_metrics(embeddings: dict, targets: jax.Array) -> dict[str, jax.Array]:
    """``masked_patches`` (per global crop, this replica's mean) and ``patch_acc`` (VISSL's
    ``acc_ptc``: the student's arg-max at a masked patch is the teacher's target's)."""
    mask = embeddings["mask"] > 0
    agree = jnp.argmax(embeddings["student_patch"], -1) == jnp.argmax(targets, -1)
    return {
        "masked_patches": jnp.sum(mask) / (mask.shape[0] * mask.shape[1]),
        "patch_acc": jnp.sum(agree & mask) / jnp.maximum(jnp.sum(mask), 1),
    }


def check_vit(config: ml_collections.ConfigDict) -> None:
    """A masked-image method needs a ViT (a mask token, patch tokens)."""
    name = config.method.name
    if not models.is_vit(config.model):
        raise ValueError(
            f"model.trunk={config.model.trunk!r}: method {name!r} replaces masked patches by a "
            "mask token and distils patch tokens, so it needs a ViT trunk, e.g. "
            "--config.model.trunk=vit_small."
        )
