"""Vision Transformer trunks (Dosovitskiy et al. 2021; the DeiT / DINO sizes, Touvron et al.
2021, Caron et al. 2021), and what the masked-image methods need as options of the one trunk.

The block layout is timm's ``VisionTransformer`` (``timm/models/vision_transformer.py``), which
DINO's ``vision_transformer.py`` and MoCo v3's ``vits.py`` also follow, and submodule names
mirror timm's state-dict keys so published weights map by name (``jssl.models.vit_import``).
Other input sizes resample the position embeddings as timm does (:func:`resample_pos_embed`).
Options: a mask token (``mask``: iBOT, DINOv2), a subset of patches (``keep``: MAE, MSN),
registers (Darcet et al. 2024), LayerScale and SwiGLU (DINOv2), stochastic depth keyed per
row (``row_keys``). Attention is ``jax.nn.dot_product_attention``, XLA's or cuDNN's; for cuDNN,
which refuses odd sequence lengths in training, the tokens are padded to a multiple of 8 and
the padded keys masked, with the unpadded outputs and gradients
(tests/models/test_vit_attention.py). The taps: :class:`VisionTransformer`,
docs/evaluation.md#taps; the contract: docs/design.md#extension-points.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jssl.models import remat as remat_lib

# name -> (embed dim, depth, heads): DeiT's tiny / small / base, the sizes DINO and MoCo v3 use.
# (width, blocks, heads, MLP width) of timm's configurations of the same names; ViT-g/14 is
# timm's vit_giant_patch14 (Zhai et al. 2022, "Scaling Vision Transformers": MLP 6144);
# vit_giant2 is DINOv2's ViT-g/14 (vit_giant2 in dinov2/models/vision_transformer.py: width
# 1536, 24 heads, with model.ffn="swiglu" a 4096-wide SwiGLU).
SIZES: dict[str, tuple[int, int, int, int]] = {
    "vit_tiny": (192, 12, 3, 768),
    "vit_small": (384, 12, 6, 1536),
    "vit_base": (768, 12, 12, 3072),
    "vit_large": (1024, 24, 16, 4096),
    "vit_huge": (1280, 32, 16, 5120),
    "vit_giant": (1408, 40, 16, 6144),
    "vit_giant2": (1536, 40, 24, 6144),
}
PATCH_SIZES = (8, 14, 16, 32)

# timm / DINO initialise Linear weights, the class token and the position embeddings with a
# normal of std 0.02 truncated at +-2 (absolute: 100 std), biases with zeros.
_trunc_normal = nn.initializers.truncated_normal(stddev=0.02, lower=-100.0, upper=100.0)


def _torch_conv_init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32):
    """PyTorch Conv2d's default weight init (timm leaves the patch projection at it):
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = kh * kw * in_channels."""
    bound = 1.0 / jnp.sqrt(shape[0] * shape[1] * shape[2])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def _torch_conv_bias_init(fan_in: int):
    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32):
        bound = 1.0 / jnp.sqrt(fan_in)
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def resample_pos_embed(pos: jax.Array, grid: tuple[int, int]) -> jax.Array:
    """(1, h0 * w0, D) patch position embeddings on a square grid -> (1, h * w, D) for ``grid``
    = (h, w): bicubic (Keys, a = -0.5) with antialiasing when shrinking, which is
    ``torch.nn.functional.interpolate(mode="bicubic", antialias=True)`` as timm calls it, so
    imported weights give timm's features (DINO's ``interpolate_pos_encoding`` resizes by a
    scale factor without antialiasing, slightly different when shrinking)."""
    n, dim = pos.shape[1], pos.shape[2]
    side = int(round(n**0.5))
    if side * side != n:
        raise ValueError(f"{n} position embeddings do not form a square grid")
    if (side, side) == tuple(grid):
        return pos
    image = pos.reshape(side, side, dim).astype(jnp.float32)
    resized = jax.image.resize(image, (*grid, dim), method="cubic", antialias=True)
    return resized.reshape(1, grid[0] * grid[1], dim).astype(pos.dtype)


def sincos_pos_embed(grid: int, dim: int) -> jax.Array:
    """MoCo v3's fixed 2-D sin-cos position embeddings (vits.py
    ``build_2d_sincos_position_embedding``, temperature 10000), (1, 1 + grid**2, dim) with a
    zero embedding for the class token: a quarter of the channels each for sin and cos of the
    first grid coordinate, then of the second, at frequencies 1 / 10000**(k / (dim / 4))."""
    if dim % 4:
        raise ValueError(f"2-D sin-cos position embeddings need a width divisible by 4, not {dim}")
    quarter = dim // 4
    omega = 1.0 / 10000.0 ** (jnp.arange(quarter, dtype=jnp.float32) / quarter)
    first, second = jnp.meshgrid(jnp.arange(grid), jnp.arange(grid), indexing="ij")
    a = first.reshape(-1, 1).astype(jnp.float32) * omega
    b = second.reshape(-1, 1).astype(jnp.float32) * omega
    patches = jnp.concatenate([jnp.sin(a), jnp.cos(a), jnp.sin(b), jnp.cos(b)], axis=1)
    return jnp.concatenate([jnp.zeros((1, dim)), patches])[None]


class DropPath(nn.Module):
    """Stochastic depth (Huang et al. 2016): drops the residual branch of whole examples with
    probability ``rate`` and scales the kept ones by 1 / (1 - rate); identity when not
    training. Row i's mask is drawn from ``keys[i]`` (one key per row, from
    ``jssl.methods.common.drop_path_keys``: the example's index, its crop and the step), so it
    is the same on any number of devices and in any micro-batch."""

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, keys: jax.Array | None = None) -> jax.Array:
        if not train or self.rate == 0.0:
            return x
        if keys is None:
            raise ValueError(
                f"DropPath({self.rate}) in training needs one key per row (row_keys=...): pass "
                "the step's key and the batch's indices to jssl.methods.common.forward_crops, "
                "or build the network without drop path (drop_path_rate=0)."
            )
        keep = 1.0 - self.rate
        mask = jax.vmap(lambda key: jax.random.bernoulli(key, keep))(keys)
        mask = mask.reshape((x.shape[0],) + (1,) * (x.ndim - 1))
        return jnp.where(mask, x / keep, 0.0).astype(x.dtype)


class LayerScale(nn.Module):
    """A learned per-channel scale of a residual branch, initialised to ``init`` (CaiT, Touvron
    et al. 2021; DINOv2's ``ls1`` / ``ls2`` with 1e-5). Parameter ``gamma`` as timm names it."""

    init: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gamma = self.param("gamma", nn.initializers.constant(self.init), (x.shape[-1],))
        return x * gamma.astype(self.dtype)


def swiglu_hidden(mlp_dim: int) -> int:
    """DINOv2's ``SwiGLUFFNFused`` width: two thirds of the MLP width, rounded up to a
    multiple of 8 (4096 for ViT-g/14's 6144)."""
    return (int(mlp_dim * 2 / 3) + 7) // 8 * 8


# jax.nn.dot_product_attention's implementations that model.attention chooses between (with
# "auto": resolve_attention), and the token multiple each needs in training: cuDNN's flash
# attention refuses odd lengths such as ViT-S/16's 197 tokens, so the trunk pads to 8.
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")
TOKEN_MULTIPLE = {"xla": 1, "cudnn": 8}


def resolve_attention(name: str, dtype: Any) -> str:
    """``model.attention`` -> the implementation the trunk runs: "xla" or "cudnn" as given,
    "auto" cuDNN's flash attention where it runs (a CUDA GPU of compute capability 8.0 or
    later, bfloat16 or float16 compute) and XLA's elsewhere. cuDNN takes no float32."""
    if name not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"model.attention={name!r}: use 'auto' (cuDNN on a GPU that has it, else XLA), "
            "'xla' or 'cudnn'."
        )
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if name == "cudnn" and not half:
        raise ValueError(
            f"model.attention='cudnn' needs bfloat16 compute (cuDNN's flash attention takes "
            f"no {jnp.dtype(dtype).name}): set --config.model.dtype=bfloat16, or "
            "model.attention='xla'."
        )
    if name != "auto":
        return name
    return "cudnn" if half and _cudnn_attention_available() else "xla"


