"""RandAugment and random erasing in JAX, inside the train step: the twins of jssl.data.randaugment.

With data.augment.on_device (and with the numpy pipeline) jssl.data.device_augment makes the
views on the accelerator; these are its RandAugment (after the crop and flip, before the colour
ops) and random erasing (after normalisation). Each op here is the twin of the tf.data op of the
same name given the same argument (tests/data/test_randaugment.py checks them equal), and the
draws follow the same distributions, from JAX keys made of the view's colour sub-seed (the host
folds its own colour sub-seed with the same streams, jssl.data.crops.RANDAUGMENT_STREAM and
ERASING_STREAM), so the two paths agree in distribution, not view for view.

Vectorised over the crops of a batch, a data-dependent op choice costs every candidate op, so a
layer computes each kind once (apply_layer): one affine resampling with the drawn op's matrix
(rotate, shear, translate), one lookup table (auto_contrast ... solarize_add), one blend with
the drawn op's degenerate image (color, contrast, brightness, sharpness), then selects.
References, levels and the deliberate differences from timm: jssl.data.randaugment.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jssl.data import crops

NUM_OPS = len(crops.RANDAUGMENT_OPS)
LUMA = (0.299, 0.587, 0.114)  # PIL convert("L"), as randaugment.LUMA
SMOOTH = ((1.0, 1.0, 1.0), (1.0, 5.0, 1.0), (1.0, 1.0, 1.0))  # PIL ImageFilter.SMOOTH / 13
SMOOTH_SCALE = 13.0
_OP = {name: k for k, name in enumerate(crops.RANDAUGMENT_OPS)}
GEOMETRIC = tuple(_OP[n] for n in ("rotate", "shear_x", "shear_y", "translate_x", "translate_y"))
LOOKUP = tuple(
    _OP[n] for n in ("auto_contrast", "equalize", "invert", "posterize", "solarize", "solarize_add")
)


class Layers(NamedTuple):
    """One image's RandAugment draws, one entry per layer (randaugment.Layers)."""

    op: jax.Array  # int32: index in crops.RANDAUGMENT_OPS
    apply: jax.Array  # bool
    magnitude: jax.Array  # float32 in [0, 10]
    negate: jax.Array  # bool


class Erasing(NamedTuple):
    box: jax.Array  # (4,) int32: top, left, height, width; zero size where nothing is erased
    noise: jax.Array  # (H, W, 3) float32: N(0, 1)


def op_arguments(magnitude: jax.Array, negate: jax.Array) -> jax.Array:
    """(..., NUM_OPS) float32: every op's argument (randaugment.op_arguments)."""
    level = jnp.asarray(magnitude, jnp.float32) / 10.0
    sign = jnp.where(negate, -1.0, 1.0)
    enhance = jnp.maximum(0.1, 1.0 + sign * level * 0.9)
    zero = jnp.zeros_like(level)
    return jnp.stack(
        [
            zero,
            zero,
            zero,
            sign * level * 30.0,
            4.0 - jnp.floor(level * 4.0),
            256.0 - jnp.minimum(256.0, jnp.floor(level * 256.0)),
            jnp.minimum(128.0, jnp.floor(level * 110.0)),
            enhance,
            enhance,
            enhance,
            enhance,
            sign * level * 0.3,
            sign * level * 0.3,
            sign * level * 0.45,
            sign * level * 0.45,
        ],
        axis=-1,
    )


# Lookup tables: (3, 256) int32, one per channel, on grey levels.
# No array is made at import: that would start a JAX backend before jax.distributed's set-up.
CHANNEL_OFFSETS = (0, 256, 512)


def _ramp() -> jax.Array:
    return jnp.arange(256, dtype=jnp.int32)


def levels(image: jax.Array) -> jax.Array:
    return jnp.floor(image * 255.0 + 0.5).astype(jnp.int32)


def histogram(image: jax.Array) -> jax.Array:
    flat = (levels(image) + jnp.asarray(CHANNEL_OFFSETS, jnp.int32)).reshape(-1)
    return jnp.zeros(768, jnp.int32).at[flat].add(1).reshape(3, 256)


def apply_lut(image: jax.Array, lut: jax.Array) -> jax.Array:
    mapped = jnp.take(lut.reshape(-1), levels(image) + jnp.asarray(CHANNEL_OFFSETS, jnp.int32))
    return mapped.astype(jnp.float32) / 255.0


