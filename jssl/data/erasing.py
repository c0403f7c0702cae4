"""Random erasing in tf.data: the last augmentation of the ViT fine-tuning recipes' views.

MAE, BEiT and DeiT fine-tune with timm's ``--reprob 0.25 --remode pixel --recount 1``: after
normalisation, one box of the view (Zhong et al. 2020), drawn as timm/data/random_erasing.py's
RandomErasing draws it (area fraction, log-uniform aspect ratio, up to crops.ERASING_ATTEMPTS
tries), is replaced by per-pixel N(0, 1) noise. jssl.data.erasing_device is the JAX twin (with
data.augment.on_device and the numpy pipeline); tests/data/test_randaugment.py checks them
equal given the same draws. The draws are stateless, keyed by the view's seed folded with
crops.ERASING_STREAM (jssl.data.transforms.ssl_view).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import tensorflow as tf

from jssl.data import crops


class Erasing(NamedTuple):
    """One image's random erasing draws."""

    box: tf.Tensor  # (4,) int32: top, left, height, width; zero size where nothing is erased
    noise: tf.Tensor  # (H, W, 3) float32: N(0, 1), the erased pixels' values


def erasing_box(height: int, width: int, draws: tf.Tensor) -> tf.Tensor:
    """(..., 4) int32 (top, left, height, width) of timm RandomErasing's box from (..., 4,
    ERASING_ATTEMPTS) uniform draws (area, log-aspect, top, left per attempt): the first attempt
    that fits (strictly smaller than the image on both sides), or an empty box."""
    area_u, aspect_u, top_u, left_u = tf.unstack(draws, axis=-2)
    low, high = crops.ERASING_AREA
    target = (low + (high - low) * area_u) * float(height * width)
    log_low, log_high = (math.log(r) for r in crops.ERASING_ASPECT)
    aspect = tf.exp(log_low + (log_high - log_low) * aspect_u)
    h = tf.cast(tf.round(tf.sqrt(target * aspect)), tf.int32)
    w = tf.cast(tf.round(tf.sqrt(target / aspect)), tf.int32)
    fits = (h < height) & (w < width)
    first = tf.one_hot(tf.argmax(tf.cast(fits, tf.int32), axis=-1), crops.ERASING_ATTEMPTS)
    pick = (first > 0) & fits

    def picked(values):
        return tf.reduce_sum(tf.where(pick, values, 0), axis=-1)

    h, w = picked(h), picked(w)
    # random.randint(0, side - h): uniform over the side - h + 1 positions.
    top = tf.cast(tf.floor(picked(top_u) * tf.cast(height - h + 1, tf.float32)), tf.int32)
    left = tf.cast(tf.floor(picked(left_u) * tf.cast(width - w + 1, tf.float32)), tf.int32)
    found = tf.cast(tf.reduce_any(fits, axis=-1), tf.int32)
    return tf.stack([top, left, h, w], axis=-1) * found[..., None]


def sample_erasing(seed: tf.Tensor, height: int, width: int, prob: float) -> Erasing:
    coin_seed, box_seed, noise_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 3))
    draws = tf.random.stateless_uniform([4, crops.ERASING_ATTEMPTS], box_seed)
    erased = tf.cast(tf.random.stateless_uniform([], coin_seed) < prob, tf.int32)
    noise = tf.random.stateless_normal([height, width, 3], noise_seed)
    return Erasing(erasing_box(height, width, draws) * erased, noise)


def erase(image: tf.Tensor, erasing: Erasing) -> tf.Tensor:
    """The box's pixels replaced by the noise (timm mode "pixel")."""
    top, left, h, w = tf.unstack(erasing.box)
    rows = tf.range(tf.shape(image)[0])[:, None, None]
    cols = tf.range(tf.shape(image)[1])[None, :, None]
    inside = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)
    return tf.where(inside, erasing.noise, image)


def random_erasing(image: tf.Tensor, seed: tf.Tensor, prob: float) -> tf.Tensor:
    """timm RandomErasing(prob, mode="pixel", max_count=1) of a normalised (H, W, 3) view."""
    return erase(image, sample_erasing(seed, image.shape[0], image.shape[1], prob))