def _cudnn_attention_available() -> bool:
    """Whether the default backend is a CUDA GPU that cuDNN's flash attention supports
    (Ampere or later; jax's ``fused_attention_stablehlo`` checks the same at trace time)."""
    if jax.default_backend() != "gpu":
        return False
    device = jax.devices()[0]
    if "cuda" not in device.client.platform_version:
        return False
    major = int(str(getattr(device, "compute_capability", "0")).split(".")[0])
    return major >= 8


def pad_tokens(x: jax.Array, multiple: int) -> tuple[jax.Array, jax.Array | None]:
    """(B, T, D) tokens -> zero-padded to a multiple of ``multiple`` and the (B,) int32 true
    lengths that the blocks' attention masks the padded keys with; ``x`` and None when ``T``
    already is one. The padded rows never reach a real token, so slicing them off afterwards
    gives the unpadded outputs and gradients."""
    b, t, _ = x.shape
    padded = -(-t // multiple) * multiple
    if padded == t:
        return x, None
    lengths = jnp.full((b,), t, jnp.int32)
    return jnp.pad(x, ((0, 0), (0, padded - t), (0, 0))), lengths


class Attention(nn.Module):
    """Multi-head self-attention with timm's parameter layout: ``qkv`` (D -> 3D, ordered
    [q | k | v] x heads x head_dim) and ``proj``; keys past ``lengths[i]`` of row i (the
    trunk's padding) are masked out. ``implementation``: jax.nn.dot_product_attention's."""

    num_heads: int
    dtype: Any = jnp.float32
    implementation: str = "xla"

    @nn.compact
    def __call__(self, x: jax.Array, lengths: jax.Array | None = None) -> jax.Array:
        b, t, d = x.shape
        dense = lambda n, name: nn.Dense(  # noqa: E731
            n, kernel_init=_trunc_normal, dtype=self.dtype, param_dtype=jnp.float32, name=name
        )
        qkv = dense(3 * d, "qkv")(x).reshape(b, t, 3, self.num_heads, d // self.num_heads)
        # (B, T, heads, head_dim) each; scale 1 / sqrt(head_dim), softmax in float32.
        out = jax.nn.dot_product_attention(
            qkv[:, :, 0],
            qkv[:, :, 1],
            qkv[:, :, 2],
            key_value_seq_lengths=lengths,
            implementation=self.implementation,
        )
        return dense(d, "proj")(out.reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + drop(ls1(attn(norm1(x))))``,
    ``x + drop(ls2(ffn(norm2(x))))``; LayerScale only with ``layerscale > 0``, the feed-forward
    timm's GELU MLP or DINOv2's SwiGLU (``w12`` then ``w3``). ``lengths``: the true token
    counts of a padded sequence (``pad_tokens``), whose padded keys attention masks out."""

    num_heads: int
    mlp_dim: int = 0  # 0: 4 x the width
    drop_path: float = 0.0
    dtype: Any = jnp.float32
    layerscale: float = 0.0  # LayerScale's initial value; 0: none
    ffn: str = "mlp"  # or "swiglu"
    attention: str = "xla"  # jax.nn.dot_product_attention's implementation: "xla" | "cudnn"

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        train: bool,
        keys: jax.Array | None = None,
        lengths: jax.Array | None = None,
    ) -> jax.Array:
        d = x.shape[-1]
        norm = lambda name: nn.LayerNorm(  # noqa: E731
            epsilon=1e-6, dtype=self.dtype, param_dtype=jnp.float32, name=name
        )
        dense = lambda n, name: nn.Dense(  # noqa: E731
            n, kernel_init=_trunc_normal, dtype=self.dtype, param_dtype=jnp.float32, name=name
        )
        scale = lambda name: (  # noqa: E731
            LayerScale(self.layerscale, self.dtype, name=name) if self.layerscale else (lambda h: h)
        )
        branch_keys = [None, None]
        if keys is not None:
            branch_keys = [jax.vmap(lambda k, b=b: jax.random.fold_in(k, b))(keys) for b in (0, 1)]
        drop = DropPath(self.drop_path)
        attention = Attention(self.num_heads, self.dtype, self.attention, name="attn")
        h = attention(norm("norm1")(x), lengths)
        x = x + drop(scale("ls1")(h), train, branch_keys[0])
        h = norm("norm2")(x)
        width = self.mlp_dim or 4 * d
        if self.ffn == "swiglu":
            hidden = swiglu_hidden(width)
            gate, value = jnp.split(dense(2 * hidden, "w12")(h), 2, axis=-1)
            h = dense(d, "w3")(nn.silu(gate) * value)
        elif self.ffn == "mlp":
            h = nn.gelu(dense(width, "fc1")(h), approximate=False)  # torch.nn.GELU(): exact erf
            h = dense(d, "fc2")(h)
        else:
            raise ValueError(f"model.ffn={self.ffn!r}: use 'mlp' (timm) or 'swiglu' (DINOv2).")
        return x + drop(scale("ls2")(h), train, branch_keys[1])


class VisionTransformer(nn.Module):
    """ViT trunk returning named taps (N, D): ``block1`` .. ``block{depth}`` (the class token
    after each block, through the final norm: DINO ``get_intermediate_layers``),
    ``concat_cls4`` (the last 4 concatenated), ``patch_avg`` (the mean of the last block's
    normed patch tokens), ``cls_patch_avg`` (the last class token and ``patch_avg``),
    ``avgpool`` (the normed last class token, what heads, kNN and the probe read; named as the
    ResNets' pooled output) and ``patch_tokens`` (N, P, D: every normed patch token of the last
    block, the visible ones with ``keep``).

    ``image_size`` is the resolution the position embeddings are laid out for (224 for the
    published models); any other input size that the patch size divides is served by
    resampling them (``resample_pos_embed``).

    Call options: ``mask`` (B, h*w) bool replaces the masked patches' embeddings by the mask
    token before the position embeddings are added (iBOT's ``prepare_tokens``; needs
    ``mask_token=True``); ``keep`` (B, k) int indices of the row-major patch grid sends only
    those patches, with their position embeddings, through the blocks (MAE's
    ``random_masking``); ``row_keys`` (B,) keys drive stochastic depth in training (required
    when ``drop_path_rate > 0``; block l draws from ``fold_in(key, l)``, then its branch).
    """

    embed_dim: int = 384
    depth: int = 12
    num_heads: int = 6
    patch_size: int = 16
    image_size: int = 224
    mlp_dim: int = 0  # 0: 4 x embed_dim
    drop_path_rate: float = 0.0  # the last block's; block i's is rate * i / (depth - 1)
    drop_path_uniform: bool = False  # every block at drop_path_rate (DINOv2's drop_path_uniform)
    # "learned" (timm, DINO: trunc-normal init, trained) or "sincos" (MoCo v3: fixed 2-D
    # sin-cos values; the method holds them fixed through the optimizer's freeze)
    pos_embed_init: str = "learned"
    dtype: Any = jnp.float32  # computation dtype; parameters stay float32
    remat: str = "none"  # jssl.models.remat: blocks recomputed in the backward pass
    num_registers: int = 0  # register tokens after the class token (Darcet et al. 2024)
    layerscale: float = 0.0  # LayerScale's initial value on both branches; 0: none
    ffn: str = "mlp"  # "mlp" (timm's GELU MLP) or "swiglu" (DINOv2's SwiGLUFFNFused)
    mask_token: bool = False  # a learned token for masked patches (``mask=``)
    # jax.nn.dot_product_attention's implementation, "xla" or "cudnn" (build_vit resolves
    # model.attention="auto" with resolve_attention), and the multiple the token sequence is
    # zero-padded to at the trunk's entry, the padded keys masked in every block: 0 for the
    # implementation's own (TOKEN_MULTIPLE: 8 for cuDNN, none for XLA).
    attention: str = "xla"
    pad_tokens_to: int = 0

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        train: bool = True,
        *,
        mask: jax.Array | None = None,
        keep: jax.Array | None = None,
        row_keys: jax.Array | None = None,
    ) -> dict[str, jax.Array]:
        if self.attention not in TOKEN_MULTIPLE:
            raise ValueError(
                f"VisionTransformer(attention={self.attention!r}): use 'xla' or 'cudnn' "
                "(model.attention='auto' is resolved by jssl.models.vit.resolve_attention)."
            )
        x = self._tokens(x, mask, keep)
        tokens, first_patch = x.shape[1], 1 + self.num_registers
        x, lengths = pad_tokens(x, self.pad_tokens_to or TOKEN_MULTIPLE[self.attention])

        norm = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, param_dtype=jnp.float32, name="norm")
        taps: dict[str, jax.Array] = {}
        block_cls = remat_lib.wrap(Block, self.remat, static_argnums=(2,))
        for i in range(self.depth):
            rate = self.drop_path_rate
            if not self.drop_path_uniform:
                rate = rate * i / max(self.depth - 1, 1)
            keys = None
            if train and rate > 0:
                if row_keys is None:
                    raise ValueError(
                        f"model.drop_path_rate={self.drop_path_rate}: stochastic depth in "
                        "training needs one key per row (row_keys=...); see "
                        "jssl.methods.common.forward_crops."
                    )
                keys = jax.vmap(lambda k, i=i: jax.random.fold_in(k, i))(row_keys)
            block = block_cls(
                self.num_heads,
                self.mlp_dim,
                rate,
                self.dtype,
                self.layerscale,
                self.ffn,
                self.attention,
                name=f"blocks_{i}",
            )
            x = block(x, train, keys, lengths)
            if i < self.depth - 1:
                taps[f"block{i + 1}"] = norm(x[:, 0])
        x = norm(x[:, :tokens])  # the padding off before any tap reads the tokens
        taps[f"block{self.depth}"] = x[:, 0]
        taps["patch_tokens"] = x[:, first_patch:]
        taps["patch_avg"] = jnp.mean(x[:, first_patch:], axis=1)
        last4 = [taps[f"block{i}"] for i in range(max(self.depth - 3, 1), self.depth + 1)]
        taps["concat_cls4"] = jnp.concatenate(last4, axis=-1)
        taps["cls_patch_avg"] = jnp.concatenate([x[:, 0], taps["patch_avg"]], axis=-1)
        taps["avgpool"] = x[:, 0]
        return taps

    def _tokens(self, x: jax.Array, mask: jax.Array | None, keep: jax.Array | None) -> jax.Array:
        """Images (B, H, W, C) -> the blocks' input (B, 1 + registers + patches, D): patch
        embeddings (masked ones replaced by the mask token, only ``keep``'s when given) plus
        their position embeddings, after the class token and the registers."""
        p = self.patch_size
        if self.image_size % p:
            raise ValueError(f"ViT image_size {self.image_size} is not a multiple of patch {p}")
        if x.shape[1] % p or x.shape[2] % p:
            raise ValueError(
                f"ViT input of {x.shape[1]}x{x.shape[2]} px is not a multiple of the patch size "
                f"{p}: crop sizes for model.patch_size={p} must be multiples of {p}."
            )
        x = jnp.asarray(x, self.dtype)
        x = nn.Conv(
            self.embed_dim,
            (p, p),
            strides=(p, p),
            padding="VALID",
            kernel_init=_torch_conv_init,
            bias_init=_torch_conv_bias_init(p * p * x.shape[-1]),
            dtype=self.dtype,
            param_dtype=jnp.float32,
            name="patch_embed",
        )(x)
        b, h, w, d = x.shape
        x = x.reshape(b, h * w, d)
        if self.mask_token:
            token = self.param("mask_token", nn.initializers.zeros, (1, 1, d), jnp.float32)
            if mask is not None:
                if mask.shape != (b, h * w):
                    raise ValueError(
                        f"mask of shape {mask.shape} for a {h}x{w} patch grid: it must be "
                        f"({b}, {h * w}), True where a patch is masked."
                    )
                x = jnp.where(mask[..., None], token.astype(x.dtype), x)
        elif mask is not None:
            raise ValueError("mask= needs a trunk built with mask_token=True (its learned token).")
        grid = self.image_size // p
        cls = self.param("cls_token", _trunc_normal, (1, 1, d), jnp.float32)
        if self.pos_embed_init == "sincos":
            pos_init = lambda key, shape, dtype: sincos_pos_embed(grid, d).astype(dtype)  # noqa: E731
        elif self.pos_embed_init == "learned":
            pos_init = _trunc_normal
        else:
            raise ValueError(
                f"model.pos_embed_init={self.pos_embed_init!r}: use 'learned' or 'sincos'."
            )
        pos = self.param("pos_embed", pos_init, (1, 1 + grid * grid, d), jnp.float32)
        x = x + resample_pos_embed(pos[:, 1:], (h, w))
        if keep is not None:
            x = jnp.take_along_axis(x, keep[..., None].astype(jnp.int32), axis=1)
        lead = [jnp.broadcast_to(cls + pos[:, :1], (b, 1, d))]
        if self.num_registers:
            registers = self.param(
                "register_tokens",
                nn.initializers.normal(1e-6),  # DINOv2's init
                (1, self.num_registers, d),
                jnp.float32,
            )
            lead.append(jnp.broadcast_to(registers, (b, self.num_registers, d)))
        return jnp.concatenate([*lead, x], axis=1).astype(self.dtype)
