"""The photometric half of the SSL views, run on the accelerator inside the jitted train step.

With ``data.augment.on_device=True`` (and with grain and the numpy pipeline:
jssl.data.backend.views_on_device) the host makes only each view's crop and flip, as uint8
(jssl.data.transforms.host_crops), and hands over the view's colour, blur and solarize
sub-seeds (jssl.data.transforms.view_seeds, the host path's (seed, epoch, index, crop) key).
Here the rest of jssl.data.transforms.ssl_view runs in float32 on the devices: RandAugment where
a group has it, colour distortion (torchvision ColorJitter in a random order, RandomGrayscale),
blur, solarisation and normalisation (VISSL ImgPilColorDistortion, ImgPilGaussianBlur,
ImgPilRandomSolarize, Normalize), then random erasing (jssl.data.randaugment_device). Each op is
its host op's twin (tests/data/test_device_augment.py), but the draws are JAX's, not
TensorFlow's, so the two paths agree in distribution, not view for view. The key comes from the
data, never the step's rng or the device, so the views are the same on any device count and
after a resume. Crops are quantised to uint8 between crop and colour (at most half a grey level).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jssl.data import backend, randaugment_device
from jssl.data import crops as crops_lib
from jssl.data.crops import blur_radius

GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # tf.image.rgb_to_grayscale (ITU-R 601)
SOLARIZE_THRESHOLD = 128 / 255  # PIL ImageOps.solarize at 128, as transforms.solarize


def grayscale(image: jax.Array) -> jax.Array:
    """(..., 3) -> (..., 1) luma with tf.image.rgb_to_grayscale's weights."""
    return jnp.tensordot(image, jnp.asarray(GRAY_WEIGHTS, image.dtype), axes=[[-1], [0]])[..., None]


def _blend(image: jax.Array, other: jax.Array, factor: jax.Array) -> jax.Array:
    return jnp.clip(other + factor * (image - other), 0.0, 1.0)


def adjust_brightness(image: jax.Array, factor: jax.Array) -> jax.Array:
    return jnp.clip(image * factor, 0.0, 1.0)


def adjust_contrast(image: jax.Array, factor: jax.Array) -> jax.Array:
    return _blend(image, jnp.mean(grayscale(image)), factor)


def adjust_saturation(image: jax.Array, factor: jax.Array) -> jax.Array:
    return _blend(image, grayscale(image), factor)


def rgb_to_hsv(image: jax.Array) -> jax.Array:
    """HSV in [0, 1]^3, hue in turns, as TensorFlow's adjust_hue kernel computes it."""
    r, g, b = image[..., 0], image[..., 1], image[..., 2]
    value = jnp.max(image, axis=-1)
    chroma = value - jnp.min(image, axis=-1)
    safe_value = jnp.where(value > 0, value, 1.0)
    saturation = jnp.where(value > 0, chroma / safe_value, 0.0)
    norm = 1.0 / (6.0 * jnp.where(chroma > 0, chroma, 1.0))
    hue = jnp.where(
        r == value,
        norm * (g - b),
        jnp.where(g == value, norm * (b - r) + 2.0 / 6.0, norm * (r - g) + 4.0 / 6.0),
    )
    hue = jnp.where(chroma > 0, hue, 0.0)
    hue = jnp.where(hue < 0, hue + 1.0, hue)
    return jnp.stack([hue, saturation, value], axis=-1)


def hsv_to_rgb(hsv: jax.Array) -> jax.Array:
    """Inverse of rgb_to_hsv in closed form: channel n is v - v s clip(min(k, 4 - k), 0, 1) with
    k = (n + 6 h) mod 6 for n = 5, 3, 1 (red, green, blue), TF's sextant table without a gather."""
    hue, saturation, value = hsv[..., 0:1], hsv[..., 1:2], hsv[..., 2:3]
    k = jnp.mod(jnp.asarray([5.0, 3.0, 1.0], hsv.dtype) + hue * 6.0, 6.0)
    return value - value * saturation * jnp.clip(jnp.minimum(k, 4.0 - k), 0.0, 1.0)


def adjust_hue(image: jax.Array, delta: jax.Array) -> jax.Array:
    """Rotate the hue by ``delta`` turns (tf.image.adjust_hue, then clipped as on the host)."""
    hsv = rgb_to_hsv(image)
    hue = jnp.mod(hsv[..., 0] + delta, 1.0)
    return jnp.clip(hsv_to_rgb(hsv.at[..., 0].set(hue)), 0.0, 1.0)


