"""RandAugment's 15 image ops in tf.data, as PIL defines them: jssl.data.randaugment draws them.

Every op takes a float32 (H, W, 3) image in [0, 1], its argument (timm's level_to_arg,
jssl.data.randaugment.op_arguments) and the fill colour, and is a pure function of them; OPS
lists them in jssl.data.crops.RANDAUGMENT_OPS's order. They follow the PIL calls of
timm/data/auto_augment.py: ImageOps (auto_contrast, equalize, invert, posterize, solarize;
timm's own solarize_add), ImageEnhance (color, contrast, brightness, sharpness) and
Image.transform with timm's affine maps (rotate, shear, translate), filled with ``img_mean``.
jssl.data.randaugment_ops_device holds the JAX twins; tests/data/test_randaugment.py checks
them equal, and equal to PIL's. Deliberately unlike PIL on uint8: the lookup-table ops
(auto_contrast ... solarize_add) quantise the float image to 256 levels first, as PIL's ops are
defined, and return floats; the affine ops resample bilinearly
(tf.raw_ops.ImageProjectiveTransformV3 has no bicubic, the MAE/DeiT recipes' PIL interpolation).
"""

from __future__ import annotations

import math

import tensorflow as tf

LUMA = (0.299, 0.587, 0.114)  # PIL convert("L") (ITU-R 601-2), what ImageEnhance blends with
# PIL ImageFilter.SMOOTH, ImageEnhance.Sharpness's blurred image; PIL keeps the border pixels.
SMOOTH = ((1.0, 1.0, 1.0), (1.0, 5.0, 1.0), (1.0, 1.0, 1.0))
SMOOTH_SCALE = 13.0


# Lookup-table ops: PIL's ImageOps on grey levels; a table is (3, 256) int32, one per channel.
CHANNEL_OFFSETS = (0, 256, 512)  # channel c's table starts at 256 c in the flat (768,) table


def ramp() -> tf.Tensor:
    """The identity table, 0..255 (made per call: no tensor is built at import)."""
    return tf.range(256, dtype=tf.int32)


def levels(image: tf.Tensor) -> tf.Tensor:
    """[0, 1] floats -> int32 grey levels 0..255 (round half up)."""
    return tf.cast(tf.floor(image * 255.0 + 0.5), tf.int32)


def histogram(image: tf.Tensor) -> tf.Tensor:
    """(3, 256) int32: each channel's count of every grey level."""
    flat = tf.reshape(levels(image) + tf.constant(CHANNEL_OFFSETS, tf.int32), [-1])
    counts = tf.math.bincount(flat, minlength=768, maxlength=768, dtype=tf.int32)
    return tf.reshape(counts, [3, 256])


def apply_lut(image: tf.Tensor, lut: tf.Tensor) -> tf.Tensor:
    """The image's grey levels mapped through the (3, 256) table, back to [0, 1]."""
    mapped = tf.gather(
        tf.reshape(lut, [-1]), levels(image) + tf.constant(CHANNEL_OFFSETS, tf.int32)
    )
    return tf.cast(mapped, tf.float32) / 255.0


def per_channel(lut: tf.Tensor) -> tf.Tensor:
    return tf.tile(lut[None], [3, 1])


