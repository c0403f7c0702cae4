"""Crop groups: which augmented crops the training pipeline makes of each image.

A crop group is a number of crops that share a size, a scale range and augmentation
probabilities: SimCLR and MoCo take one group of two 224 px crops; SwAV two groups, 2x224 px
(scale 0.14-1) and 6x96 px (scale 0.05-0.14) (Caron et al. 2020, Sec. 3.2; VISSL
``ImgPilToMultiCrop`` with ``num_crops: [2, 6]``, ``size_crops: [224, 96]``,
``crop_scales: [[0.14, 1], [0.05, 0.14]]``); BYOL and DINO need groups of equal size that
differ in blur and solarisation (one crop per group).

Config (``data.augment``), each per-group field given once for every group or once per group:

  num_crops         crops per group, e.g. (2,) or (2, 6); its length is the number of groups
  crop_sizes        side of each group's crops; () = ``data.image_size`` for every group
  crop_scale        (min, max) area fraction, or one such pair per group
  flip_prob, color_jitter_prob, grayscale_prob, blur_prob, solarize_prob
                    tuples: one value for every group, or one per group (a command-line
                    scalar, ``--config.data.augment.blur_prob=0.2``, is a 1-tuple)

The batch carries one array per group, ``batch["crops"][g]`` of shape (N, num_crops[g],
S_g, S_g, 3); crop j of example i is a function of (seed, epoch, dataset index, crop number),
crop numbers running over the groups in order (group 0's crops first), so the views of an
example stay aligned across groups and are the same on any number of processes.

With ``data.augment.on_device`` the host makes only each crop's box, resize and flip
(``host_crops``, uint8) and the train step the rest (jssl.data.device_augment), from the same
per-crop seeds.

This module imports TensorFlow only inside the functions that build tf.data ops (make_crops,
host_crops): the crop groups are also read by the train step, the methods and the numpy
pipeline (jssl.data.numpy_pipeline), which run without TensorFlow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import tensorflow as tf

PROB_FIELDS = ("flip_prob", "color_jitter_prob", "grayscale_prob", "blur_prob", "solarize_prob")


class CropGroup(NamedTuple):
    num_crops: int
    size: int
    scale: tuple[float, float]
    flip_prob: float
    color_jitter_prob: float
    grayscale_prob: float
    blur_prob: float
    solarize_prob: float


def _per_group(value, num_groups: int, field: str, example: str) -> list:
    """``value`` (one for all groups, or one per group) as a list of ``num_groups`` values."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(values) == 1:
        return values * num_groups
    if len(values) != num_groups:
        raise ValueError(
            f"data.augment.{field}={tuple(values)} has {len(values)} values for "
            f"{num_groups} crop group(s) (data.augment.num_crops): give one value for every "
            f"group or one per group, e.g. --config.data.augment.{field}='{example}'."
        )
    return values


def _scales(scale, num_groups: int) -> list[tuple[float, float]]:
    """crop_scale as a (min, max) pair per group: one pair for all, or one pair per group."""
    scale = tuple(scale)
    if len(scale) == 2 and all(isinstance(s, (int, float)) for s in scale):
        pairs = [scale] * num_groups
    else:
        pairs = _per_group(scale, num_groups, "crop_scale", "((0.14, 1.0), (0.05, 0.14))")
    out = []
    for pair in pairs:
        pair = tuple(pair) if isinstance(pair, (list, tuple)) else (pair,)
        if len(pair) != 2 or not 0 < pair[0] <= pair[1] <= 1:
            raise ValueError(
                f"data.augment.crop_scale={scale}: each group's scale must be a pair "
                "(min, max) of area fractions with 0 < min <= max <= 1, e.g. (0.08, 1.0) "
                "for every group or ((0.14, 1.0), (0.05, 0.14)) for two groups."
            )
        out.append((float(pair[0]), float(pair[1])))
    return out


def crop_groups(data_config) -> list[CropGroup]:
    """The crop groups of ``data_config.augment``, validated (errors name the field)."""
    augment = data_config.augment
    num_crops = tuple(augment.num_crops)
    if not num_crops or any(int(k) < 1 for k in num_crops):
        raise ValueError(
            f"data.augment.num_crops={num_crops} must list at least one group, each with >= 1 "
            "crop: (2,) for two views, (2, 6) for SwAV's multi-crop."
        )
    groups = len(num_crops)
    sizes = tuple(augment.crop_sizes) or (data_config.image_size,) * groups
    sizes = _per_group(sizes, groups, "crop_sizes", "(224, 96)")
    if any(int(s) < 1 for s in sizes):
        raise ValueError(f"data.augment.crop_sizes={tuple(sizes)} must be positive pixel sides.")
    scales = _scales(augment.crop_scale, groups)
    probs = {}
    for field in PROB_FIELDS:
        values = _per_group(getattr(augment, field), groups, field, "(1.0, 0.1)")
        if any(not 0.0 <= float(p) <= 1.0 for p in values):
            raise ValueError(
                f"data.augment.{field}={getattr(augment, field)}: probabilities lie in [0, 1]."
            )
        probs[field] = [float(p) for p in values]
    return [
        CropGroup(
            int(num_crops[g]),
            int(sizes[g]),
            scales[g],
            **{field: probs[field][g] for field in PROB_FIELDS},
        )
        for g in range(groups)
    ]


