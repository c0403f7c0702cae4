"""RandAugment and random erasing (the ViT fine-tuning recipes' augmentations): each tf.data
op equals its JAX twin given the same argument, both follow timm's levels and PIL's ops, the
draws are deterministic given the seed and follow timm's distributions, erasing's box and fill,
the config fields' checks, and the defaults leave the views as they were."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image, ImageEnhance, ImageOps

from jssl.data import backend, crops, default_config, transforms
from jssl.data import device_augment as dev
from jssl.data import randaugment as host
from jssl.data import randaugment_device as device

H, W = 24, 20  # not square (a swapped height and width would show); > 255 pixels (equalize)
FILL = crops.fill_color(default_config().augment.mean)
OPS = crops.RANDAUGMENT_OPS


def _image(h=H, w=W, seed=0):
    rng = np.random.default_rng(seed)
    image = rng.integers(30, 220, (h, w, 3)).astype(np.float32) / 255
    image[:3, :3] = 1.0  # a bright corner: a skewed histogram for equalize / auto_contrast
    return image


def _host_args(magnitude, negate):
    return host.op_arguments(tf.constant(magnitude, tf.float32), tf.constant(negate)).numpy()


@jax.jit
def _device_ops(image, magnitude, negate):
    """Every device op at the arguments of (magnitude, negate), alone and as the step's fused
    layer (one resampling, one table, one blend), also with the layer's coin failed."""
    args = device.op_arguments(magnitude, negate)
    fill = jnp.asarray(FILL)
    alone = jnp.stack([op(image, args[k], fill) for k, op in enumerate(device.OPS)])
    ops = jnp.arange(len(OPS))

    def fused(apply):
        return jax.vmap(lambda k: device.apply_layer(image, k, apply, magnitude, negate, fill))(ops)

    return alone, fused(True), fused(False)


def test_each_op_equals_its_device_twin_given_the_argument():
    image = _image()
    assert tuple(op.__name__ for op in host.OPS) == tuple(op.__name__ for op in device.OPS) == OPS
    for magnitude, negate in [(9.0, False), (9.0, True), (4.2, True), (10.0, False)]:
        args = _host_args(magnitude, negate)
        np.testing.assert_array_equal(args, device.op_arguments(magnitude, negate))
        alone, fused, skipped = jax.device_get(_device_ops(image, magnitude, negate))
        for k, name in enumerate(OPS):
            expected = host.OPS[k](tf.constant(image), tf.constant(args[k]), tf.constant(FILL))
            expected = expected.numpy()
            message = f"{name} at magnitude {magnitude}, negate {negate}"
            np.testing.assert_allclose(alone[k], expected, atol=2e-6, err_msg=message)
            np.testing.assert_allclose(fused[k], expected, atol=2e-6, err_msg="fused " + message)
            np.testing.assert_array_equal(skipped[k], image)
            assert np.abs(expected - image).max() > 0.01, message + " did nothing"


def test_arguments_follow_timms_levels():
    # timm auto_augment.py, the *_level_to_arg of _RAND_INCREASING_TRANSFORMS.
    k = {name: OPS.index(name) for name in OPS}
    for magnitude, negate, rotate, bits, threshold, add, enhance, shear, shift in [
        (0.0, False, 0.0, 4, 256, 0, 1.0, 0.0, 0.0),  # no change
        (9.0, False, 27.0, 1, 26, 99, 1.81, 0.27, 0.405),
        (9.0, True, -27.0, 1, 26, 99, 0.19, -0.27, -0.405),
        (10.0, True, -30.0, 0, 0, 110, 0.1, -0.3, -0.45),  # the strongest
    ]:
        for args in (
            _host_args(magnitude, negate),
            np.asarray(device.op_arguments(magnitude, negate)),
        ):
            np.testing.assert_allclose(args[k["rotate"]], rotate, atol=1e-5)
            assert (args[k["posterize"]], args[k["solarize"]]) == (bits, threshold)
            assert args[k["solarize_add"]] == add
            for name in ("color", "contrast", "brightness", "sharpness"):
                np.testing.assert_allclose(args[k[name]], enhance, atol=1e-6)
            np.testing.assert_allclose(args[[k["shear_x"], k["shear_y"]]], shear, atol=1e-6)
            np.testing.assert_allclose(args[[k["translate_x"], k["translate_y"]]], shift, atol=1e-6)
    assert FILL == (124 / 255, 116 / 255, 104 / 255)  # timm img_mean of the ImageNet mean