def _first_last(hist: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(3, 1) indices of each channel's lowest and highest level present."""
    present = tf.cast(hist > 0, tf.int32)
    first = tf.argmax(present, axis=-1, output_type=tf.int32)
    last = 255 - tf.argmax(tf.reverse(present, [-1]), axis=-1, output_type=tf.int32)
    return first[:, None], last[:, None]


def auto_contrast_lut(hist: tf.Tensor) -> tf.Tensor:
    """PIL ImageOps.autocontrast (cutoff 0): each channel stretched to 0..255, in integers."""
    low, high = _first_last(hist)
    stretched = tf.clip_by_value((ramp() - low) * 255 // tf.maximum(high - low, 1), 0, 255)
    return tf.where(high > low, stretched, ramp())


def equalize_lut(hist: tf.Tensor) -> tf.Tensor:
    """PIL ImageOps.equalize: each channel's levels spread by their cumulative count."""
    _, last = _first_last(hist)
    total = tf.reduce_sum(hist, axis=-1, keepdims=True)
    step = (total - tf.gather(hist, last, batch_dims=1)) // 255
    below = tf.cumsum(hist, axis=-1, exclusive=True)
    lut = tf.minimum((step // 2 + below) // tf.maximum(step, 1), 255)
    return tf.where(step > 0, lut, ramp())


def invert_lut() -> tf.Tensor:
    return per_channel(255 - ramp())


def posterize_lut(bits: tf.Tensor) -> tf.Tensor:
    """Keep the ``bits`` most significant bits (0 bits: black)."""
    shift = 8 - tf.cast(bits, tf.int32)
    return per_channel(tf.bitwise.left_shift(tf.bitwise.right_shift(ramp(), shift), shift))


def solarize_lut(threshold: tf.Tensor) -> tf.Tensor:
    """Invert the levels at or above ``threshold`` (PIL ImageOps.solarize)."""
    return per_channel(tf.where(ramp() < tf.cast(threshold, tf.int32), ramp(), 255 - ramp()))


def solarize_add_lut(addition: tf.Tensor) -> tf.Tensor:
    """Add ``addition`` to the levels below 128, saturating (timm solarize_add)."""
    added = tf.minimum(255, ramp() + tf.cast(addition, tf.int32))
    return per_channel(tf.where(ramp() < 128, added, ramp()))


# Blends: PIL ImageEnhance, image = degenerate + factor * (image - degenerate), clipped.
def blend(degenerate: tf.Tensor, image: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
    return tf.clip_by_value(degenerate + factor * (image - degenerate), 0.0, 1.0)


def luma(image: tf.Tensor) -> tf.Tensor:
    return tf.tensordot(image, tf.constant(LUMA, tf.float32), axes=[[-1], [0]])[..., None]


def smooth(image: tf.Tensor) -> tf.Tensor:
    """PIL's SMOOTH filter: the interior pixels blurred by the 3x3 kernel, the border kept."""
    kernel = tf.constant(SMOOTH, tf.float32) / SMOOTH_SCALE
    kernel = tf.tile(kernel[:, :, None, None], [1, 1, 3, 1])
    inner = tf.nn.depthwise_conv2d(image[None], kernel, [1, 1, 1, 1], "VALID")[0]
    border = tf.pad(
        tf.zeros_like(inner[..., :1], tf.bool), [[1, 1], [1, 1], [0, 0]], "CONSTANT", True
    )
    return tf.where(border, image, tf.pad(inner, [[1, 1], [1, 1], [0, 0]]))


# Affine maps as PIL's (a, b, c, d, e, f): the output pixel centred at (x, y) samples the input
# at (a x + b y + c, d x + e y + f), in coordinates where pixel i spans [i, i + 1).
def rotate_matrix(degrees: tf.Tensor, height: int, width: int) -> list:
    """PIL Image.rotate about the image centre, counter-clockwise for positive degrees."""
    angle = -tf.cast(degrees, tf.float32) * (math.pi / 180.0)
    cos, sin = tf.cos(angle), tf.sin(angle)
    cx, cy = width / 2.0, height / 2.0
    return [cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy]


def shear_x_matrix(factor: tf.Tensor) -> list:
    return [1.0, factor, 0.0, 0.0, 1.0, 0.0]


def shear_y_matrix(factor: tf.Tensor) -> list:
    return [1.0, 0.0, 0.0, factor, 1.0, 0.0]


def translate_x_matrix(fraction: tf.Tensor, width: int) -> list:
    return [1.0, 0.0, fraction * width, 0.0, 1.0, 0.0]


def translate_y_matrix(fraction: tf.Tensor, height: int) -> list:
    return [1.0, 0.0, 0.0, 0.0, 1.0, fraction * height]


def index_transform(matrix: list) -> list:
    """PIL's ``matrix`` in TF's convention, pixel i at coordinate i: the half-pixel shift
    moves into the offsets."""
    a, b, c, d, e, f = matrix
    return [a, b, c + 0.5 * (a + b - 1.0), d, e, f + 0.5 * (d + e - 1.0)]


def affine(image: tf.Tensor, matrix: list, fill: tf.Tensor) -> tf.Tensor:
    """The image resampled (bilinear) through the PIL-style affine ``matrix``, as PIL's
    Image.transform samples: a point inside the input interpolates its neighbours clamped to
    the edge, a point outside it takes the ``fill`` colour."""
    a, b, c, d, e, f = (tf.cast(v, tf.float32) for v in index_transform(matrix))
    height, width = image.shape[0], image.shape[1]
    # fill_mode NEAREST clamps the sampling point to the image: PIL's edge clamping.
    warped = tf.raw_ops.ImageProjectiveTransformV3(
        images=image[None],
        transforms=tf.stack([a, b, c, d, e, f, 0.0, 0.0])[None],
        output_shape=[height, width],
        fill_value=0.0,
        interpolation="BILINEAR",
        fill_mode="NEAREST",
    )[0]
    y = tf.range(height, dtype=tf.float32)[:, None]
    x = tf.range(width, dtype=tf.float32)[None, :]
    source_x, source_y = a * x + b * y + c, d * x + e * y + f
    inside = (source_x >= -0.5) & (source_x < width - 0.5)
    inside &= (source_y >= -0.5) & (source_y < height - 0.5)
    return tf.where(inside[..., None], tf.ensure_shape(warped, image.shape), fill)


# The ops, in crops.RANDAUGMENT_OPS's order: op(image, argument, fill) -> image.
def auto_contrast(image, arg, fill):
    return apply_lut(image, auto_contrast_lut(histogram(image)))


def equalize(image, arg, fill):
    return apply_lut(image, equalize_lut(histogram(image)))


def invert(image, arg, fill):
    return apply_lut(image, invert_lut())


def rotate(image, degrees, fill):
    return affine(image, rotate_matrix(degrees, image.shape[0], image.shape[1]), fill)


def posterize(image, bits, fill):
    return apply_lut(image, posterize_lut(bits))


def solarize(image, threshold, fill):
    return apply_lut(image, solarize_lut(threshold))


def solarize_add(image, addition, fill):
    return apply_lut(image, solarize_add_lut(addition))


def color(image, factor, fill):
    return blend(luma(image), image, factor)


def contrast(image, factor, fill):
    return blend(tf.reduce_mean(luma(image)), image, factor)


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