def blur(image: jax.Array, sigma: jax.Array) -> jax.Array:
    """Separable Gaussian blur of one (S, S, 3) image, transforms.blur's kernel extent (~10% of
    the side) and reflected edges, as a sum of shifted copies (the kernel differs per crop)."""
    radius = blur_radius(image.shape[0])
    taps = jnp.arange(-radius, radius + 1, dtype=jnp.float32)
    kernel = jnp.exp(-(taps**2) / (2.0 * sigma**2))
    kernel = kernel / jnp.sum(kernel)
    padded = jnp.pad(image, [(radius, radius), (radius, radius), (0, 0)], mode="reflect")
    height, width = image.shape[:2]
    rows = sum(kernel[k] * padded[k : k + height] for k in range(2 * radius + 1))
    out = sum(kernel[k] * rows[:, k : k + width] for k in range(2 * radius + 1))
    return jnp.clip(out, 0.0, 1.0)


def solarize(image: jax.Array) -> jax.Array:
    return jnp.where(image < SOLARIZE_THRESHOLD, image, 1.0 - image)


def normalize(image: jax.Array, mean: Sequence[float], std: Sequence[float]) -> jax.Array:
    return (image - jnp.asarray(mean, image.dtype)) / jnp.asarray(std, image.dtype)


class ViewParams(NamedTuple):
    """One view's random draws (arrays; batched under vmap)."""

    jitter: jax.Array  # bool: colour jitter applied
    order: jax.Array  # (4,) int32: jitter ops in order, 0 brightness 1 contrast 2 saturation 3 hue
    factors: jax.Array  # (4,) float32: brightness, contrast, saturation factors and hue delta
    grayscale: jax.Array  # bool
    blur: jax.Array  # bool
    sigma: jax.Array  # float32, pixels
    solarize: jax.Array  # bool
    # Only where the group has them (None otherwise, an empty pytree under vmap).
    randaugment: randaugment_device.Layers | None = None
    erasing: randaugment_device.Erasing | None = None


def _coin(key: jax.Array, prob: float) -> tuple[jax.Array, jax.Array]:
    """(applied, key for the op): transforms.random_apply's split of its seed."""
    coin_key, op_key = jax.random.split(key)
    return jax.random.uniform(coin_key) < prob, op_key


def sample_params(keys: jax.Array, group: crops_lib.CropGroup, augment) -> ViewParams:
    """One view's draws from its (colour, blur, solarize) keys with ``group``'s probabilities
    and ``augment``'s strengths, split as transforms.color_distortion, gaussian_blur and
    random_apply split their seeds."""
    color_key, blur_key, solar_key = keys[0], keys[1], keys[2]
    jitter_key, gray_key = jax.random.split(color_key)
    jitter, jitter_key = _coin(jitter_key, group.color_jitter_prob)
    order_key, *factor_keys = jax.random.split(jitter_key, 5)
    s = augment.color_strength
    # ColorJitter(0.8s, 0.8s, 0.8s, 0.2s): factors in [max(0, 1 - x), 1 + x], hue in [-h, h].
    bounds = [(max(0.0, 1 - 0.8 * s), 1 + 0.8 * s)] * 3 + [(-0.2 * s, 0.2 * s)]
    factors = jnp.stack(
        [
            jax.random.uniform(key, (), jnp.float32, low, high)
            for key, (low, high) in zip(factor_keys, bounds, strict=True)
        ]
    )
    order = jnp.argsort(jax.random.uniform(order_key, (4,))).astype(jnp.int32)
    gray, _ = _coin(gray_key, group.grayscale_prob)
    blurred, sigma_key = _coin(blur_key, group.blur_prob)
    low, high = augment.blur_sigma
    sigma = jax.random.uniform(sigma_key, (), jnp.float32, low, high)
    solarized, _ = _coin(solar_key, group.solarize_prob)
    layers = erasing = None
    if group.randaugment_ops > 0:
        layers = randaugment_device.sample_layers(
            jax.random.fold_in(color_key, crops_lib.RANDAUGMENT_STREAM),
            group.randaugment_ops,
            group.randaugment_magnitude,
            group.randaugment_magnitude_std,
        )
    if group.random_erasing_prob > 0:
        erasing = randaugment_device.sample_erasing(
            jax.random.fold_in(color_key, crops_lib.ERASING_STREAM),
            group.size,
            group.size,
            group.random_erasing_prob,
        )
    return ViewParams(jitter, order, factors, gray, blurred, sigma, solarized, layers, erasing)