def _per_channel(lut: jax.Array) -> jax.Array:
    return jnp.broadcast_to(lut, (3, 256))


def _first_last(hist: jax.Array) -> tuple[jax.Array, jax.Array]:
    present = hist > 0
    first = jnp.argmax(present, axis=-1).astype(jnp.int32)
    last = 255 - jnp.argmax(present[:, ::-1], axis=-1).astype(jnp.int32)
    return first[:, None], last[:, None]


def auto_contrast_lut(hist: jax.Array) -> jax.Array:
    low, high = _first_last(hist)
    stretched = jnp.clip((_ramp() - low) * 255 // jnp.maximum(high - low, 1), 0, 255)
    return jnp.where(high > low, stretched, _ramp())


def equalize_lut(hist: jax.Array) -> jax.Array:
    _, last = _first_last(hist)
    total = jnp.sum(hist, axis=-1, keepdims=True)
    step = (total - jnp.take_along_axis(hist, last, axis=-1)) // 255
    below = jnp.cumsum(hist, axis=-1) - hist
    lut = jnp.minimum((step // 2 + below) // jnp.maximum(step, 1), 255)
    return jnp.where(step > 0, lut, _ramp())


def invert_lut() -> jax.Array:
    return _per_channel(255 - _ramp())


def posterize_lut(bits: jax.Array) -> jax.Array:
    shift = 8 - jnp.asarray(bits).astype(jnp.int32)
    return _per_channel(jnp.left_shift(jnp.right_shift(_ramp(), shift), shift))


def solarize_lut(threshold: jax.Array) -> jax.Array:
    threshold = jnp.asarray(threshold).astype(jnp.int32)
    return _per_channel(jnp.where(_ramp() < threshold, _ramp(), 255 - _ramp()))


def solarize_add_lut(addition: jax.Array) -> jax.Array:
    added = jnp.minimum(255, _ramp() + jnp.asarray(addition).astype(jnp.int32))
    return _per_channel(jnp.where(_ramp() < 128, added, _ramp()))


def _blend(degenerate, image: jax.Array, factor: jax.Array) -> jax.Array:
    return jnp.clip(degenerate + factor * (image - degenerate), 0.0, 1.0)


def luma(image: jax.Array) -> jax.Array:
    return jnp.tensordot(image, jnp.asarray(LUMA, image.dtype), axes=[[-1], [0]])[..., None]


def smooth(image: jax.Array) -> jax.Array:
    """PIL's SMOOTH filter (randaugment.smooth): 3x3 on the interior, the border kept."""
    height, width = image.shape[:2]
    inner = sum(
        SMOOTH[i][j] / SMOOTH_SCALE * image[i : i + height - 2, j : j + width - 2]
        for i in range(3)
        for j in range(3)
    )
    return image.at[1:-1, 1:-1].set(inner)


# Affine maps as PIL's (a, b, c, d, e, f) (randaugment.rotate_matrix ...), as (6,) arrays.
def rotate_matrix(degrees: jax.Array, height: int, width: int) -> jax.Array:
    angle = -jnp.asarray(degrees, jnp.float32) * (math.pi / 180.0)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    cx, cy = width / 2.0, height / 2.0
    return jnp.stack([cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy])


def _matrix(*values) -> jax.Array:
    return jnp.stack([jnp.asarray(v, jnp.float32) for v in values])


def shear_x_matrix(factor: jax.Array) -> jax.Array:
    return _matrix(1.0, factor, 0.0, 0.0, 1.0, 0.0)


def shear_y_matrix(factor: jax.Array) -> jax.Array:
    return _matrix(1.0, 0.0, 0.0, factor, 1.0, 0.0)


def translate_x_matrix(fraction: jax.Array, width: int) -> jax.Array:
    return _matrix(1.0, 0.0, fraction * width, 0.0, 1.0, 0.0)


def translate_y_matrix(fraction: jax.Array, height: int) -> jax.Array:
    return _matrix(1.0, 0.0, 0.0, 0.0, 1.0, fraction * height)


def affine(image: jax.Array, matrix: jax.Array, fill: jax.Array) -> jax.Array:
    """randaugment.affine: bilinear with the sampling point clamped to the image (TF's
    ImageProjectiveTransformV3 with fill_mode NEAREST), the fill outside it (PIL)."""
    height, width = image.shape[:2]
    a, b, c, d, e, f = matrix[0], matrix[1], matrix[2], matrix[3], matrix[4], matrix[5]
    c, f = c + 0.5 * (a + b - 1.0), f + 0.5 * (d + e - 1.0)  # randaugment.index_transform
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
    return _blend(luma(image), image, factor)


def contrast(image, factor, fill):
    return _blend(jnp.mean(luma(image)), image, factor)


def brightness(image, factor, fill):
    return _blend(0.0, image, factor)


def sharpness(image, factor, fill):
    return _blend(smooth(image), image, factor)


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


def _select(op: jax.Array, table: dict, default):
    """table[op] for a traced ``op`` (a where chain: the table is small and its rows cheap)."""
    out = default
    for k, value in table.items():
        out = jnp.where(op == k, value, out)
    return out


def apply_layer(image: jax.Array, op, apply, magnitude, negate, fill) -> jax.Array:
    """One layer: OPS[op](image, op_arguments(...)[op], fill) where ``apply``, computed as one
    resampling, one lookup table and one blend whatever ``op`` is."""
    height, width = image.shape[:2]
    args = op_arguments(magnitude, negate)
    matrix = _select(
        op,
        {
            _OP["rotate"]: rotate_matrix(args[_OP["rotate"]], height, width),
            _OP["shear_x"]: shear_x_matrix(args[_OP["shear_x"]]),
            _OP["shear_y"]: shear_y_matrix(args[_OP["shear_y"]]),
            _OP["translate_x"]: translate_x_matrix(args[_OP["translate_x"]], width),
            _OP["translate_y"]: translate_y_matrix(args[_OP["translate_y"]], height),
        },
        _matrix(1.0, 0.0, 0.0, 0.0, 1.0, 0.0),
    )
    hist = histogram(image)
    lut = _select(
        op,
        {
            _OP["auto_contrast"]: auto_contrast_lut(hist),
            _OP["equalize"]: equalize_lut(hist),
            _OP["invert"]: invert_lut(),
            _OP["posterize"]: posterize_lut(args[_OP["posterize"]]),
            _OP["solarize"]: solarize_lut(args[_OP["solarize"]]),
            _OP["solarize_add"]: solarize_add_lut(args[_OP["solarize_add"]]),
        },
        _per_channel(_ramp()),
    )
    luma_ = luma(image)
    degenerate = _select(
        op,
        {_OP["color"]: luma_, _OP["contrast"]: jnp.mean(luma_), _OP["brightness"]: 0.0},
        smooth(image),
    )
    blended = _blend(degenerate, image, args[op])
    out = jnp.where(jnp.isin(op, jnp.asarray(GEOMETRIC)), affine(image, matrix, fill), blended)
    out = jnp.where(jnp.isin(op, jnp.asarray(LOOKUP)), apply_lut(image, lut), out)
    return jnp.where(apply, out, image)


def apply_layers(image: jax.Array, layers: Layers, fill) -> jax.Array:
    """The drawn layers applied in turn (randaugment.apply_layers)."""
    fill = jnp.asarray(fill, jnp.float32)
    for i in range(layers.op.shape[0]):
        image = apply_layer(
            image, layers.op[i], layers.apply[i], layers.magnitude[i], layers.negate[i], fill
        )
    return image


def sample_layers(key: jax.Array, num_ops: int, magnitude: float, magnitude_std: float) -> Layers:
    """randaugment.sample_layers's draws from a JAX key."""
    op_key, coin_key, magnitude_key, sign_key = jax.random.split(key, 4)
    shape = (num_ops,)
    op = jax.random.randint(op_key, shape, 0, NUM_OPS, jnp.int32)
    apply = jax.random.uniform(coin_key, shape) < crops.RANDAUGMENT_OP_PROB
    noise = jax.random.normal(magnitude_key, shape)
    drawn = jnp.clip(magnitude + magnitude_std * noise, 0.0, crops.RANDAUGMENT_MAX_MAGNITUDE)
    negate = jax.random.uniform(sign_key, shape) > 0.5
    return Layers(op, apply, drawn, negate)


def erasing_box(height: int, width: int, draws: jax.Array) -> jax.Array:
    """randaugment.erasing_box: (..., 4) int32 box from (..., 4, ERASING_ATTEMPTS) uniforms."""
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
