"""Crop groups: which augmented crops the training pipeline makes of each image.

A crop group is a number of crops that share a size, a scale range and augmentation
probabilities: SimCLR and MoCo take one group of two 224 px crops; SwAV 2x224 px (scale 0.14-1)
and 6x96 px (scale 0.05-0.14) (Caron et al. 2020, Sec. 3.2; VISSL ``ImgPilToMultiCrop``); BYOL
and DINO groups of equal size that differ in blur and solarisation. The ``data.augment`` fields
are read in ``crop_groups``. ``batch["crops"][g]`` is (N, num_crops[g], S_g, S_g, 3); crop j of
an example is a function of (seed, epoch, dataset index, crop number), numbered over the groups
in order, so an example's views stay aligned across groups and are the same on any number of
processes. This module imports no TensorFlow and no other jssl.data module: the train step, the
methods and the numpy pipeline read the groups too, and the tf.data ops (jssl.data.transforms)
and their on-device twins read one set of numbers here (blur_radius, RandAugment's op list,
random erasing's ranges). More: docs/operations.md, "Data".
"""

from __future__ import annotations

import math
from typing import NamedTuple

PROB_FIELDS = ("flip_prob", "color_jitter_prob", "grayscale_prob", "blur_prob", "solarize_prob")

# RandAugment (Cubuk et al. 2020) as timm's rand_augment_transform builds "rand-m9-mstd0.5-inc1"
# (timm/data/auto_augment.py, _RAND_INCREASING_TRANSFORMS, in its order): each layer picks one
# op uniformly (with replacement), applies it with probability 0.5, at a magnitude drawn from
# N(m, std) clipped to [0, 10].
RANDAUGMENT_OPS = (
    "auto_contrast",
    "equalize",
    "invert",
    "rotate",
    "posterize",  # PosterizeIncreasing
    "solarize",  # SolarizeIncreasing
    "solarize_add",
    "color",  # ColorIncreasing, and so on for the three enhancements below
    "contrast",
    "brightness",
    "sharpness",
    "shear_x",
    "shear_y",
    "translate_x",  # TranslateXRel
    "translate_y",  # TranslateYRel
)
RANDAUGMENT_OP_PROB = 0.5  # timm rand_augment_transform's default p
RANDAUGMENT_MAX_MAGNITUDE = 10.0  # timm _LEVEL_DENOM: magnitudes are clipped to [0, 10]
# Random erasing (Zhong et al. 2020; timm/data/random_erasing.py, mode "pixel", one box): the
# box's area fraction, its aspect ratio (log-uniform) and the boxes tried before giving up.
ERASING_AREA = (0.02, 1 / 3)
ERASING_ASPECT = (0.3, 1 / 0.3)
ERASING_ATTEMPTS = 10
# Their draws come from the view's colour sub-seed folded with these (transforms.view_seeds'
# split is untouched, so switching them on leaves every other draw of the view as it was).
RANDAUGMENT_STREAM = 0x52414E44
ERASING_STREAM = 0x45524153


class CropGroup(NamedTuple):
    num_crops: int
    size: int
    scale: tuple[float, float]
    flip_prob: float
    color_jitter_prob: float
    grayscale_prob: float
    blur_prob: float
    solarize_prob: float
    # The fine-tuning augmentations, the same for every group (data.augment scalars).
    randaugment_ops: int = 0
    randaugment_magnitude: float = 9.0
    randaugment_magnitude_std: float = 0.5
    random_erasing_prob: float = 0.0


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


def _finetune_fields(augment) -> dict:
    """data.augment's RandAugment and random erasing fields, validated (errors name the field;
    a config without them has them off)."""
    ops = augment.get("randaugment_ops", 0)
    if isinstance(ops, bool) or not isinstance(ops, int) or ops < 0:
        raise ValueError(
            f"data.augment.randaugment_ops={ops!r} must be an integer >= 0: the RandAugment ops "
            "applied per image, 0 for none, 2 in the ViT fine-tuning recipes."
        )
    magnitude = float(augment.get("randaugment_magnitude", 9.0))
    if not 0.0 <= magnitude <= RANDAUGMENT_MAX_MAGNITUDE:
        raise ValueError(
            f"data.augment.randaugment_magnitude={magnitude} must lie in [0, 10] (timm's scale, "
            "where 10 is the strongest; the ViT fine-tuning recipes use 9)."
        )
    std = float(augment.get("randaugment_magnitude_std", 0.5))
    if not 0.0 <= std < math.inf:
        raise ValueError(
            f"data.augment.randaugment_magnitude_std={std} must be finite and >= 0: the std of "
            "the per-op Gaussian noise on the magnitude, 0 for none, 0.5 in the recipes."
        )
    erasing = float(augment.get("random_erasing_prob", 0.0))
    if not 0.0 <= erasing <= 1.0:
        raise ValueError(
            f"data.augment.random_erasing_prob={erasing} is a probability in [0, 1] "
            "(0 for no random erasing, 0.25 in the ViT fine-tuning recipes)."
        )
    return dict(
        randaugment_ops=ops,
        randaugment_magnitude=magnitude,
        randaugment_magnitude_std=std,
        random_erasing_prob=erasing,
    )


def crop_groups(data_config) -> list[CropGroup]:
    """The crop groups of ``data_config.augment``, validated (errors name the field).

    ``num_crops`` lists the crops per group (its length is the number of groups);
    ``crop_sizes`` one side per group (``()``: ``data.image_size`` for every group);
    ``crop_scale`` a (min, max) area fraction; ``crop_sizes``, ``crop_scale`` and the
    probabilities of ``PROB_FIELDS`` take one value for every group or one per group (a
    command-line scalar, ``--config.data.augment.blur_prob=0.2``, is a 1-tuple). The
    RandAugment and random-erasing scalars apply to every group, off by default."""
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
    finetune = _finetune_fields(augment)
    return [
        CropGroup(
            int(num_crops[g]),
            int(sizes[g]),
            scales[g],
            **{field: probs[field][g] for field in PROB_FIELDS},
            **finetune,
        )
        for g in range(groups)
    ]


def total_crops(data_config) -> int:
    return sum(g.num_crops for g in crop_groups(data_config))


def photometric(group: CropGroup) -> bool:
    """Whether ``group``'s views need more than crop and flip (colour, grey, blur, solarise,
    RandAugment, random erasing)."""
    probs = (group.color_jitter_prob, group.grayscale_prob, group.blur_prob, group.solarize_prob)
    return any(p > 0 for p in probs) or group.randaugment_ops > 0 or group.random_erasing_prob > 0


def fill_color(mean) -> tuple[float, float, float]:
    """RandAugment's fill for the pixels a rotation, shear or translation uncovers: the dataset
    mean rounded to a grey level, as timm's ``img_mean`` hparam (transforms_factory.py)."""
    return tuple(min(255, round(255 * float(m))) / 255 for m in mean)


def blur_radius(side: int) -> int:
    """Half the Gaussian kernel's extent: ~10% of the image side as in SimCLR (appendix A).
    Shared by the tf.data blur (transforms.blur) and its on-device twin (device_augment.blur)."""
    return max(1, int(math.ceil(0.1 * side)) // 2)
