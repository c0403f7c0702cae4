"""MAE's pieces beside the ViT encoder (He et al. 2022, "Masked Autoencoders Are Scalable Vision
Learners"; facebookresearch/mae ``models_mae.py``, ``util/pos_embed.py``): images cut into
patch vectors and back, the per-example random masking, the fixed 2-D sin-cos position
embeddings, and the light decoder that rebuilds every patch from the visible ones.

Layouts (NHWC, as every jssl model): a patch vector lists its pixels row by row, each pixel's
channels last, which is MAE's ``patchify`` order (``nchpwq -> nhwpqc``); patches are numbered
row-major over the grid, as the ViT's ``keep=`` indices and its position embeddings. The
decoder's blocks are jssl's ViT blocks (timm's init; its ``embed`` and ``pred`` projections
Xavier-uniform and its mask token a normal of std 0.02, as MAE's), and its position
embeddings a constant for the input's grid: docs/methods.md#mae has the differences.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jssl.models.vit import Block

_xavier = nn.initializers.xavier_uniform()


def patchify(images: jax.Array, patch_size: int) -> jax.Array:
    """(B, H, W, C) images -> (B, (H/p) * (W/p), p * p * C) patch vectors (MAE ``patchify``)."""
    b, height, width, channels = images.shape
    p = patch_size
    if height % p or width % p:
        raise ValueError(f"{height}x{width} px images do not split into {p} px patches.")
    h, w = height // p, width // p
    x = images.reshape(b, h, p, w, p, channels).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h * w, p * p * channels)


def unpatchify(patches: jax.Array, patch_size: int, grid: tuple[int, int]) -> jax.Array:
    """The inverse of :func:`patchify`: (B, h * w, p * p * C) -> (B, h * p, w * p, C) for the
    patch ``grid`` (h, w)."""
    b, count, dim = patches.shape
    h, w = grid
    p = patch_size
    if count != h * w or dim % (p * p):
        raise ValueError(f"{count} patches of {dim} values are not a {h}x{w} grid of {p} px ones.")
    channels = dim // (p * p)
    x = patches.reshape(b, h, w, p, p, channels).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h * p, w * p, channels)


def sincos_pos_embed(grid: tuple[int, int], dim: int, cls_token: bool = True) -> jax.Array:
    """MAE's fixed 2-D sin-cos position embeddings (``util/pos_embed.py``
    ``get_2d_sincos_pos_embed``) for a (h, w) patch grid, row-major: (h * w, dim), with a
    leading zero row for the class token when ``cls_token``.

    The patch in row i and column j gets ``[sin(j w), cos(j w), sin(i w), cos(i w)]`` with
    ``w_k = 1 / 10000**(k / (dim / 4))``, k < dim / 4: MAE's meshgrid puts the column first
    (jssl's encoder ``sincos``, MoCo v3's layout, puts the row first)."""
    if dim % 4:
        raise ValueError(f"2-D sin-cos position embeddings need a width divisible by 4, not {dim}")
    h, w = grid
    quarter = dim // 4
    omega = 1.0 / 10000.0 ** (jnp.arange(quarter, dtype=jnp.float32) / quarter)
    rows, cols = jnp.meshgrid(jnp.arange(h), jnp.arange(w), indexing="ij")
    col = cols.reshape(-1, 1).astype(jnp.float32) * omega
    row = rows.reshape(-1, 1).astype(jnp.float32) * omega
    table = jnp.concatenate([jnp.sin(col), jnp.cos(col), jnp.sin(row), jnp.cos(row)], axis=1)
    if cls_token:
        table = jnp.concatenate([jnp.zeros((1, dim), jnp.float32), table])
    return table


def num_visible(num_patches: int, mask_ratio: float) -> int:
    """How many patches the encoder sees: MAE's ``len_keep = int(L * (1 - mask_ratio))``."""
    return int(num_patches * (1 - mask_ratio))


