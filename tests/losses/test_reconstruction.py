"""MAE's pixel loss (jssl.losses.reconstruction) on hand-computed cases: the per-patch
normalised target, the mean over masked patches only, and no gradient to the visible ones."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jssl import losses


def test_normalize_patches_uses_the_unbiased_variance():
    # mean 2.5; torch's Tensor.var: ((1.5^2 + 0.5^2) * 2) / (4 - 1) = 5 / 3.
    patch = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    scale = math.sqrt(5 / 3 + 1e-6)
    want = [[-1.5 / scale, -0.5 / scale, 0.5 / scale, 1.5 / scale]]
    np.testing.assert_allclose(losses.normalize_patches(patch), want, rtol=1e-6)
    # A flat patch becomes zeros, not NaN (the eps).
    np.testing.assert_array_equal(losses.normalize_patches(jnp.full((1, 4), 7.0)), 0.0)


def _case():
    """One image of three 2-value patches; patches 0 and 2 masked."""
    target = jnp.array([[[1.0, 3.0], [5.0, 5.0], [0.0, 4.0]]])
    pred = jnp.array([[[0.0, 0.0], [9.0, -9.0], [1.0, 1.0]]])
    mask = jnp.array([[1.0, 0.0, 1.0]])
    return pred, target, mask


def test_masked_patch_mse_by_hand():
    pred, target, mask = _case()
    # Raw pixels: patch 0 ((1 + 9) / 2 = 5), patch 2 ((1 + 9) / 2 = 5); patch 1 not counted.
    got = losses.masked_patch_mse(pred, target, mask, norm_pix=False)
    np.testing.assert_allclose(got, [5.0], rtol=1e-6)
    # Normalised pixels: patch 0 (1, 3) -> mean 2, unbiased var 2 -> (-1, 1) / sqrt(2 + eps);
    # patch 2 (0, 4) -> mean 2, var 8 -> (-1, 1) * 2 / sqrt(8 + eps).
    a, b = 1 / math.sqrt(2 + 1e-6), 2 / math.sqrt(8 + 1e-6)
    patch0 = ((0 + a) ** 2 + (0 - a) ** 2) / 2
    patch2 = ((1 + b) ** 2 + (1 - b) ** 2) / 2
    got = losses.masked_patch_mse(pred, target, mask, norm_pix=True)
    np.testing.assert_allclose(got, [(patch0 + patch2) / 2], rtol=1e-6)


@pytest.mark.parametrize("norm_pix", [False, True])
def test_only_masked_patches_count(norm_pix):
    pred, target, mask = _case()
    changed = pred.at[0, 1].set(jnp.array([100.0, 3.0]))  # the visible patch
    np.testing.assert_allclose(
        losses.masked_patch_mse(changed, target, mask, norm_pix),
        losses.masked_patch_mse(pred, target, mask, norm_pix),
        rtol=1e-6,
    )
    grad_pred, grad_target = jax.grad(
        lambda p, t: losses.masked_patch_mse(p, t, mask, norm_pix)[0], argnums=(0, 1)
    )(pred, target)
    assert np.abs(grad_pred[0, 1]).max() == 0 and np.abs(grad_pred[0, 0]).max() > 0
    assert np.abs(grad_target).max() == 0  # the target is the data


def test_mean_over_examples_is_maes_mean_over_masked_patches():
    """Every image masks the same number of patches, so the batch mean of the per-example
    losses is MAE's ``(loss * mask).sum() / mask.sum()`` over the whole batch."""
    rng = np.random.default_rng(0)
    pred = jnp.asarray(rng.normal(size=(2, 3, 5, 6)), jnp.float32)  # (crops, n, L, D)
    target = jnp.asarray(rng.normal(size=(2, 3, 5, 6)), jnp.float32)
    mask = np.zeros((2, 3, 5), np.float32)
    for c in range(2):
        for i in range(3):
            mask[c, i, rng.permutation(5)[:3]] = 1.0
    per_example = losses.masked_patch_mse(pred, target, mask, norm_pix=False)
    assert per_example.shape == (2, 3)
    per_patch = np.mean((np.asarray(pred) - np.asarray(target)) ** 2, axis=-1)
    np.testing.assert_allclose(
        np.mean(per_example), np.sum(per_patch * mask) / np.sum(mask), rtol=1e-6
    )
