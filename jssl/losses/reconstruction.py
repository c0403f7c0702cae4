"""Reconstruction: MAE's pixel loss (He et al. 2022, Sec. 3 "Reconstruction target";
facebookresearch/mae ``models_mae.py`` ``forward_loss``), the mean squared error between the
predicted and the true pixels of the masked patches only, optionally on per-patch normalised
pixels (``norm_pix_loss``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def normalize_patches(patches: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Each patch vector (last axis) minus its mean, over ``sqrt(var + eps)``: MAE's
    ``norm_pix_loss`` target. The variance is torch's ``Tensor.var`` default, the unbiased
    one (divided by the patch's value count minus one), as the reference computes it."""
    patches = patches.astype(jnp.float32)
    mean = jnp.mean(patches, axis=-1, keepdims=True)
    var = jnp.var(patches, axis=-1, keepdims=True, ddof=1)
    return (patches - mean) / jnp.sqrt(var + eps)


def masked_patch_mse(
    pred: jax.Array,
    target: jax.Array,
    mask: jax.Array,
    norm_pix: bool = True,
    eps: float = 1e-6,
) -> jax.Array:
    """MAE's loss per example: (..., L, D) predicted and true patch vectors and the (..., L)
    mask (1 where a patch was masked) give (...,), the mean over the masked patches of each
    patch's mean squared error. With ``norm_pix`` the targets are per-patch normalised
    (:func:`normalize_patches`); the target gets no gradient.

    MAE averages over every masked patch of the batch, ``(loss * mask).sum() / mask.sum()``;
    every image has the same number of masked patches, so the mean of these per-example values
    is that figure exactly.
    """
    target = jax.lax.stop_gradient(target.astype(jnp.float32))
    if norm_pix:
        target = normalize_patches(target, eps)
    mask = mask.astype(jnp.float32)
    per_patch = jnp.mean(jnp.square(pred.astype(jnp.float32) - target), axis=-1)
    return jnp.sum(per_patch * mask, axis=-1) / jnp.sum(mask, axis=-1)