class Masking(NamedTuple):
    """One random masking of each row's patches.

    keep: (B, k) int32, the visible patches' grid indices in the order the encoder sees them.
    restore: (B, L) int32, where each grid position sits in the encoder's order followed by
      the masked ones (MAE ``ids_restore``): the decoder's unshuffle.
    mask: (B, L) bool, True where a patch is masked (MAE's ``mask`` of 1s).
    """

    keep: jax.Array
    restore: jax.Array
    mask: jax.Array


def random_masking(keys: jax.Array, num_patches: int, mask_ratio: float) -> Masking:
    """MAE's ``random_masking``, row i drawn from ``keys[i]`` alone: uniform noise per patch,
    the patches of the :func:`num_visible` smallest values kept. A row's masking thus
    depends on its key only (the example's, ``jssl.methods.common.example_keys``), not on the
    batch it sits in, its device or the device count."""
    visible = num_visible(num_patches, mask_ratio)
    noise = jax.vmap(lambda key: jax.random.uniform(key, (num_patches,)))(keys)
    shuffle = jnp.argsort(noise, axis=1).astype(jnp.int32)
    restore = jnp.argsort(shuffle, axis=1).astype(jnp.int32)
    return Masking(keep=shuffle[:, :visible], restore=restore, mask=restore >= visible)


class MAEDecoder(nn.Module):
    """MAE's decoder (``forward_decoder``): the encoder's normed output (class token, then the
    visible patches in ``keep`` order) projected to the decoder's width, a learned mask token
    appended for every masked patch, the sequence put back in grid order (``restore``), fixed
    sin-cos position embeddings added, ``depth`` pre-norm blocks, a LayerNorm and a linear
    prediction of each patch's ``p * p * channels`` values; the class token's row is dropped.

    Submodules ``embed``, ``blocks_<i>``, ``norm``, ``pred`` and the parameter ``mask_token``
    (MAE's ``decoder_embed``, ``decoder_blocks``, ``decoder_norm``, ``decoder_pred``): ``norm``
    and the blocks' ``norm1``/``norm2`` are what the optimizer's weight-decay mask treats as
    normalisation layers.
    """

    embed_dim: int = 512
    depth: int = 8
    num_heads: int = 16
    patch_size: int = 16
    channels: int = 3
    mlp_dim: int = 0  # 0: 4 x embed_dim (MAE's mlp_ratio 4)
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, latent: jax.Array, restore: jax.Array, grid: tuple[int, int], train: bool = True
    ) -> jax.Array:
        b, tokens, _ = latent.shape
        num_patches = restore.shape[1]
        if grid[0] * grid[1] != num_patches:
            raise ValueError(f"restore covers {num_patches} patches, not a {grid} grid.")
        dense = lambda n, name: nn.Dense(  # noqa: E731
            n, kernel_init=_xavier, dtype=self.dtype, param_dtype=jnp.float32, name=name
        )
        x = dense(self.embed_dim, "embed")(latent)
        token = self.param(
            "mask_token", nn.initializers.normal(0.02), (1, 1, self.embed_dim), jnp.float32
        )
        masked = jnp.broadcast_to(
            token.astype(x.dtype), (b, num_patches + 1 - tokens, self.embed_dim)
        )
        patches = jnp.concatenate([x[:, 1:], masked], axis=1)
        patches = jnp.take_along_axis(patches, restore[..., None], axis=1)
        x = jnp.concatenate([x[:, :1], patches], axis=1)
        x = x + sincos_pos_embed(grid, self.embed_dim).astype(x.dtype)[None]
        for i in range(self.depth):
            x = Block(
                num_heads=self.num_heads, mlp_dim=self.mlp_dim, dtype=self.dtype, name=f"blocks_{i}"
            )(x, train)
        x = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, param_dtype=jnp.float32, name="norm")(x)
        out = dense(self.patch_size**2 * self.channels, "pred")(x)
        return out[:, 1:]
