"""Random erasing in JAX, inside the train step: the twin of jssl.data.erasing.

With data.augment.on_device (and with the numpy pipeline) jssl.data.device_augment erases a box
of each normalised view here: the same box draws (timm/data/random_erasing.py's RandomErasing,
mode "pixel", one box; Zhong et al. 2020) and the same N(0, 1) fill as the tf.data op, from a
JAX key made of the view's colour sub-seed folded with crops.ERASING_STREAM, so the two paths
agree in distribution, not view for view. tests/data/test_randaugment.py checks erasing_box and
erase equal to their tf.data twins given the same draws.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jssl.data import crops


class Erasing(NamedTuple):
    """One image's random erasing draws (erasing.Erasing)."""

    box: jax.Array  # (4,) int32: top, left, height, width; zero size where nothing is erased
    noise: jax.Array  # (H, W, 3) float32: N(0, 1)


def erasing_box(height: int, width: int, draws: jax.Array) -> jax.Array:
    """erasing.erasing_box: (..., 4) int32 box from (..., 4, ERASING_ATTEMPTS) uniforms."""
    area_u, aspect_u, top_u, left_u = (draws[..., i, :] for i in range(4))
    low, high = crops.ERASING_AREA
    target = (low + (high - low) * area_u) * float(height * width)
    log_low, log_high = (math.log(r) for r in crops.ERASING_ASPECT)
    aspect = jnp.exp(log_low + (log_high - log_low) * aspect_u)
    h = jnp.round(jnp.sqrt(target * aspect)).astype(jnp.int32)
    w = jnp.round(jnp.sqrt(target / aspect)).astype(jnp.int32)
    fits = (h < height) & (w < width)
    first = jax.nn.one_hot(jnp.argmax(fits, axis=-1), crops.ERASING_ATTEMPTS, dtype=jnp.int32)
    pick = (first > 0) & fits

    def picked(values):
        return jnp.sum(jnp.where(pick, values, 0), axis=-1)

    h, w = picked(h), picked(w)
    top = jnp.floor(picked(top_u) * (height - h + 1).astype(jnp.float32)).astype(jnp.int32)
    left = jnp.floor(picked(left_u) * (width - w + 1).astype(jnp.float32)).astype(jnp.int32)
    found = jnp.any(fits, axis=-1).astype(jnp.int32)
    return jnp.stack([top, left, h, w], axis=-1) * found[..., None]


def sample_erasing(key: jax.Array, height: int, width: int, prob: float) -> Erasing:
    coin_key, box_key, noise_key = jax.random.split(key, 3)
    draws = jax.random.uniform(box_key, (4, crops.ERASING_ATTEMPTS))
    erased = (jax.random.uniform(coin_key) < prob).astype(jnp.int32)
    noise = jax.random.normal(noise_key, (height, width, 3))
    return Erasing(erasing_box(height, width, draws) * erased, noise)


def erase(image: jax.Array, erasing: Erasing) -> jax.Array:
    top, left, h, w = erasing.box[0], erasing.box[1], erasing.box[2], erasing.box[3]
    rows = jnp.arange(image.shape[0])[:, None, None]
    cols = jnp.arange(image.shape[1])[None, :, None]
    inside = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)
    return jnp.where(inside, erasing.noise, image)
