"""RandAugment's 15 image ops in JAX: the twins of jssl.data.randaugment_ops, for the train step.

Each op here is the twin of the tf.data op of the same name given the same argument
(tests/data/test_randaugment.py checks them equal): the same PIL ImageOps lookup tables, PIL
ImageEnhance blends and PIL Image.transform affine maps of timm/data/auto_augment.py, with the
same deliberate differences from PIL (jssl.data.randaugment_ops). jssl.data.randaugment_device
draws the layers and applies them, sharing the lookup tables, blends and affine matrices below
across the ops of a layer.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LUMA = (0.299, 0.587, 0.114)  # PIL convert("L"), as randaugment_ops.LUMA
SMOOTH = ((1.0, 1.0, 1.0), (1.0, 5.0, 1.0), (1.0, 1.0, 1.0))  # PIL ImageFilter.SMOOTH / 13
SMOOTH_SCALE = 13.0


# Lookup tables: (3, 256) int32, one per channel, on grey levels.
# No array is made at import: that would start a JAX backend before jax.distributed's set-up.
CHANNEL_OFFSETS = (0, 256, 512)


def ramp() -> jax.Array:
    return jnp.arange(256, dtype=jnp.int32)


def levels(image: jax.Array) -> jax.Array:
    return jnp.floor(image * 255.0 + 0.5).astype(jnp.int32)


def histogram(image: jax.Array) -> jax.Array:
    flat = (levels(image) + jnp.asarray(CHANNEL_OFFSETS, jnp.int32)).reshape(-1)
    return jnp.zeros(768, jnp.int32).at[flat].add(1).reshape(3, 256)


def apply_lut(image: jax.Array, lut: jax.Array) -> jax.Array:
    mapped = jnp.take(lut.reshape(-1), levels(image) + jnp.asarray(CHANNEL_OFFSETS, jnp.int32))
    return mapped.astype(jnp.float32) / 255.0


def per_channel(lut: jax.Array) -> jax.Array:
    return jnp.broadcast_to(lut, (3, 256))


def _first_last(hist: jax.Array) -> tuple[jax.Array, jax.Array]:
    present = hist > 0
    first = jnp.argmax(present, axis=-1).astype(jnp.int32)
    last = 255 - jnp.argmax(present[:, ::-1], axis=-1).astype(jnp.int32)
    return first[:, None], last[:, None]


def auto_contrast_lut(hist: jax.Array) -> jax.Array:
    low, high = _first_last(hist)
    stretched = jnp.clip((ramp() - low) * 255 // jnp.maximum(high - low, 1), 0, 255)
    return jnp.where(high > low, stretched, ramp())


def equalize_lut(hist: jax.Array) -> jax.Array:
    _, last = _first_last(hist)
    total = jnp.sum(hist, axis=-1, keepdims=True)
    step = (total - jnp.take_along_axis(hist, last, axis=-1)) // 255
    below = jnp.cumsum(hist, axis=-1) - hist
    lut = jnp.minimum((step // 2 + below) // jnp.maximum(step, 1), 255)
    return jnp.where(step > 0, lut, ramp())


def invert_lut() -> jax.Array:
    return per_channel(255 - ramp())


def posterize_lut(bits: jax.Array) -> jax.Array:
    shift = 8 - jnp.asarray(bits).astype(jnp.int32)
    return per_channel(jnp.left_shift(jnp.right_shift(ramp(), shift), shift))


def solarize_lut(threshold: jax.Array) -> jax.Array:
    threshold = jnp.asarray(threshold).astype(jnp.int32)
    return per_channel(jnp.where(ramp() < threshold, ramp(), 255 - ramp()))


def solarize_add_lut(addition: jax.Array) -> jax.Array:
    added = jnp.minimum(255, ramp() + jnp.asarray(addition).astype(jnp.int32))
    return per_channel(jnp.where(ramp() < 128, added, ramp()))


def blend(degenerate, image: jax.Array, factor: jax.Array) -> jax.Array:
    return jnp.clip(degenerate + factor * (image - degenerate), 0.0, 1.0)


def luma(image: jax.Array) -> jax.Array:
    return jnp.tensordot(image, jnp.asarray(LUMA, image.dtype), axes=[[-1], [0]])[..., None]


def smooth(image: jax.Array) -> jax.Array:
    """PIL's SMOOTH filter (randaugment_ops.smooth): 3x3 on the interior, the border kept."""
    height, width = image.shape[:2]
    inner = sum(
        SMOOTH[i][j] / SMOOTH_SCALE * image[i : i + height - 2, j : j + width - 2]
        for i in range(3)
        for j in range(3)
    )
    return image.at[1:-1, 1:-1].set(inner)


