"""RandAugment and random erasing in tf.data: the data half of the ViT fine-tuning protocol.

MAE, BEiT and DeiT fine-tune with timm's ``--aa rand-m9-mstd0.5-inc1 --reprob 0.25 --remode
pixel --recount 1``: RandAugment (Cubuk et al. 2020) after the crop and flip, two layers per
image, each picking one of the 15 ops of jssl.data.crops.RANDAUGMENT_OPS and applying it with
probability 0.5 at a magnitude drawn from N(9, 0.5) clipped to [0, 10]; then, after
normalisation, random erasing (Zhong et al. 2020) of one box with per-pixel N(0, 1) noise.
Levels, ranges and fills follow timm/data/auto_augment.py (``_RAND_INCREASING_TRANSFORMS``,
the ``*_level_to_arg`` functions, ``img_mean`` fill) and timm/data/random_erasing.py.

Every op takes a float32 (H, W, 3) image in [0, 1], its argument and the fill colour, and is a
pure function of them; jssl.data.randaugment_device has each op's JAX twin (with
data.augment.on_device and the numpy pipeline), tests/data/test_randaugment.py checks them equal.
The draws are stateless, keyed by the view's seed (jssl.data.transforms.ssl_view).

Deliberate differences from timm (PIL on uint8; docs/operations.md, Data): the image stays
float between ops (PIL rounds to uint8 after each); the lookup-table ops (auto_contrast ...
solarize_add) quantise it to 256 levels first, as PIL's ops are defined; rotations, shears and
translations resample bilinearly (tf.raw_ops.ImageProjectiveTransformV3 has no bicubic, the
MAE/DeiT recipes' PIL interpolation); timm drops its colour jitter when RandAugment is on, here
the colour ops keep their probabilities (a fine-tuning preset sets them to 0).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import tensorflow as tf

from jssl.data import crops

NUM_OPS = len(crops.RANDAUGMENT_OPS)
LUMA = (0.299, 0.587, 0.114)  # PIL convert("L") (ITU-R 601-2), what ImageEnhance blends with
# PIL ImageFilter.SMOOTH, ImageEnhance.Sharpness's blurred image; PIL keeps the border pixels.
SMOOTH = ((1.0, 1.0, 1.0), (1.0, 5.0, 1.0), (1.0, 1.0, 1.0))
SMOOTH_SCALE = 13.0


class Layers(NamedTuple):
    """One image's RandAugment draws, one entry per layer."""

    op: tf.Tensor  # int32: index in crops.RANDAUGMENT_OPS
    apply: tf.Tensor  # bool: the layer's coin came up (probability 0.5)
    magnitude: tf.Tensor  # float32 in [0, 10]
    negate: tf.Tensor  # bool: the signed ops (rotate, shear, translate, enhance) go negative


class Erasing(NamedTuple):
    """One image's random erasing draws."""

    box: tf.Tensor  # (4,) int32: top, left, height, width; zero size where nothing is erased
    noise: tf.Tensor  # (H, W, 3) float32: N(0, 1), the erased pixels' values


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


# Lookup-table ops: PIL's ImageOps on grey levels; a table is (3, 256) int32, one per channel.
CHANNEL_OFFSETS = (0, 256, 512)  # channel c's table starts at 256 c in the flat (768,) table


def _ramp() -> tf.Tensor:
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


def _per_channel(lut: tf.Tensor) -> tf.Tensor:
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
    stretched = tf.clip_by_value((_ramp() - low) * 255 // tf.maximum(high - low, 1), 0, 255)
    return tf.where(high > low, stretched, _ramp())


def equalize_lut(hist: tf.Tensor) -> tf.Tensor:
    """PIL ImageOps.equalize: each channel's levels spread by their cumulative count."""
    _, last = _first_last(hist)
    total = tf.reduce_sum(hist, axis=-1, keepdims=True)
    step = (total - tf.gather(hist, last, batch_dims=1)) // 255
    below = tf.cumsum(hist, axis=-1, exclusive=True)
    lut = tf.minimum((step // 2 + below) // tf.maximum(step, 1), 255)
    return tf.where(step > 0, lut, _ramp())


def invert_lut() -> tf.Tensor:
    return _per_channel(255 - _ramp())


def posterize_lut(bits: tf.Tensor) -> tf.Tensor:
    """Keep the ``bits`` most significant bits (0 bits: black)."""
    shift = 8 - tf.cast(bits, tf.int32)
    return _per_channel(tf.bitwise.left_shift(tf.bitwise.right_shift(_ramp(), shift), shift))


def solarize_lut(threshold: tf.Tensor) -> tf.Tensor:
    """Invert the levels at or above ``threshold`` (PIL ImageOps.solarize)."""
    return _per_channel(tf.where(_ramp() < tf.cast(threshold, tf.int32), _ramp(), 255 - _ramp()))


def solarize_add_lut(addition: tf.Tensor) -> tf.Tensor:
    """Add ``addition`` to the levels below 128, saturating (timm solarize_add)."""
    added = tf.minimum(255, _ramp() + tf.cast(addition, tf.int32))
    return _per_channel(tf.where(_ramp() < 128, added, _ramp()))


# Blends: PIL ImageEnhance, image = degenerate + factor * (image - degenerate), clipped.
def _blend(degenerate: tf.Tensor, image: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
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
    return _blend(luma(image), image, factor)


def contrast(image, factor, fill):
    return _blend(tf.reduce_mean(luma(image)), image, factor)


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
