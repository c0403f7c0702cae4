"""The ViT's stochastic depth: whole examples dropped, each row's mask from its own key (the same
in any batch, so a run is the same on any number of devices and in any micro-batch), and the
ramp over the blocks or DINOv2's uniform rate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jssl import models
from jssl.models import vit


def _model_config():
    config = models.default_config()
    config.trunk, config.patch_size, config.image_size = "vit_tiny", 16, 224
    config.head_dims = ()
    return config


def test_drop_path_drops_whole_examples():
    layer = vit.DropPath(0.5)
    x = jnp.ones((64, 3, 4))
    keys = jax.random.split(jax.random.key(0), 64)
    y = layer.apply({}, x, train=True, keys=keys)
    per_example = np.asarray(y).reshape(64, -1)
    assert set(np.unique(per_example)) == {0.0, 2.0}  # kept examples scaled by 1 / (1 - 0.5)
    assert np.all(per_example.min(1) == per_example.max(1))
    assert 16 < int((per_example[:, 0] == 0).sum()) < 48
    # Row i's mask is its key's: the same key in another row, or another batch, gives it again.
    again = layer.apply({}, x[:8], train=True, keys=keys[::8])
    np.testing.assert_array_equal(np.asarray(again)[:, 0, 0], per_example[::8, 0])
    np.testing.assert_array_equal(layer.apply({}, x, train=False), x)
    with pytest.raises(ValueError, match="needs one key per row"):
        layer.apply({}, x, train=True)


# Slow tier: CI holds the same at the step's level (test_parallel.py's dino_vit row on 1 and 4
# devices, its simclr_accum row over micro-batches, both with drop path).
@pytest.mark.slow
def test_drop_path_masks_follow_the_example_not_the_batch():
    """Stochastic depth keyed by (step, crop, example index): an example's features are the
    same in any batch it is part of (another device count, another micro-batch)."""
    from jssl.methods import common

    config = _model_config()
    config.vit_depth, config.drop_path_rate = 3, 0.5
    model = models.build_model(config)
    images = jnp.asarray(np.random.default_rng(0).normal(size=(6, 32, 32, 3)), jnp.float32)
    variables = model.init(jax.random.key(0), images, train=False)
    index, step_key = jnp.arange(10, 16), jax.random.key(3)
    crops = [images[:, None]]

    def features(rows, key=step_key):
        out, _ = common.forward_crops(
            model, variables["params"], {}, [c[rows] for c in crops], True, key, index[rows]
        )
        return np.asarray(out["avgpool"])

    whole = features(np.arange(6))
    np.testing.assert_allclose(features(np.arange(3, 6)), whole[3:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(features(np.array([5, 0])), whole[[5, 0]], rtol=1e-5, atol=1e-5)
    assert not np.allclose(features(np.arange(6), jax.random.key(4)), whole)
    eval_mode = model.apply(variables, images, train=False)["avgpool"]
    assert not np.allclose(whole, eval_mode)  # the masks did drop something
    with pytest.raises(ValueError, match="stochastic depth"):
        common.forward_crops(model, variables["params"], {}, crops, True)


def test_uniform_drop_path_drops_the_first_block_too():
    """The ramp gives block 0 rate 0 (a 1-block trunk never drops); ``drop_path_uniform``
    (DINOv2) puts every block at the rate."""
    images = jnp.asarray(np.random.default_rng(0).normal(size=(16, 16, 16, 3)), jnp.float32)
    keys = jax.random.split(jax.random.key(1), 16)
    outs = {}
    for uniform in (False, True):
        trunk = vit.VisionTransformer(
            embed_dim=16, depth=1, num_heads=2, patch_size=4, image_size=16,
            drop_path_rate=0.5, drop_path_uniform=uniform,
        )  # fmt: skip
        variables = trunk.init(jax.random.key(0), images, train=False)
        train = trunk.apply(variables, images, train=True, row_keys=keys)["avgpool"]
        evaluated = trunk.apply(variables, images, train=False)["avgpool"]
        outs[uniform] = (np.asarray(train), np.asarray(evaluated))
    np.testing.assert_allclose(*outs[False], rtol=1e-6, atol=1e-6)
    assert not np.allclose(*outs[True])