# Affine maps as PIL's (a, b, c, d, e, f) (randaugment_ops.rotate_matrix ...), as (6,) arrays.
def rotate_matrix(degrees: jax.Array, height: int, width: int) -> jax.Array:
    angle = -jnp.asarray(degrees, jnp.float32) * (math.pi / 180.0)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    cx, cy = width / 2.0, height / 2.0
    return jnp.stack([cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy])


def affine_matrix(*values) -> jax.Array:
    """PIL's (a, b, c, d, e, f) as a (6,) float32 array."""
    return jnp.stack([jnp.asarray(v, jnp.float32) for v in values])


def shear_x_matrix(factor: jax.Array) -> jax.Array:
    return affine_matrix(1.0, factor, 0.0, 0.0, 1.0, 0.0)


def shear_y_matrix(factor: jax.Array) -> jax.Array:
    return affine_matrix(1.0, 0.0, 0.0, factor, 1.0, 0.0)


def translate_x_matrix(fraction: jax.Array, width: int) -> jax.Array:
    return affine_matrix(1.0, 0.0, fraction * width, 0.0, 1.0, 0.0)


def translate_y_matrix(fraction: jax.Array, height: int) -> jax.Array:
    return affine_matrix(1.0, 0.0, 0.0, 0.0, 1.0, fraction * height)


def affine(image: jax.Array, matrix: jax.Array, fill: jax.Array) -> jax.Array:
    """randaugment_ops.affine: bilinear with the sampling point clamped to the image (TF's
    ImageProjectiveTransformV3 with fill_mode NEAREST), the fill outside it (PIL)."""
    height, width = image.shape[:2]
    a, b, c, d, e, f = matrix[0], matrix[1], matrix[2], matrix[3], matrix[4], matrix[5]
    c, f = c + 0.5 * (a + b - 1.0), f + 0.5 * (d + e - 1.0)  # randaugment_ops.index_transform
    y = jnp.arange(height, dtype=jnp.float32)[:, None]
    x = jnp.arange(width, dtype=jnp.float32)[None, :]
    source_x, source_y = a * x + b * y + c, d * x + e * y + f
    inside = (source_x >= -0.5) & (source_x < width - 0.5)
    inside &= (source_y >= -0.5) & (source_y < height - 0.5)
    px = jnp.clip(source_x, 0.0, width - 1.0)
    py = jnp.clip(source_y, 0.0, height - 1.0)
    x0, y0 = jnp.floor(px), jnp.floor(py)
    # The ceiling taps past the last pixel have weight 0 (px = width - 1 exactly).
    x0i, y0i = x0.astype(jnp.int32), y0.astype(jnp.int32)
    x1i, y1i = jnp.minimum(x0i + 1, width - 1), jnp.minimum(y0i + 1, height - 1)
    wx, wy = (px - x0)[..., None], (py - y0)[..., None]
    top = (1.0 - wx) * image[y0i, x0i] + wx * image[y0i, x1i]
    bottom = (1.0 - wx) * image[y1i, x0i] + wx * image[y1i, x1i]
    warped = (1.0 - wy) * top + wy * bottom
    return jnp.where(inside[..., None], warped, fill)


# The ops, in crops.RANDAUGMENT_OPS's order: op(image, argument, fill) -> image.
def auto_contrast(image, arg, fill):
    return apply_lut(image, auto_contrast_lut(histogram(image)))


def equalize(image, arg, fill):
    return apply_lut(image, equalize_lut(histogram(image)))


def invert(image, arg, fill):
    return apply_lut(image, invert_lut())


def rotate(image, degrees, fill):
    return affine(image, rotate_matrix(degrees, *image.shape[:2]), fill)


def posterize(image, bits, fill):
    return apply_lut(image, posterize_lut(bits))


def solarize(image, threshold, fill):
    return apply_lut(image, solarize_lut(threshold))


def solarize_add(image, addition, fill):
    return apply_lut(image, solarize_add_lut(addition))


def color(image, factor, fill):
    return blend(luma(image), image, factor)


def contrast(image, factor, fill):
    return blend(jnp.mean(luma(image)), image, factor)


def brightness(image, factor, fill):
    return blend(0.0, image, factor)


def sharpness(image, factor, fill):
    return blend(smooth(image), image, factor)


def shear_x(image, factor, fill):
    return affine(image, shear_x_matrix(factor), fill)


def shear_y(image, factor, fill):
    return affine(image, shear_y_matrix(factor), fill)


def translate_x(image, fraction, fill):
    return affine(image, translate_x_matrix(fraction, image.shape[1]), fill)


def translate_y(image, fraction, fill):
    return affine(image, translate_y_matrix(fraction, image.shape[0]), fill)


OPS = (
    auto_contrast,
    equalize,
    invert,
    rotate,
    posterize,
    solarize,
    solarize_add,
    color,
    contrast,
    brightness,
    sharpness,
    shear_x,
    shear_y,
    translate_x,
    translate_y,
)
