"""Crop groups: config parsing and its errors, per-group augmentation, the multi-resolution
forward of crops, the augmentation grid per group."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from configs import base, recipes
from jssl import data, models
from jssl.data import crops, transforms
from jssl.methods import common
from jssl.training import summaries


def _data_config(**augment):
    config = data.default_config()
    config.image_size = 16
    config.augment.update(augment)
    return config


def test_one_value_for_every_group_or_one_per_group():
    config = _data_config(
        num_crops=(2, 6),
        crop_sizes=(16, 8),
        crop_scale=((0.14, 1.0), (0.05, 0.14)),
        blur_prob=(1.0, 0.1),
    )
    big, small = crops.crop_groups(config)
    assert (big.num_crops, big.size, big.scale, big.blur_prob) == (2, 16, (0.14, 1.0), 1.0)
    assert (small.num_crops, small.size, small.scale, small.blur_prob) == (6, 8, (0.05, 0.14), 0.1)
    assert big.flip_prob == small.flip_prob == 0.5  # one value: every group
    assert crops.total_crops(config) == 8
    (only,) = crops.crop_groups(_data_config())
    assert (only.num_crops, only.size, only.scale) == (2, 16, (0.2, 1.0))  # image_size


@pytest.mark.parametrize(
    "augment, message",
    [
        (dict(num_crops=()), "num_crops=()"),
        (dict(num_crops=(2, 0)), "num_crops=(2, 0)"),
        (dict(num_crops=(2, 6), crop_sizes=(16, 8, 4)), "crop_sizes=(16, 8, 4) has 3 values"),
        (dict(num_crops=(2, 6), blur_prob=(1.0, 0.5, 0.1)), "blur_prob=(1.0, 0.5, 0.1)"),
        (dict(solarize_prob=(1.5,)), "solarize_prob"),
        (dict(num_crops=(2, 6), crop_scale=((0.1, 1.0),) * 3), "crop_scale"),
        (dict(crop_scale=(0.5, 0.2)), "0 < min <= max <= 1"),
    ],
)
def test_bad_groups_name_the_field(augment, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        crops.crop_groups(_data_config(**augment))


def test_the_trainer_refuses_bad_groups_at_start_up():
    from configs import moco
    from jssl.engines import train

    config = moco.get_config("test")
    config.data.augment.blur_prob = (1.0, 0.1)  # two values, one group
    with pytest.raises(ValueError, match="data.augment.blur_prob"):
        train.validate(config)


def test_each_group_has_its_size_and_probabilities():
    # Group 0: never grey; group 1: always grey (channels equal once de-normalised).
    config = _data_config(
        num_crops=(1, 2),
        crop_sizes=(16, 8),
        color_jitter_prob=(0.0,),
        grayscale_prob=(0.0, 1.0),
        blur_prob=(0.0,),
    )
    rs = np.random.default_rng(0)
    image = tf.constant(rs.uniform(0, 1, (24, 20, 3)).astype(np.float32))
    seed = transforms.example_seed(0, 0, tf.constant(5))
    out = transforms.make_crops(image, seed, crops.crop_groups(config), config.augment)
    assert [tuple(g.shape) for g in out] == [(1, 16, 16, 3), (2, 8, 8, 3)]
    mean, std = np.array(config.augment.mean), np.array(config.augment.std)
    colour, grey = out[0].numpy() * std + mean, out[1].numpy() * std + mean
    np.testing.assert_allclose(grey[..., 0], grey[..., 2], atol=1e-5)
    assert np.abs(colour[..., 0] - colour[..., 2]).max() > 0.05
    again = transforms.make_crops(image, seed, crops.crop_groups(config), config.augment)
    for a, b in zip(out, again, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_multi_resolution_forward_is_one_trunk_pass_per_size():
    config = base.get_base_config()
    recipes.demo_data_and_model(config)
    recipes.tiny(config)
    model = models.build_model(config.model)
    rs = np.random.RandomState(0)
    big = jnp.asarray(rs.normal(size=(3, 2, 16, 16, 3)), jnp.float32)
    small = jnp.asarray(rs.normal(size=(3, 4, 8, 8, 3)), jnp.float32)
    # Jitted: op by op, the seven ResNet forwards took 22 s of the suite.
    variables = jax.jit(functools.partial(model.init, train=False))(jax.random.key(0), big[:, 0])
    taps, _ = jax.jit(functools.partial(common.forward_crops, model, train=False))(
        variables["params"], variables["batch_stats"], (big, small)
    )
    apply = jax.jit(lambda x: model.apply(variables, x, train=False)["head"])
    assert taps["head"].shape == (18, 16) and "res5" not in taps  # spatial maps differ in size
    # Crop-major rows: row c * n + i is crop c of image i; eval mode is per example.
    flat = [big[:, 0], big[:, 1], *[small[:, j] for j in range(4)]]
    for c, x in enumerate(flat):
        expected = apply(x)
        np.testing.assert_allclose(taps["head"][c * 3 : (c + 1) * 3], expected, atol=1e-5)
    views = common.views({"crops": (big, small)})
    assert len(views) == 6 and views[2].shape == (3, 8, 8, 3)
    np.testing.assert_array_equal(views[3], small[:, 1])


class _Writer:
    def __init__(self):
        self.images = {}

    def write_images(self, step, images):
        self.images.update(images)


def test_the_augmentation_grid_shows_every_group():
    writer = _Writer()
    group0 = np.zeros((4, 2, 16, 16, 3), np.float32)
    group1 = np.zeros((4, 6, 8, 8, 3), np.float32)
    summaries.write_views(writer, (group0, group1), data.default_config().augment)
    assert {k: v.shape for k, v in writer.images.items()} == {
        "augmented_crops/group0_2x16px": (1, 4 * 16, 2 * 16, 3),
        "augmented_crops/group1_6x8px": (1, 4 * 8, 6 * 8, 3),
    }