def _pil_ops(pil, arg, fill):
    """timm's PIL op for each name, with the argument level_to_arg gives (bilinear resampling:
    ImageProjectiveTransform has no bicubic, the recipes' interpolation)."""
    kw = dict(resample=Image.BILINEAR, fillcolor=fill)
    w, h = pil.size
    return {
        "auto_contrast": lambda: ImageOps.autocontrast(pil),
        "equalize": lambda: ImageOps.equalize(pil),
        "invert": lambda: ImageOps.invert(pil),
        "rotate": lambda: pil.rotate(arg, **kw),
        "posterize": lambda: (
            ImageOps.posterize(pil, int(arg)) if arg else Image.new("RGB", pil.size)
        ),
        "solarize": lambda: ImageOps.solarize(pil, arg),
        "solarize_add": lambda: pil.point(
            [min(255, i + int(arg)) if i < 128 else i for i in range(256)] * 3
        ),
        "color": lambda: ImageEnhance.Color(pil).enhance(arg),
        "contrast": lambda: ImageEnhance.Contrast(pil).enhance(arg),
        "brightness": lambda: ImageEnhance.Brightness(pil).enhance(arg),
        "sharpness": lambda: ImageEnhance.Sharpness(pil).enhance(arg),
        "shear_x": lambda: pil.transform(pil.size, Image.AFFINE, (1, arg, 0, 0, 1, 0), **kw),
        "shear_y": lambda: pil.transform(pil.size, Image.AFFINE, (1, 0, 0, arg, 1, 0), **kw),
        "translate_x": lambda: pil.transform(
            pil.size, Image.AFFINE, (1, 0, arg * w, 0, 1, 0), **kw
        ),
        "translate_y": lambda: pil.transform(
            pil.size, Image.AFFINE, (1, 0, 0, 0, 1, arg * h), **kw
        ),
    }


def test_ops_match_timms_pil_ops():
    image = _image(20, 17, seed=1)
    levels = np.round(image * 255).astype(np.uint8)
    pil = Image.fromarray(levels)
    fill = tuple(round(f * 255) for f in FILL)
    for negate in (False, True):
        args = _host_args(9.0, negate)
        for k, name in enumerate(OPS):
            expected = np.asarray(_pil_ops(pil, float(args[k]), fill)[name]()).astype(np.float32)
            ours = host.OPS[k](tf.constant(image), tf.constant(args[k]), tf.constant(FILL))
            # PIL rounds to grey levels (and its luma, and autocontrast's scale in doubles).
            np.testing.assert_allclose(ours.numpy() * 255, expected, atol=1.5, err_msg=name)


def _host_draws(n, seed=0):
    def draw(i):
        return host.sample_layers(tf.stack([tf.constant(seed, tf.int64), i]), 2, 9.0, 0.5)

    layers = list(tf.data.Dataset.range(n).map(draw).as_numpy_iterator())
    return host.Layers(*(np.stack(field) for field in zip(*layers, strict=True)))


def _device_draws(n, seed=0):
    keys = jax.random.split(jax.random.key(seed, impl="threefry2x32"), n)
    return jax.device_get(jax.jit(jax.vmap(lambda k: device.sample_layers(k, 2, 9.0, 0.5)))(keys))


def test_draws_deterministic_given_the_seed_and_as_timms():
    seed = tf.constant([3, 7], tf.int64)
    first, again = host.sample_layers(seed, 2, 9.0, 0.5), host.sample_layers(seed, 2, 9.0, 0.5)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    n = 1500
    for draws in (_host_draws(n), _device_draws(n)):
        assert draws.op.shape == (n, 2) and draws.op.dtype == np.int32
        counts = np.bincount(draws.op.ravel(), minlength=len(OPS))
        expected = 2 * n / len(OPS)  # uniform over the 15, with replacement
        assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected)), counts
        assert np.mean(draws.op[:, 0] == draws.op[:, 1]) > 0.03  # the same op twice happens
        for coin in (draws.apply, draws.negate):
            assert abs(np.mean(coin) - 0.5) < 4 * np.sqrt(0.25 / (2 * n))
        magnitude = draws.magnitude
        assert 0.0 <= magnitude.min() and magnitude.max() <= 10.0
        assert abs(magnitude.mean() - 9.0) < 0.05 and 0.45 < magnitude.std() < 0.55
        assert 0.005 < np.mean(magnitude == 10.0) < 0.05  # N(9, 0.5) clipped: ~2.3% at 10
    # Another seed, other draws.
    other = _host_draws(8, seed=1)
    assert not np.array_equal(other.op, _host_draws(8).op)


