"""Projection heads put on top of a trunk's features.

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
