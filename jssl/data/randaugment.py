"""RandAugment and random erasing in tf.data: the data half of the ViT fine-tuning protocol.

MAE, BEiT and DeiT fine-tune with timm's ``--aa rand-m9-mstd0.5-inc1 --reprob 0.25 --remode
pixel --recount 1``: RandAugment (Cubuk et al. 2020) after the crop and flip, two layers per
image, each one of the 15 ops of jssl.data.crops.RANDAUGMENT_OPS with probability 0.5 at a
magnitude from N(9, 0.5) clipped to [0, 10]; then, after normalisation, random erasing (Zhong
et al. 2020) of one box with per-pixel N(0, 1) noise. This module draws the layers (stateless,
keyed by the view's seed, jssl.data.transforms.ssl_view); the ops are in
jssl.data.randaugment_ops, random erasing in jssl.data.erasing (both re-exported), the levels
timm/data/auto_augment.py's (``_RAND_INCREASING_TRANSFORMS``, ``*_level_to_arg``). The JAX twin
is jssl.data.randaugment_device. Deliberately unlike timm (PIL on uint8): the image stays float
between ops, and the colour ops keep their probabilities where timm drops its colour jitter (a
fine-tuning preset sets them to 0); the ops' own differences: jssl.data.randaugment_ops.
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from jssl.data import crops
from jssl.data.erasing import (  # noqa: F401  (re-exported: transforms and tests read them here)
    Erasing,
    erase,
    erasing_box,
    random_erasing,
    sample_erasing,
)
from jssl.data.randaugment_ops import OPS

NUM_OPS = len(crops.RANDAUGMENT_OPS)


class Layers(NamedTuple):
    """One image's RandAugment draws, one entry per layer."""

    op: tf.Tensor  # int32: index in crops.RANDAUGMENT_OPS
    apply: tf.Tensor  # bool: the layer's coin came up (probability 0.5)
    magnitude: tf.Tensor  # float32 in [0, 10]
    negate: tf.Tensor  # bool: the signed ops (rotate, shear, translate, enhance) go negative


def stream_seed(seed: tf.Tensor, stream: int) -> tf.Tensor:
    """A sub-seed of ``seed`` for one of crops' streams (RANDAUGMENT_STREAM, ERASING_STREAM)."""
    return tf.random.experimental.stateless_fold_in(seed, stream)


def op_arguments(magnitude: tf.Tensor, negate: tf.Tensor) -> tf.Tensor:
    """(..., NUM_OPS) float32: every op's argument at ``magnitude``, timm's level_to_arg (the
    "increasing" variants): degrees, posterize bits, solarize threshold and addition in grey
    levels, enhancement factor, shear factor, translation as a fraction of the side."""
    level = tf.cast(magnitude, tf.float32) / 10.0
    sign = tf.where(negate, -1.0, 1.0)
    enhance = tf.maximum(0.1, 1.0 + sign * level * 0.9)
    zero = tf.zeros_like(level)
    return tf.stack(
        [
            zero,  # auto_contrast
            zero,  # equalize
            zero,  # invert
            sign * level * 30.0,  # rotate: [-30, 30] degrees
            4.0 - tf.floor(level * 4.0),  # posterize: keep 4 down to 0 bits
            256.0 - tf.minimum(256.0, tf.floor(level * 256.0)),  # solarize: threshold 256 to 0
            tf.minimum(128.0, tf.floor(level * 110.0)),  # solarize_add: add 0 to 110
            enhance,  # color: [0.1, 1.9]
            enhance,  # contrast
            enhance,  # brightness
            enhance,  # sharpness
            sign * level * 0.3,  # shear_x
            sign * level * 0.3,  # shear_y
            sign * level * 0.45,  # translate_x: fraction of the width
            sign * level * 0.45,  # translate_y: of the height
        ],
        axis=-1,
    )


def sample_layers(seed: tf.Tensor, num_ops: int, magnitude: float, magnitude_std: float) -> Layers:
    """``num_ops`` layers' draws: op uniform over the 15 (with replacement, as timm's
    np.random.choice), coin, magnitude N(magnitude, magnitude_std) clipped to [0, 10], sign."""
    op_seed, coin_seed, magnitude_seed, sign_seed = tf.unstack(
        tf.random.experimental.stateless_split(seed, 4)
    )
    shape = [num_ops]
    op = tf.random.stateless_uniform(shape, op_seed, minval=0, maxval=NUM_OPS, dtype=tf.int32)
    apply = tf.random.stateless_uniform(shape, coin_seed) < crops.RANDAUGMENT_OP_PROB
    noise = tf.random.stateless_normal(shape, magnitude_seed)
    drawn = tf.clip_by_value(
        magnitude + magnitude_std * noise, 0.0, crops.RANDAUGMENT_MAX_MAGNITUDE
    )
    negate = tf.random.stateless_uniform(shape, sign_seed) > 0.5  # timm _randomly_negate
    return Layers(op, apply, drawn, negate)


def apply_layers(image: tf.Tensor, layers: Layers, fill: tf.Tensor) -> tf.Tensor:
    """The drawn layers applied in turn (a layer whose coin failed leaves the image)."""
    args = op_arguments(layers.magnitude, layers.negate)

    def layer(i, image):
        def chosen():
            # Bind the op and image as defaults: each branch must see this layer's input.
            branches = [
                lambda op=op, k=k, x=image: op(x, args[i, k], fill) for k, op in enumerate(OPS)
            ]
            return tf.switch_case(layers.op[i], branches)

        return i + 1, tf.cond(layers.apply[i], chosen, lambda: image)

    # A loop: the 15 branches are traced once, not once per layer.
    num_layers = tf.shape(layers.op)[0]
    _, image = tf.while_loop(lambda i, _: i < num_layers, layer, (tf.constant(0), image))
    return image


def rand_augment(image: tf.Tensor, seed: tf.Tensor, group, fill) -> tf.Tensor:
    """RandAugment with ``group``'s (a jssl.data.crops.CropGroup) ops, magnitude and std."""
    layers = sample_layers(
        seed, group.randaugment_ops, group.randaugment_magnitude, group.randaugment_magnitude_std
    )
    return apply_layers(image, layers, tf.constant(fill, tf.float32))