def _blend_op(image: jax.Array, op: jax.Array, factor: jax.Array) -> jax.Array:
    """Brightness (op 0), contrast (1) or saturation (2): each blends the image with a grey
    (black, the mean luma, the pixel's luma) by its factor, so one formula serves all three."""
    luma = grayscale(image)
    other = jnp.where(op == 0, 0.0, jnp.where(op == 1, jnp.mean(luma), luma))
    return _blend(image, other, factor)


def color_jitter(image: jax.Array, order: jax.Array, factors: jax.Array) -> jax.Array:
    """The four adjustments in ``order`` (transforms.color_jitter with its draws given).

    Vectorised over crops a data-dependent order costs every candidate op at every position;
    the hue rotation (an HSV round trip) is the expensive one, so it runs once, between the
    blends drawn before it and those drawn after it.
    """
    hue_position = jnp.argmax(order == 3)
    for i in range(3):  # positions that can precede the hue op
        blended = _blend_op(image, order[i], factors[order[i]])
        image = jnp.where(i < hue_position, blended, image)
    image = adjust_hue(image, factors[3])
    for i in range(1, 4):  # positions that can follow it
        blended = _blend_op(image, order[i], factors[order[i]])
        image = jnp.where(i > hue_position, blended, image)
    return image


def apply_params(image: jax.Array, params: ViewParams, group, augment) -> jax.Array:
    """A float (S, S, 3) crop in [0, 1] -> the normalised view. An op whose probability is 0
    for the group is left out of the program (the host's random_apply skips it too)."""
    if group.randaugment_ops > 0:
        fill = crops_lib.fill_color(augment.mean)
        image = randaugment_device.apply_layers(image, params.randaugment, fill)
    if group.color_jitter_prob > 0:
        jittered = color_jitter(image, params.order, params.factors)
        image = jnp.where(params.jitter, jittered, image)
    if group.grayscale_prob > 0:
        image = jnp.where(params.grayscale, jnp.broadcast_to(grayscale(image), image.shape), image)
    if group.blur_prob > 0:
        image = jnp.where(params.blur, blur(image, params.sigma), image)
    if group.solarize_prob > 0:
        image = jnp.where(params.solarize, solarize(image), image)
    image = normalize(image, augment.mean, augment.std)
    if group.random_erasing_prob > 0:
        image = randaugment_device.erase(image, params.erasing)
    return image


def seeds_to_keys(seeds: jax.Array) -> jax.Array:
    """(..., 3, 2) uint32 host sub-seeds -> (..., 3) threefry keys (explicit impl: the views
    must not change with jax_default_prng_impl)."""
    return jax.random.wrap_key_data(seeds.astype(jnp.uint32), impl="threefry2x32")


def augment_group(crops: jax.Array, seeds: jax.Array, group, augment) -> jax.Array:
    """(N, k, S, S, 3) uint8 crops and their (N, k, 3, 2) seeds -> (N, k, S, S, 3) float32 views."""
    keys = seeds_to_keys(seeds)

    def one(crop, crop_keys):
        params = sample_params(crop_keys, group, augment)
        return apply_params(crop.astype(jnp.float32) / 255.0, params, group, augment)

    return jax.vmap(jax.vmap(one))(crops, keys)


def make_batch_augment(data_config) -> Callable[[dict], dict] | None:
    """The step's batch transform for ``data_config``: the host batch's uint8 ``crops`` and
    ``aug_seeds`` -> float32 normalised ``crops``. None where the host makes the whole views
    (data.augment.on_device off, and not the numpy pipeline: jssl.data.backend.views_on_device)."""
    if not backend.views_on_device(data_config):
        return None
    groups = crops_lib.crop_groups(data_config)
    augment = data_config.augment

    def augment_batch(batch: dict[str, Any]) -> dict[str, Any]:
        batch = dict(batch)
        seeds = batch.pop("aug_seeds")
        batch["crops"] = tuple(
            augment_group(c, s, g, augment)
            for c, s, g in zip(batch["crops"], seeds, groups, strict=True)
        )
        return batch

    return augment_batch
