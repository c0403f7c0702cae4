"""SSL image transforms on one image, driven by explicit stateless seeds.

Every transform takes a float32 image in [0, 1] of shape (H, W, 3) and a seed of shape (2,)
(int32/int64) and is a pure function of the two: the same inputs give the same output eagerly and
inside `tf.data`, whatever the parallelism. `ssl_view` composes one training view in the order of
VISSL's SimCLR/MoCo-v2 pipeline (RandomResizedCrop, RandomHorizontalFlip, ImgPilColorDistortion,
ImgPilGaussianBlur, ImgPilRandomSolarize, ToTensor, Normalize; vissl/configs/config/pretrain/simclr
and vissl/data/ssl_transforms/img_pil_*.py), and `eval_image` is the usual resize + centre crop.
`make_crops` makes one example's crops of every crop group (jssl.data.crops), and `host_crops`
only their crop and flip where the train step makes the rest (jssl.data.device_augment), from
jssl.data.keyed_crops's draws, those of grain and the numpy pipeline. A
group with RandAugment or random erasing (the ViT fine-tuning recipes, jssl.data.randaugment)
gets RandAugment after the flip and random erasing after the normalisation, as timm's
transforms_imagenet_train orders them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from jssl.data import crops, keyed_crops, keyed_crops_tf, randaugment
from jssl.data.crops import CropGroup, blur_radius

Seed = tf.Tensor  # shape (2,), int32 or int64


def example_seed(seed: int, epoch: int | tf.Tensor, index: tf.Tensor) -> tf.Tensor:
    """The seed of one example: a function of (seed, epoch, index) only.

    Deriving it from the dataset index (not from the position in a batch or a stateful generator)
    is what makes the views independent of process count, sharding, skipping and parallelism.
    """
    base = tf.stack([tf.cast(seed, tf.int64), tf.cast(epoch, tf.int64)])
    return tf.random.experimental.stateless_fold_in(base, tf.cast(index, tf.int64))


def _uniform(seed: Seed, low: float = 0.0, high: float = 1.0) -> tf.Tensor:
    return tf.random.stateless_uniform([], seed=seed, minval=low, maxval=high, dtype=tf.float32)


def random_apply(
    fn: Callable[[tf.Tensor, Seed], tf.Tensor], prob: float, image: tf.Tensor, seed: Seed
) -> tf.Tensor:
    """Apply `fn(image, seed)` with probability `prob` (torchvision's RandomApply)."""
    if prob <= 0.0:
        return image
    coin_seed, fn_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    if prob >= 1.0:
        return fn(image, fn_seed)
    return tf.cond(_uniform(coin_seed) < prob, lambda: fn(image, fn_seed), lambda: image)


def crop_window(
    shape: tf.Tensor, seed: Seed, scale: Sequence[float], ratio: Sequence[float]
) -> tuple[tf.Tensor, tf.Tensor]:
    """(begin, size) of random_resized_crop's box in an image of `shape`: a function of the
    shape and the seed only, so the uint8 host path of data.augment.on_device crops the same box."""
    begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape,
        bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
        seed=seed,
        min_object_covered=0.0,
        aspect_ratio_range=tuple(ratio),
        area_range=tuple(scale),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    return begin, crop_size


def random_resized_crop(
    image: tf.Tensor,
    seed: Seed,
    size: int,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
) -> tf.Tensor:
    """Crop a random area fraction in `scale` with aspect ratio in `ratio`, resize to size^2.

    Inception-style crop as torchvision's RandomResizedCrop (used by VISSL's SSL configs); when no
    box is found after the attempts the whole image is used.
    """
    begin, crop_size = crop_window(tf.shape(image), seed, scale, ratio)
    crop = tf.slice(image, begin, crop_size)
    # antialias: PIL's bilinear resize (what VISSL uses) filters when downscaling.
    out = tf.image.resize(crop, (size, size), method="bilinear", antialias=True)
    return tf.clip_by_value(out, 0.0, 1.0)


def random_flip(image: tf.Tensor, seed: Seed, prob: float = 0.5) -> tf.Tensor:
    """Horizontal flip with probability `prob`."""
    return random_apply(lambda x, _: tf.image.flip_left_right(x), prob, image, seed)


def _grayscale3(image: tf.Tensor) -> tf.Tensor:
    return tf.tile(tf.image.rgb_to_grayscale(image), [1, 1, 3])


def _blend(image: tf.Tensor, other: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
    return tf.clip_by_value(other + factor * (image - other), 0.0, 1.0)


# The four colour adjustments with their factor given (jssl.data.device_augment has their twins).
def adjust_brightness(image: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
    return tf.clip_by_value(image * factor, 0.0, 1.0)


def adjust_contrast(image: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
    return _blend(image, tf.reduce_mean(tf.image.rgb_to_grayscale(image)), factor)


def adjust_saturation(image: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
    return _blend(image, _grayscale3(image), factor)


def adjust_hue(image: tf.Tensor, delta: tf.Tensor) -> tf.Tensor:
    return tf.clip_by_value(tf.image.adjust_hue(image, delta), 0.0, 1.0)


def color_jitter(
    image: tf.Tensor,
    seed: Seed,
    brightness: float,
    contrast: float,
    saturation: float,
    hue: float,
) -> tf.Tensor:
    """torchvision ColorJitter: the four adjustments, each with a random factor, in random order.

    Brightness/contrast/saturation follow torchvision's definitions (multiply; blend with the mean
    grey; blend with the greyscale image) rather than tf.image's additive brightness, so that
    VISSL's strengths mean the same thing here.
    """
    order_seed, b_seed, c_seed, s_seed, h_seed = tf.unstack(
        tf.random.experimental.stateless_split(seed, 5)
    )
    b = _uniform(b_seed, max(0.0, 1 - brightness), 1 + brightness)
    c = _uniform(c_seed, max(0.0, 1 - contrast), 1 + contrast)
    s = _uniform(s_seed, max(0.0, 1 - saturation), 1 + saturation)
    h = _uniform(h_seed, -hue, hue)
    branches = [
        lambda x: adjust_brightness(x, b),
        lambda x: adjust_contrast(x, c),
        lambda x: adjust_saturation(x, s),
        lambda x: adjust_hue(x, h),
    ]
    order = tf.argsort(tf.random.stateless_uniform([4], seed=order_seed))

    def apply_next(i, image):
        # Bind the image as a default: each branch must see this step's input.
        return i + 1, tf.switch_case(order[i], [lambda f=f, x=image: f(x) for f in branches])

    # A loop rather than four switch_cases: the four branches are traced once, not four times.
    _, image = tf.while_loop(lambda i, _: i < 4, apply_next, (tf.constant(0), image))
    return image


def color_distortion(
    image: tf.Tensor,
    seed: Seed,
    strength: float = 0.5,
    jitter_prob: float = 0.8,
    grayscale_prob: float = 0.2,
) -> tf.Tensor:
    """VISSL ImgPilColorDistortion: RandomApply(ColorJitter(0.8s, 0.8s, 0.8s, 0.2s), p) then
    RandomGrayscale(grayscale_prob)."""
    jitter_seed, gray_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    s = strength
    image = random_apply(
        lambda x, sd: color_jitter(x, sd, 0.8 * s, 0.8 * s, 0.8 * s, 0.2 * s),
        jitter_prob,
        image,
        jitter_seed,
    )
    return random_apply(lambda x, _: _grayscale3(x), grayscale_prob, image, gray_seed)


def gaussian_blur(
    image: tf.Tensor, seed: Seed, sigma_range: Sequence[float] = (0.1, 2.0)
) -> tf.Tensor:
    """Separable Gaussian blur, sigma (pixels) uniform in `sigma_range` (VISSL ImgPilGaussianBlur).

    The kernel spans ~10% of the image side as in SimCLR (appendix A); edges are reflected so the
    border does not darken.
    """
    return blur(image, _uniform(seed, sigma_range[0], sigma_range[1]))


def blur(image: tf.Tensor, sigma: tf.Tensor) -> tf.Tensor:
    """gaussian_blur with its sigma given."""
    side = image.shape[0] or 32  # static after the crop; a fallback keeps dynamic shapes working
    radius = blur_radius(side)
    x = tf.range(-radius, radius + 1, dtype=tf.float32)
    kernel = tf.exp(-(x**2) / (2.0 * sigma**2))
    kernel = kernel / tf.reduce_sum(kernel)
    padded = tf.pad(image[None], [[0, 0], [radius, radius], [radius, radius], [0, 0]], "REFLECT")
    k_h = tf.tile(tf.reshape(kernel, [-1, 1, 1, 1]), [1, 1, 3, 1])
    k_w = tf.tile(tf.reshape(kernel, [1, -1, 1, 1]), [1, 1, 3, 1])
    out = tf.nn.depthwise_conv2d(padded, k_h, [1, 1, 1, 1], "VALID")
    out = tf.nn.depthwise_conv2d(out, k_w, [1, 1, 1, 1], "VALID")
    return tf.clip_by_value(out[0], 0.0, 1.0)


def solarize(image: tf.Tensor, threshold: float = 128 / 255) -> tf.Tensor:
    """Invert pixels at or above the threshold (PIL ImageOps.solarize at 128, as BYOL/VISSL)."""
    return tf.where(image < threshold, image, 1.0 - image)


def normalize(image: tf.Tensor, mean: Sequence[float], std: Sequence[float]) -> tf.Tensor:
    """(x - mean) / std per channel, the ToTensor + Normalize ending of VISSL's pipelines."""
    mean_t = tf.constant(mean, tf.float32)
    std_t = tf.constant(std, tf.float32)
    return (image - mean_t) / std_t


def view_seeds(seed: Seed) -> list[tf.Tensor]:
    """A view's sub-seeds: crop, flip, colour, blur, solarize (ssl_view's, and those the host
    hands to the device with data.augment.on_device)."""
    return tf.unstack(tf.random.experimental.stateless_split(seed, 5))


def ssl_view(image: tf.Tensor, seed: Seed, group, augment) -> tf.Tensor:
    """One augmented, normalised view of `image` (float32 [0, 1]).

    `group` (a jssl.data.crops.CropGroup) gives the crop's size, scale range and the
    probability of each random transform; `augment` (the data.augment ConfigDict) the rest:
    crop_ratio, color_strength, blur_sigma, mean and std. Each transform gets its own
    sub-seed, so changing one probability does not reshuffle the randomness of the others;
    RandAugment and random erasing fold theirs from the colour sub-seed (crops'
    RANDAUGMENT_STREAM, ERASING_STREAM), which leaves the other draws as they were.
    """
    crop_s, flip_s, color_s, blur_s, solar_s = view_seeds(seed)
    image = random_resized_crop(image, crop_s, group.size, group.scale, augment.crop_ratio)
    image = random_flip(image, flip_s, group.flip_prob)
    if group.randaugment_ops > 0:
        ra_seed = randaugment.stream_seed(color_s, crops.RANDAUGMENT_STREAM)
        image = randaugment.rand_augment(image, ra_seed, group, crops.fill_color(augment.mean))
    image = color_distortion(
        image, color_s, augment.color_strength, group.color_jitter_prob, group.grayscale_prob
    )
    image = random_apply(
        lambda x, sd: gaussian_blur(x, sd, augment.blur_sigma), group.blur_prob, image, blur_s
    )
    image = random_apply(lambda x, _: solarize(x), group.solarize_prob, image, solar_s)
    image = normalize(image, augment.mean, augment.std)
    if group.random_erasing_prob > 0:
        erasing_seed = randaugment.stream_seed(color_s, crops.ERASING_STREAM)
        image = randaugment.random_erasing(image, erasing_seed, group.random_erasing_prob)
    return image


def eval_image(image: tf.Tensor, size: int, mean: Sequence[float], std: Sequence[float]):
    """Resize the shorter side to size/0.875 and centre-crop size^2 (the standard ImageNet eval).

    Images whose shorter side is at most `size` (CIFAR, the demo set, small transfer images)
    get their shorter side resized to `size` instead (a square one straight to size^2):
    upscaling then cropping 12.5% away would only lose content. The aspect ratio is kept.
    """
    shape = tf.shape(image)
    h = tf.cast(shape[0], tf.float32)
    w = tf.cast(shape[1], tf.float32)
    short = tf.minimum(h, w)
    target = tf.where(short <= size, float(size), size / 0.875)
    scale = target / short
    new_h = tf.maximum(tf.cast(tf.round(h * scale), tf.int32), size)
    new_w = tf.maximum(tf.cast(tf.round(w * scale), tf.int32), size)
    resized = tf.image.resize(image, tf.stack([new_h, new_w]), "bilinear", antialias=True)
    top = (new_h - size) // 2
    left = (new_w - size) // 2
    out = tf.slice(resized, tf.stack([top, left, 0]), [size, size, 3])
    out = tf.clip_by_value(tf.ensure_shape(out, [size, size, 3]), 0.0, 1.0)
    return normalize(out, mean, std)


def make_crops(
    image: tf.Tensor, seed: tf.Tensor, groups: Sequence[CropGroup], augment
) -> tuple[tf.Tensor, ...]:
    """One example's crops: a (num_crops, S, S, 3) tensor per group.

    ``seed`` is the example's seed; crop c (counted over all groups) gets the c-th of a
    stateless split, so with one group of two crops the views are those of a two-view pipeline.
    """
    seeds = tf.random.experimental.stateless_split(seed, sum(g.num_crops for g in groups))
    out, c = [], 0
    for group in groups:
        views = []
        for _ in range(group.num_crops):
            views.append(ssl_view(image, seeds[c], group, augment))
            c += 1
        out.append(tf.stack(views))
    return tuple(out)


def host_crops(
    image: tf.Tensor, key: tf.Tensor, groups: Sequence[CropGroup], augment
) -> tuple[tuple[tf.Tensor, ...], tuple[tf.Tensor, ...]]:
    """The host's half of the views with data.augment.on_device: crop and flip only.

    ``image`` is the decoded image, uint8 or float in [0, 1]; ``key`` the example's int64
    (seed, epoch, index). Returns (crops, seeds), per group a (num_crops, S, S, 3) uint8 tensor
    and a (num_crops, 3, 2) uint32 tensor: each crop's colour, blur and solarize seeds, which
    jssl.data.device_augment turns into the JAX keys of the rest of the view (the colour key
    also keys RandAugment and random erasing). Boxes, flips and seeds are jssl.data.keyed_crops's
    draws for the key, so grain and the numpy pipeline make the same crops; the crop is resized
    as make_crops resizes, then rounded to uint8.
    """
    num_crops = sum(g.num_crops for g in groups)
    words = keyed_crops_tf.example_words(key, num_crops)
    uniforms = tf.cast(words[:, keyed_crops.SEED_WORDS :], tf.float64) / 2.0**32
    seeds = tf.reshape(words[:, : keyed_crops.SEED_WORDS], [num_crops, 3, 2])
    shape = tf.shape(image)
    scales = [group.scale for group in groups for _ in range(group.num_crops)]
    boxes = keyed_crops_tf.crop_windows(
        shape[0], shape[1], scales, augment.crop_ratio, uniforms[:, 1:]
    )
    scale = 255.0 if image.dtype.is_floating else 1.0
    out_crops, out_seeds, c = [], [], 0
    for group in groups:
        views = []
        for _ in range(group.num_crops):
            box = boxes[c]
            crop = tf.slice(image, [box[0], box[1], 0], [box[2], box[3], 3])
            # Resize gives float32 in the input's range: [0, 255] from uint8 (cached splits),
            # [0, 1] from the float decoders.
            crop = tf.image.resize(crop, (group.size, group.size), "bilinear", antialias=True)
            # Round half up; the flip (exact) then moves a quarter of the bytes.
            crop = tf.saturate_cast(crop * scale + 0.5, tf.uint8)
            flip = uniforms[c, 0] < group.flip_prob  # a cond: a select of images costs more
            views.append(
                tf.cond(flip, lambda x=crop: tf.image.flip_left_right(x), lambda x=crop: x)
            )
            c += 1
        out_crops.append(tf.stack(views))
        out_seeds.append(seeds[c - group.num_crops : c])
    return tuple(out_crops), tuple(out_seeds)