_device_layers = jax.jit(lambda image, layers: device.apply_layers(image, layers, FILL))


def test_layers_equal_their_device_twins():
    image = _image()
    for op, apply, magnitude, negate in [
        ([3, 1], [True, True], [9.2, 8.1], [False, True]),
        ([14, 10], [False, True], [9.0, 9.6], [True, False]),
        ([6, 6], [True, True], [10.0, 7.3], [False, False]),
        ([11, 0], [True, False], [8.7, 9.0], [True, True]),
    ]:
        layers = host.Layers(
            tf.constant(op, tf.int32),
            tf.constant(apply),
            tf.constant(magnitude, tf.float32),
            tf.constant(negate),
        )
        expected = host.apply_layers(tf.constant(image), layers, tf.constant(FILL)).numpy()
        twin = _device_layers(image, device.Layers(*(f.numpy() for f in layers)))
        np.testing.assert_allclose(twin, expected, atol=3e-6)
        if any(apply):
            assert np.abs(expected - image).max() > 0.01


def test_erasing_box_twins_first_fit_and_statistics():
    rng = np.random.default_rng(0)
    size = 32
    draws = rng.uniform(0, 1, (3000, 4, crops.ERASING_ATTEMPTS)).astype(np.float32)
    boxes = host.erasing_box(size, size, tf.constant(draws)).numpy()
    np.testing.assert_array_equal(device.erasing_box(size, size, draws), boxes)
    top, left, h, w = boxes.T
    found = h > 0
    assert found.mean() > 0.95  # most first attempts fit at these ranges
    assert np.all((top >= 0) & (left >= 0) & (top + h <= size) & (left + w <= size))
    assert np.all((h[found] < size) & (w[found] < size))
    area = h[found] * w[found] / size**2
    low, high = crops.ERASING_AREA
    assert low * 0.6 < area.min() < low * 1.5 and high * 0.8 < area.max() < high * 1.3
    assert 0.12 < area.mean() < 0.2  # uniform in [0.02, 1/3], less the boxes that do not fit
    aspect = np.log(h[found] / w[found])
    assert abs(aspect.mean()) < 0.05  # log-uniform in [0.3, 3.3]: symmetric
    assert np.log(0.3) - 0.3 < aspect.min() < np.log(0.4) and np.log(2.5) < aspect.max()
    # Positions: uniform over the size - h + 1 rows.
    assert abs(np.mean(top[found] / (size - h[found]).clip(1)) - 0.5) < 0.03
    # The first attempt that fits wins; none fitting erases nothing.
    crafted = np.zeros((2, 4, crops.ERASING_ATTEMPTS), np.float32)
    crafted[:, 0] = 0.99  # area fraction ~1/3 ...
    crafted[:, 1] = 0.999  # ... at aspect 3.3: h = round(sqrt(0.33 * 3.3) * 32) > 32
    crafted[0, :2, 1] = [0.5, 0.5]  # attempt 1: area ~0.18, square
    crafted[0, 2:, 1] = [0.5, 0.0]
    boxes = host.erasing_box(size, size, tf.constant(crafted)).numpy()
    side = round(float(np.sqrt((0.02 + 0.5 * (1 / 3 - 0.02)) * size * size)))
    np.testing.assert_array_equal(boxes[0], [(size - side + 1) // 2, 0, side, side])
    np.testing.assert_array_equal(boxes[1], [0, 0, 0, 0])


def test_erasing_fills_the_box_with_noise_after_normalisation():
    image = _image(32, 32)
    box = np.array([5, 3, 10, 20], np.int32)
    noise = np.random.default_rng(1).normal(size=image.shape).astype(np.float32)
    expected = host.erase(tf.constant(image), host.Erasing(tf.constant(box), tf.constant(noise)))
    twin = device.erase(jnp.asarray(image), device.Erasing(jnp.asarray(box), jnp.asarray(noise)))
    np.testing.assert_array_equal(twin, expected.numpy())
    inside = np.zeros(image.shape, bool)
    inside[5:15, 3:23] = True
    np.testing.assert_array_equal(expected.numpy()[inside], noise[inside])
    np.testing.assert_array_equal(expected.numpy()[~inside], image[~inside])
    # The drawn noise is N(0, 1) per pixel and channel; prob 0 never erases.
    erasing = host.sample_erasing(tf.constant([1, 2], tf.int64), 32, 32, 1.0)
    assert abs(erasing.noise.numpy().mean()) < 0.08 and abs(erasing.noise.numpy().std() - 1) < 0.06
    assert host.sample_erasing(tf.constant([1, 2], tf.int64), 32, 32, 0.0).box.numpy()[2] == 0


def _config(**augment):
    config = default_config()
    config.image_size = H
    config.augment.num_crops = (1,)
    config.augment.update(augment)
    return config


@pytest.mark.parametrize(
    "field, value",
    [
        ("randaugment_ops", -1),
        ("randaugment_magnitude", 11.0),
        ("randaugment_magnitude", -0.5),
        ("randaugment_magnitude_std", -0.1),
        ("randaugment_magnitude_std", float("inf")),
        ("random_erasing_prob", 1.5),
    ],
)
def test_fields_are_checked_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"data.augment.{field}="):
        crops.crop_groups(_config(**{field: value}))


def test_the_trainer_refuses_a_bad_field_at_start_up():
    from configs import moco
    from jssl.engines import train

    config = moco.get_config("test")
    config.data.augment.random_erasing_prob = -0.25
    with pytest.raises(ValueError, match="data.augment.random_erasing_prob"):
        train.validate(config)


def test_defaults_change_nothing_and_erasing_leaves_the_other_draws():
    (default,) = crops.crop_groups(_config())
    assert default.randaugment_ops == 0 and default.random_erasing_prob == 0.0
    base = dict(color_jitter_prob=(0.0,), grayscale_prob=(0.0,), blur_prob=(0.0,))
    assert not any(crops.photometric(g) for g in crops.crop_groups(_config(**base)))
    numpy_config = _config(random_erasing_prob=0.25, **base)
    numpy_config.loader = "numpy"
    assert backend.views_on_device(numpy_config)  # the step makes the erasing
    image = tf.constant(_image(24, 20))
    seed = tf.constant([4, 2], tf.int64)
    augment = _config().augment
    plain = transforms.ssl_view(image, seed, default, augment).numpy()
    # Off means off: the other settings alone change nothing.
    idle = default._replace(randaugment_magnitude=3.0, randaugment_magnitude_std=2.0)
    np.testing.assert_array_equal(transforms.ssl_view(image, seed, idle, augment), plain)
    # Erasing on: the same view but for the box (its draws come from their own stream).
    erased = transforms.ssl_view(image, seed, default._replace(random_erasing_prob=1.0), augment)
    changed = np.any(erased.numpy() != plain, axis=-1)
    rows, cols = np.nonzero(changed)
    assert 0 < changed.sum() == (np.ptp(rows) + 1) * (np.ptp(cols) + 1)  # one rectangle
    # The same on the device, from the host's uint8 crops.
    key = tf.constant([4, 2, 0], tf.int64)
    uint8, seeds = transforms.host_crops(image, key, [default], augment)
    crop, crop_seeds = uint8[0].numpy()[None], seeds[0].numpy()[None]
    views = [
        np.asarray(
            jax.jit(lambda c, s, g=group: dev.augment_group(c, s, g, augment))(crop, crop_seeds)
        )
        for group in (default, default._replace(random_erasing_prob=1.0))
    ]
    changed = np.any(views[0] != views[1], axis=-1)[0, 0]
    rows, cols = np.nonzero(changed.any(axis=1))[0], np.nonzero(changed.any(axis=0))[0]
    assert 0 < changed.sum() == (np.ptp(rows) + 1) * (np.ptp(cols) + 1)  # one rectangle


def test_views_with_randaugment_deterministic_in_tf_data():
    group = crops.crop_groups(_config(randaugment_ops=2, random_erasing_prob=0.5))[0]
    augment = _config().augment
    image = tf.constant(_image(24, 20))

    def view(seed):
        return transforms.ssl_view(image, seed, group, augment)

    seeds = tf.constant([[0, s] for s in range(3)], tf.int64)
    in_tf_data = np.stack(list(tf.data.Dataset.from_tensor_slices(seeds).map(view)))
    eager = np.stack([view(s).numpy() for s in seeds])
    np.testing.assert_allclose(in_tf_data, eager, atol=1e-6)
    assert len({v.tobytes() for v in eager}) == len(eager)  # the seed matters
    assert np.isfinite(eager).all()
