"""Projection heads put on top of a trunk's features.

``DINOHead`` (with its ``WeightNormDense`` last layer) is DINO's head, see below; on patch
tokens (``patches=True``) it is iBOT's head, and ``ClsPatchHeads`` holds DINOv2's separate
heads for class and patch tokens.

``MLPHead`` is VISSL's ``"mlp"`` head (``vissl/models/heads/mlp.py``): a stack of
Linear layers given by ``dims = (in, hidden..., out)``, ReLU between them, an
optional BatchNorm after each hidden Linear (SimCLR v2 / BYOL projectors) and an
optional BatchNorm after the last one (Barlow Twins' non-affine output BN).
Linear layers keep PyTorch's default init, as VISSL does, so training recipes
transfer unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jssl.models.resnet import batch_norm, torch_linear_bias_init, torch_linear_kernel_init


class MLPHead(nn.Module):
    """Dense-(BN)-ReLU-...-Dense(-BN); layers are named ``fc{i}`` and ``bn{i}``."""

    dims: Sequence[int]  # (in, hidden..., out): (2048, 2048, 128) = Dense(2048)-ReLU-Dense(128)
    use_bn: bool = False  # BN after each hidden Dense
    last_bn: bool = False  # BN after the last Dense
    affine_last_bn: bool = False  # learnable scale/bias on that last BN (Barlow Twins: none)
    use_bias: bool = True
    dtype: Any = jnp.float32
    bn_axis_name: str | None = None
    bn_momentum: float = 0.9
    bn_epsilon: float = 1e-5

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        if len(self.dims) < 2:
            raise ValueError(
                f"MLPHead needs dims=(in, ..., out) with >= 2 entries, got {self.dims}"
            )
        if x.shape[-1] != self.dims[0]:
            raise ValueError(
                f"MLPHead expects inputs with {self.dims[0]} features (dims[0]), got shape "
                f"{x.shape}; set the head's first dim to the trunk's feature dim."
            )
        # VISSL also accepts N x C x 1 x 1 features; here that is N x 1 x 1 x C.
        if x.ndim == 4 and x.shape[1:3] == (1, 1):
            x = x.reshape(x.shape[0], -1)
        if x.ndim != 2:
            raise ValueError(f"MLPHead expects (N, C) inputs, got shape {x.shape}")

        norm = batch_norm(
            train=train,
            momentum=self.bn_momentum,
            epsilon=self.bn_epsilon,
            axis_name=self.bn_axis_name,
            dtype=self.dtype,
        )
        x = jnp.asarray(x, self.dtype)
        n_layers = len(self.dims) - 1
        for i, (fan_in, dim) in enumerate(zip(self.dims[:-1], self.dims[1:], strict=True)):
            x = nn.Dense(
                dim,
                use_bias=self.use_bias,
                kernel_init=torch_linear_kernel_init,
                bias_init=torch_linear_bias_init(fan_in),
                dtype=self.dtype,
                param_dtype=jnp.float32,
                name=f"fc{i}",
            )(x)
            if i < n_layers - 1:
                if self.use_bn:
                    x = norm(name=f"bn{i}")(x)
                x = nn.relu(x)
            elif self.last_bn:
                x = norm(
                    use_scale=self.affine_last_bn, use_bias=self.affine_last_bn, name=f"bn{i}"
                )(x)
        return x


class WeightNormDense(nn.Module):
    """A bias-free Dense layer with a weight-normalised kernel, ``g * v / |v|`` per output unit
    (PyTorch ``nn.utils.weight_norm(nn.Linear(...))``, dim 0; Salimans & Kingma 2016).

    ``v`` is (in, out), PyTorch's default Linear init; ``g`` (out,) starts at 1. With
    ``fixed_norm`` there is no ``g``: every output unit's weight vector has norm 1 whatever
    ``v`` becomes (DINO's ``norm_last_layer``: ``weight_g`` frozen at 1). Computed in float32.
    """

    features: int
    fixed_norm: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        v = self.param("v", torch_linear_kernel_init, (x.shape[-1], self.features), jnp.float32)
        kernel = v / jnp.sqrt(jnp.sum(jnp.square(v), axis=0, keepdims=True))
        if not self.fixed_norm:
            kernel = kernel * self.param("g", nn.initializers.ones, (self.features,), jnp.float32)
        return jnp.dot(jnp.asarray(x, jnp.float32), kernel)


class DINOHead(nn.Module):
    """DINO's projection head (Caron et al. 2021, Sec. 3 and App.; VISSL
    vissl/models/heads/dino_head.py, the DINO repository's ``DINOHead``): an MLP of
    ``num_layers`` Dense layers (``fc{i}``) with GELU (optional BN) between them,
    in -> hidden ... -> bottleneck, the bottleneck L2-normalised, then a weight-normalised
    bias-free layer to ``out_dim`` (``last_layer``). The MLP's kernels start N(0, 0.02)
    (``trunc_normal_`` with bounds +-2, i.e. 100 standard deviations), biases 0. Any trunk's
    feature vector works as input (ResNet avgpool, a ViT class token), and so do tokens
    ``(rows, tokens, D)``: every layer acts on the last axis.

    iBOT's head (bytedance/ibot models/head.py ``iBOTHead``): ``patches=True`` marks patch-token
    input. With ``patch_out_dim`` > 0 it gets its own weight-normalised last layer
    (``last_layer2``, iBOT ``shared_head=False``) after the shared MLP; with 0 the patch tokens
    go through ``last_layer`` as the class token does (``shared_head=True``). Initialise with
    both calls so that ``last_layer2`` exists.

    ``last_layer=False`` stops at the normalised bottleneck: the caller applies ``last_layer``
    (:func:`dino_last_layer`; DINO's objective does, jssl.methods.dino)."""

    out_dim: int
    hidden_dim: int = 2048
    bottleneck_dim: int = 256
    num_layers: int = 3
    use_bn: bool = False
    norm_last_layer: bool = True
    dtype: Any = jnp.float32
    bn_axis_name: str | None = None
    patch_out_dim: int = 0  # > 0: patch tokens get their own last layer of this width
    last_layer: bool = True  # False: the normalised bottleneck

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True, patches: bool = False) -> jax.Array:
        if self.num_layers < 1:
            raise ValueError(f"DINOHead needs num_layers >= 1, got {self.num_layers}")
        if x.ndim == 4 and x.shape[1:3] == (1, 1):
            x = x.reshape(x.shape[0], -1)
        dims = [self.hidden_dim] * (self.num_layers - 1) + [self.bottleneck_dim]
        x = jnp.asarray(x, self.dtype)
        for i, dim in enumerate(dims):
            x = nn.Dense(
                dim,
                kernel_init=nn.initializers.normal(stddev=0.02),
                bias_init=nn.initializers.zeros,
                dtype=self.dtype,
                param_dtype=jnp.float32,
                name=f"fc{i}",
            )(x)
            if i < len(dims) - 1:
                if self.use_bn:
                    x = batch_norm(
                        train=train,
                        momentum=0.9,  # PyTorch BatchNorm1d momentum 0.1
                        epsilon=1e-5,
                        axis_name=self.bn_axis_name,
                        dtype=self.dtype,
                    )(name=f"bn{i}")(x)
                x = nn.gelu(x, approximate=False)  # PyTorch nn.GELU: the exact erf form
        x = x.astype(jnp.float32)
        x = x / jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True)), 1e-12)
        if not self.last_layer:
            return x
        if patches and self.patch_out_dim > 0:
            last = WeightNormDense(
                self.patch_out_dim, fixed_norm=self.norm_last_layer, name="last_layer2"
            )
        else:
            last = WeightNormDense(self.out_dim, fixed_norm=self.norm_last_layer, name="last_layer")
        return last(x)


def dino_last_layer(params: Any, x: jax.Array, out_dim: int, fixed_norm: bool) -> jax.Array:
    """``DINOHead``'s ``last_layer`` with its parameters ``params`` (the head's
    ``last_layer`` subtree) on bottleneck rows ``x``: what the head with ``last_layer=False``
    leaves out."""
    layer = WeightNormDense(out_dim, fixed_norm=fixed_norm)
    return layer.apply({"params": params}, x)


class ClsPatchHeads(nn.Module):
    """Separate heads for class and patch tokens (DINOv2 ``ibot.separate_head``:
    dinov2/train/ssl_meta_arch.py ``dino_head`` and ``ibot_head``): ``cls`` on class tokens,
    ``patch`` on patch tokens (``patches=True``), parameters under ``cls/`` and ``patch/``.
    Initialise with both calls."""

    cls: nn.Module
    patch: nn.Module

    def __call__(self, x: jax.Array, train: bool = True, patches: bool = False) -> jax.Array:
        return (self.patch if patches else self.cls)(x, train=train)
