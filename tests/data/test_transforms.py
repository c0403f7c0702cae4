"""SSL transforms: pure functions of (image, seed), identical eagerly and inside tf.data."""

import numpy as np
import pytest
import tensorflow as tf

from jssl.data import crops, default_config, transforms

SIZE = 16


def _image(h=24, w=20):
    rng = np.random.default_rng(0)
    return tf.constant(rng.uniform(0, 1, (h, w, 3)).astype(np.float32))


def _in_tf_data(fn, image, seed):
    ds = tf.data.Dataset.from_tensors((image, seed)).map(fn)
    return next(iter(ds)).numpy()


AUG = default_config().augment
AUG_ALL_ON = default_config().augment
AUG_ALL_ON.update(
    dict(color_jitter_prob=(1.0,), blur_prob=(1.0,), solarize_prob=(1.0,), grayscale_prob=(0.5,))
)
ALL_ON = crops.CropGroup(2, SIZE, (0.2, 1.0), 0.5, 1.0, 0.5, 1.0, 1.0)

CASES = {
    "crop": lambda x, s: transforms.random_resized_crop(x, s, SIZE, (0.2, 1.0)),
    "flip": lambda x, s: transforms.random_flip(x, s, 0.5),
    "color": lambda x, s: transforms.color_distortion(x, s, 1.0, 1.0, 0.2),
    "blur": lambda x, s: transforms.gaussian_blur(x, s, (0.1, 2.0)),
    "view": lambda x, s: transforms.ssl_view(x, s, ALL_ON, AUG_ALL_ON),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_equals_tf_data_and_seed_matters(name):
    fn, image = CASES[name], _image()
    seed = tf.constant([3, 7], tf.int64)
    eager = fn(image, seed).numpy()
    np.testing.assert_allclose(eager, _in_tf_data(fn, image, seed), atol=1e-6)
    np.testing.assert_array_equal(eager, fn(image, seed).numpy())
    outputs = [fn(image, tf.constant([3, s], tf.int64)).numpy() for s in range(8, 14)]
    assert any(not np.allclose(eager, o) for o in outputs), "the seed should change the output"
    assert np.isfinite(eager).all()


def test_crop_shape_and_range():
    out = transforms.random_resized_crop(_image(40, 30), tf.constant([1, 2]), SIZE).numpy()
    assert out.shape == (SIZE, SIZE, 3) and out.min() >= 0 and out.max() <= 1


def test_grayscale_and_solarize():
    image = _image()
    gray = transforms.color_distortion(image, tf.constant([0, 1]), 0.5, 0.0, 1.0).numpy()
    np.testing.assert_allclose(gray[..., 0], gray[..., 2], atol=1e-6)
    solar = transforms.solarize(tf.constant([[[0.2, 0.6, 1.0]]])).numpy()
    np.testing.assert_allclose(solar, [[[0.2, 0.4, 0.0]]], atol=1e-6)


def test_color_jitter_zero_strength_is_identity():
    image = _image()
    out = transforms.color_jitter(image, tf.constant([0, 5]), 0.0, 0.0, 0.0, 0.0).numpy()
    np.testing.assert_allclose(out, image.numpy(), atol=1e-5)


def test_blur_keeps_mean_and_smooths():
    image = _image(SIZE, SIZE)
    out = transforms.gaussian_blur(image, tf.constant([0, 1]), (2.0, 2.0)).numpy()
    assert out.std() < image.numpy().std()
    assert abs(out.mean() - image.numpy().mean()) < 0.02


def test_normalize_and_eval_image():
    mean, std = AUG.mean, AUG.std
    big = transforms.eval_image(_image(48, 64), SIZE, mean, std)
    small = transforms.eval_image(_image(SIZE, SIZE), SIZE, mean, std).numpy()
    assert big.shape == (SIZE, SIZE, 3)
    expected = (_image(SIZE, SIZE).numpy() - np.array(mean)) / np.array(std)
    np.testing.assert_allclose(small, expected, atol=1e-4)


def test_a_small_image_keeps_its_aspect_ratio():
    """A non-square image whose shorter side is at most the size: the shorter side resized to
    the size and the centre cropped (not squashed to a square)."""
    image = _image(12, 30)  # resized to 16 x 40, then columns 12..27 kept
    out = transforms.eval_image(image, SIZE, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)).numpy()
    full = tf.image.resize(image, (16, 40), "bilinear", antialias=True).numpy()
    np.testing.assert_allclose(out, full[:, 12:28].clip(0, 1), atol=1e-6)


def test_example_seed_depends_on_all_three():
    seeds = {
        tuple(transforms.example_seed(s, e, tf.constant(i)).numpy())
        for s, e, i in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1)]
    }
    assert len(seeds) == 4