def total_crops(data_config) -> int:
    return sum(g.num_crops for g in crop_groups(data_config))


def photometric(group: CropGroup) -> bool:
    """Whether ``group``'s views need more than crop and flip (colour, grey, blur, solarise)."""
    probs = (group.color_jitter_prob, group.grayscale_prob, group.blur_prob, group.solarize_prob)
    return any(p > 0 for p in probs)


def blur_radius(side: int) -> int:
    """Half the Gaussian kernel's extent: ~10% of the image side as in SimCLR (appendix A).
    Shared by the tf.data blur (transforms.blur) and its on-device twin (device_augment.blur)."""
    return max(1, int(math.ceil(0.1 * side)) // 2)


def make_crops(
    image: tf.Tensor, seed: tf.Tensor, groups: Sequence[CropGroup], augment
) -> tuple[tf.Tensor, ...]:
    """One example's crops: a (num_crops, S, S, 3) tensor per group.

    ``seed`` is the example's seed; crop c (counted over all groups) gets the c-th of a
    stateless split, so with one group of two crops the views are those of a two-view pipeline.
    """
    import tensorflow as tf

    from jssl.data import transforms

    seeds = tf.random.experimental.stateless_split(seed, sum(g.num_crops for g in groups))
    out, c = [], 0
    for group in groups:
        views = []
        for _ in range(group.num_crops):
            views.append(transforms.ssl_view(image, seeds[c], group, augment))
            c += 1
        out.append(tf.stack(views))
    return tuple(out)


def host_crops(
    image: tf.Tensor, seed: tf.Tensor, groups: Sequence[CropGroup], augment
) -> tuple[tuple[tf.Tensor, ...], tuple[tf.Tensor, ...]]:
    """The host's half of make_crops with data.augment.on_device: crop and flip only.

    ``image`` is the decoded image, uint8 or float in [0, 1]. Returns (crops, seeds), per
    group a (num_crops, S, S, 3) uint8 tensor and a (num_crops, 3, 2) uint32 tensor: each
    crop's colour, blur and solarize sub-seeds (transforms.view_seeds, the host path's; the
    low 32 bits of each int64 half), which jssl.data.device_augment turns into the JAX keys
    of the rest of the view. The crop box, resize and flip are make_crops's; the crop is then
    rounded to uint8.
    """
    import tensorflow as tf

    from jssl.data import transforms

    seeds = tf.random.experimental.stateless_split(seed, sum(g.num_crops for g in groups))
    out_crops, out_seeds, c = [], [], 0
    shape = tf.shape(image)
    scale = 255.0 if image.dtype.is_floating else 1.0
    for group in groups:
        views, view_seeds = [], []
        for _ in range(group.num_crops):
            crop_s, flip_s, color_s, blur_s, solar_s = transforms.view_seeds(seeds[c])
            begin, size = transforms.crop_window(shape, crop_s, group.scale, augment.crop_ratio)
            crop = tf.slice(image, begin, size)
            # Resize gives float32 in the input's range: [0, 255] from uint8 (cached splits),
            # [0, 1] from the float decoders.
            crop = tf.image.resize(crop, (group.size, group.size), "bilinear", antialias=True)
            # Round half up; the flip (exact) then moves a quarter of the bytes.
            crop = tf.saturate_cast(crop * scale + 0.5, tf.uint8)
            views.append(transforms.random_flip(crop, flip_s, group.flip_prob))
            low_bits = tf.bitwise.bitwise_and(tf.stack([color_s, blur_s, solar_s]), 0xFFFFFFFF)
            view_seeds.append(tf.cast(low_bits, tf.uint32))
            c += 1
        out_crops.append(tf.stack(views))
        out_seeds.append(tf.stack(view_seeds))
    return tuple(out_crops), tuple(out_seeds)


def synthetic_batch(data_config, batch_size: int, seed: int = 0) -> dict:
    """A host batch of noise shaped as the training pipeline's (every crop group), for
    benchmarks and tests of the step that need no data: Gaussian float32 views, or where the
    step makes the views (jssl.data.loader.views_on_device) uniform uint8 crops and their
    ``aug_seeds``."""
    from jssl.data import loader

    rs = np.random.RandomState(seed)
    groups = crop_groups(data_config)
    shapes = [(batch_size, g.num_crops, g.size, g.size, 3) for g in groups]
    batch = {
        "crops": tuple(rs.normal(size=shape).astype(np.float32) for shape in shapes),
        "label": np.zeros(batch_size, np.int32),
        "index": np.arange(batch_size),
    }
    if loader.views_on_device(data_config):
        batch["crops"] = tuple(rs.randint(0, 256, shape, dtype=np.uint8) for shape in shapes)
        batch["aug_seeds"] = tuple(
            rs.randint(0, 2**32, (batch_size, g.num_crops, 3, 2), dtype=np.uint32) for g in groups
        )
    return batch
