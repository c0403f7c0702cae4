"""Helpers the losses share: L2 normalisation, sums and maxima over the data axis, crop
stacking and standardisation."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def l2_normalize(x: jax.Array, axis: int = -1, eps: float = 1e-12) -> jax.Array:
    """x / max(||x||, eps), as torch.nn.functional.normalize (the references use it)."""
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True))
    return x / jnp.maximum(norm, eps)


def _stack_crops(crops: Sequence[jax.Array] | jax.Array, name: str) -> jax.Array:
    if isinstance(crops, (list, tuple)):
        shapes = {tuple(c.shape) for c in crops}
        if len(shapes) > 1:
            raise ValueError(
                f"The {name} of all crops must have one shape (images x dim), got "
                f"{sorted(shapes)}: every crop needs the same images, in the same order."
            )
        return jnp.stack(crops)
    if crops.ndim != 3:
        raise ValueError(f"{name} must be (crops, images, dim), got shape {crops.shape}.")
    return crops


def _precision(use_double_precision: bool) -> jnp.dtype:
    if not use_double_precision:
        return jnp.float32
    if not jax.config.read("jax_enable_x64"):
        raise ValueError(
            "use_double_precision=True needs float64 in JAX, which is off: enable it at start-up "
            "(jax.config.update('jax_enable_x64', True) or JAX_ENABLE_X64=1), or set "
            "use_double_precision=False (the Sinkhorn iteration runs in the log domain, so "
            "float32 neither overflows nor underflows there)."
        )
    return jnp.float64


def _psum(x: jax.Array, axis_name: str | None) -> jax.Array:
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def _pmax(x: jax.Array, axis_name: str | None) -> jax.Array:
    return x if axis_name is None else jax.lax.pmax(x, axis_name)


def _global_logsumexp(x: jax.Array, axis: int | None, axis_name: str | None) -> jax.Array:
    """log sum exp of x over ``axis`` (None: all) and over every replica, keeping dims."""
    top = _pmax(jnp.max(x, axis=axis, keepdims=True), axis_name)
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    total = _psum(jnp.sum(jnp.exp(x - top), axis=axis, keepdims=True), axis_name)
    return top + jnp.log(total)


def _num_replicas(axis_name: str | None) -> int:
    return 1 if axis_name is None else jax.lax.psum(1, axis_name)


def _standardize(z: jax.Array, eps: float, axis_name: str | None) -> jax.Array:
    """Per feature, over the rows of every replica: (z - mean) / sqrt(biased var + eps)."""
    total = z.shape[0] * _num_replicas(axis_name)
    centred = z - _psum(jnp.sum(z, axis=0), axis_name) / total
    var = _psum(jnp.sum(jnp.square(centred), axis=0), axis_name) / total
    return centred * jax.lax.rsqrt(var + eps)


def _cosine(a: jax.Array, b: jax.Array) -> jax.Array:
    """Row-wise cosine similarity of (..., d) arrays, in float32."""
    return jnp.sum(l2_normalize(a.astype(jnp.float32)) * l2_normalize(b.astype(jnp.float32)), -1)


def _two_views(x: Sequence[jax.Array] | jax.Array, name: str) -> jax.Array:
    x = _stack_crops(x, name)
    if x.shape[0] != 2:
        raise ValueError(
            f"{name} must hold exactly two views of each image, (2, n, d); got shape {x.shape}."
        )
    return x


def _embedding_std(targets: jax.Array, axis_name: str | None) -> jax.Array:
    """SimSiam's collapse monitor (Chen & He 2021, Sec. 4.1, Fig. 2): the per-channel standard
    deviation of the L2-normalised outputs over the global batch, averaged over channels. About
    1 / sqrt(d) for spread-out outputs, 0 when every image maps to one vector."""
    z = l2_normalize(targets.astype(jnp.float32)).reshape(-1, targets.shape[-1])
    count = _psum(jnp.asarray(z.shape[0], jnp.float32), axis_name)
    mean = _psum(jnp.sum(z, axis=0), axis_name) / count
    var = _psum(jnp.sum(jnp.square(z - mean), axis=0), axis_name) / count
    return jnp.mean(jnp.sqrt(var))
