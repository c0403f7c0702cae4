"""Models: ResNet, ViT and RegNetY trunks, MLP heads and the trunk+head model, built from
``config.model``.

The config fields mirror VISSL's ``MODEL.TRUNK`` / ``MODEL.HEAD`` sections
(``vissl/config/defaults.yaml``) flattened into one ``ml_collections.ConfigDict``; every field,
with its default and meaning, is in :func:`default_config` (trunks: :func:`valid_trunks`).
``model.sync_bn`` is read by the caller, who passes ``bn_axis_name`` accordingly. Taps:
docs/evaluation.md#taps; the trunk contract: docs/design.md#extension-points.
"""

from __future__ import annotations

import re
from typing import Any

import jax.numpy as jnp
import ml_collections

from jssl.models import remat as remat_lib
from jssl.models.heads import MLPHead
from jssl.models.model import TrunkAndHead
from jssl.models.regnet import SIZES as REGNET_SIZES
from jssl.models.regnet import RegNet
from jssl.models.regnet import feature_dim as regnet_feature_dim
from jssl.models.resnet import ResNet, feature_dim, supported_depths
from jssl.models.vit import SIZES as VIT_SIZES
from jssl.models.vit import VisionTransformer, resolve_attention

__all__ = [
    "MLPHead",
    "RegNet",
    "ResNet",
    "TrunkAndHead",
    "VisionTransformer",
    "build_model",
    "build_trunk",
    "check_input_size",
    "default_config",
    "min_input_size",
    "trunk_feature_dim",
]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def default_config() -> ml_collections.ConfigDict:
    """The model fields of every jssl config (configs/base.py starts from these): ResNet-50
    with SimCLR's 2048-2048-128 projection head, float32, per-device batch norm."""
    m = ml_collections.ConfigDict()
    # resnet18/34/50/101/152, vit_tiny/.../giant, regnet_y_16gf/.../256gf (valid_trunks())
    m.trunk = "resnet50"
    m.width_multiplier = 1.0
    m.cifar_stem = False  # 3x3 stride-1 stem without max-pool, for 32 px images
    m.zero_init_residual = False
    m.head_dims = (2048, 2048, 128)  # (trunk features, hidden..., embedding)
    m.head_bn = False
    m.head_bias = True  # biases on the head's Dense layers (VISSL mlp use_bias)
    m.head_last_bn = False  # affine-free BN on the head's output (MoCo v3 projector)
    m.sync_bn = False  # True: batch statistics over the global batch (VISSL SYNC_BN)
    m.dtype = "float32"  # "bfloat16": bf16 compute, float32 params/optimizer/BN/loss
    # ViT trunks: patch size, the resolution the position embeddings are laid out for (other
    # crop sizes resample them), and the stochastic depth of the last block.
    m.patch_size = 16
    m.image_size = 224
    m.drop_path_rate = 0.0
    m.drop_path_uniform = False  # True: every block at drop_path_rate (DINOv2), not a ramp
    m.pos_embed_init = "learned"  # or "sincos": MoCo v3's fixed 2-D sin-cos values
    m.vit_depth = 0  # 0: the size's own depth (12 .. 40 blocks); fewer for tests and CPU demos
    m.num_registers = 0  # ViT register tokens after the class token (DINOv2 with registers: 4)
    m.layerscale = 0.0  # ViT LayerScale's initial value (DINOv2: 1e-5); 0: none
    m.ffn = "mlp"  # ViT feed-forward: "mlp" or "swiglu" (DINOv2's ViT-g/14)
    # Trunk blocks recomputed in the backward pass (jssl.models.remat): "none" | "full" (keep
    # each block's input) | "dots" (and its matmul outputs). Same results, less memory.
    m.remat = "none"
    # ViT attention (jax.nn.dot_product_attention's implementation): "auto" (cuDNN's flash
    # attention on a CUDA GPU of compute capability >= 8.0 with bfloat16 compute, XLA's
    # elsewhere) | "xla" | "cudnn". cuDNN's pads the tokens to a multiple of 8, masked.
    m.attention = "auto"
    return m


def valid_trunks() -> list[str]:
    return [f"resnet{d}" for d in supported_depths()] + list(VIT_SIZES) + list(REGNET_SIZES)


def is_vit(model_config: ml_collections.ConfigDict) -> bool:
    return str(model_config.trunk) in VIT_SIZES


def is_regnet(model_config: ml_collections.ConfigDict) -> bool:
    return str(model_config.trunk) in REGNET_SIZES


def _depth(trunk: str) -> int:
    valid = valid_trunks()
    match = re.fullmatch(r"resnet(\d+)", trunk)
    if match is None or int(match.group(1)) not in supported_depths():
        raise ValueError(f"Unknown trunk {trunk!r}; valid trunks: {valid}")
    return int(match.group(1))


def _dtype(name: str) -> jnp.dtype:
    if name not in _DTYPES:
        raise ValueError(f"Unknown model dtype {name!r}; valid: {sorted(_DTYPES)}")
    return _DTYPES[name]


def trunk_feature_dim(model_config: ml_collections.ConfigDict) -> int:
    """Width of the trunk's ``avgpool`` features, e.g. 2048 for resnet50, 512 for resnet18,
    384 for vit_small, 3024 for regnet_y_16gf (its last stage's width)."""
    if is_vit(model_config):
        return VIT_SIZES[model_config.trunk][0]
    if is_regnet(model_config):
        return regnet_feature_dim(model_config.trunk)
    return feature_dim(_depth(model_config.trunk), model_config.width_multiplier)


def min_input_size(model_config: ml_collections.ConfigDict) -> int:
    """The smallest image side the trunk can use. A ResNet downsamples by 32 (its 7x7 stride-2
    stem, max-pool and three strided stages; 8 with ``cifar_stem``): below that its last
    stage's feature map covers less than one pixel of the input, so every later stride-2 layer
    reads padding. A RegNet (3x3 stride-2 stem, four strided stages) also downsamples by 32.
    A ViT needs at least one patch."""
    if is_vit(model_config):
        return int(model_config.get("patch_size", 16))
    if is_regnet(model_config):
        return 32
    _depth(model_config.trunk)  # an unknown trunk fails here, naming the valid ones
    return 8 if model_config.cifar_stem else 32


def check_input_size(
    model_config: ml_collections.ConfigDict, size: int, field: str, value: Any = None
) -> None:
    """Raises ValueError naming ``field`` (the config field that sets ``size``, e.g.
    ``data.image_size``; its whole ``value`` when that is a tuple such as
    ``data.augment.crop_sizes``) when the trunk cannot use images of ``size`` x ``size``
    pixels; the message says the smallest size that works."""
    smallest = min_input_size(model_config)
    trunk = model_config.trunk
    setting = f"{field}={size if value is None else value}"
    if is_vit(model_config):
        if size < smallest or size % smallest:
            nearest = smallest * max(1, round(size / smallest))
            raise ValueError(
                f"{setting}: {size} px crops do not fit {trunk}, which cuts its input into "
                f"whole {smallest} px patches (model.patch_size): use a multiple of {smallest} "
                f"px, at least {smallest} (the nearest to {size} is {nearest}). Set "
                f"--config.{field}."
            )
        return
    if size < smallest:
        stem = "model.cifar_stem=True" if model_config.cifar_stem else "the 7x7 stem"
        if is_regnet(model_config):
            stem = "its stride-2 stem"
        hint = (
            ""
            if model_config.cifar_stem or is_regnet(model_config)
            else ", or --config.model.cifar_stem=True for small images (it downsamples by 8)"
        )
        raise ValueError(
            f"{setting}: {size} px crops are too small for {trunk} with {stem}: it downsamples "
            f"by {smallest}, so its last stage would see less than one pixel of the image. "
            f"Use crops of at least {smallest} px (--config.{field}){hint}."
        )


def build_trunk(
    model_config: ml_collections.ConfigDict,
    *,
    bn_axis_name: str | None = None,
    num_classes: int | None = None,
) -> ResNet | VisionTransformer | RegNet:
    """The trunk described by ``model_config``: a ResNet (with an ``fc`` if ``num_classes``),
    a ViT or a RegNet (``num_classes`` is not supported for these: heads are separate modules)."""
    if is_vit(model_config) or is_regnet(model_config):
        if num_classes is not None:
            raise ValueError(
                f"A {model_config.trunk} trunk has no built-in classifier; use a separate head."
            )
    if is_vit(model_config):
        return build_vit(model_config)
    if is_regnet(model_config):
        return build_regnet(model_config, bn_axis_name=bn_axis_name)
    return ResNet(
        depth=_depth(model_config.trunk),
        width_multiplier=model_config.width_multiplier,
        cifar_stem=model_config.cifar_stem,
        zero_init_residual=model_config.zero_init_residual,
        num_classes=num_classes,
        dtype=_dtype(model_config.dtype),
        bn_axis_name=bn_axis_name,
        remat=_remat(model_config),
    )


def build_vit(model_config: ml_collections.ConfigDict) -> VisionTransformer:
    """The ViT of ``model_config.trunk`` with its patch size, image size and drop path."""
    embed_dim, depth, heads, mlp_dim = VIT_SIZES[model_config.trunk]
    depth = int(model_config.get("vit_depth", 0)) or depth  # 0: the size's own depth
    if depth < 0:
        raise ValueError(f"model.vit_depth={depth} must be >= 0 (0: the size's own depth).")
    patch = int(model_config.get("patch_size", 16))
    image_size = int(model_config.get("image_size", 224))
    if patch <= 0 or image_size % patch:
        raise ValueError(
            f"model.image_size={image_size} must be a positive multiple of model.patch_size="
            f"{patch} (the position embeddings cover a grid of whole patches); e.g. "
            "--config.model.image_size=224 --config.model.patch_size=16."
        )
    rate = float(model_config.get("drop_path_rate", 0.0))
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"model.drop_path_rate={rate} must be in [0, 1) (DINO ViT-S: 0.1).")
    registers = int(model_config.get("num_registers", 0))
    layerscale = float(model_config.get("layerscale", 0.0))
    ffn = str(model_config.get("ffn", "mlp"))
    if registers < 0 or layerscale < 0:
        raise ValueError(
            f"model.num_registers={registers} and model.layerscale={layerscale} must be >= 0 "
            "(0: none; DINOv2 uses 4 registers and LayerScale 1e-5)."
        )
    if ffn not in ("mlp", "swiglu"):
        raise ValueError(f"model.ffn={ffn!r}: use 'mlp' (timm's) or 'swiglu' (DINOv2's ViT-g).")
    return VisionTransformer(
        embed_dim=embed_dim,
        depth=depth,
        num_heads=heads,
        mlp_dim=mlp_dim,
        patch_size=patch,
        image_size=image_size,
        drop_path_rate=rate,
        drop_path_uniform=bool(model_config.get("drop_path_uniform", False)),
        pos_embed_init=str(model_config.get("pos_embed_init", "learned")),
        dtype=_dtype(model_config.dtype),
        remat=_remat(model_config),
        attention=resolve_attention(
            str(model_config.get("attention", "auto")), _dtype(model_config.dtype)
        ),
        num_registers=registers,
        layerscale=layerscale,
        ffn=ffn,
    )


def build_regnet(
    model_config: ml_collections.ConfigDict, *, bn_axis_name: str | None = None
) -> RegNet:
    """The RegNetY of ``model_config.trunk`` (``jssl.models.regnet.SIZES``)."""
    trunk = model_config.trunk
    if float(model_config.width_multiplier) != 1.0:
        raise ValueError(
            f"model.width_multiplier={model_config.width_multiplier}: {trunk} sets its widths "
            "from its RegNet design; use --config.model.width_multiplier=1.0 (or a larger size)."
        )
    if model_config.cifar_stem:
        raise ValueError(
            f"model.cifar_stem=True is for ResNets; {trunk} has a 3x3 stride-2 stem. Set "
            "--config.model.cifar_stem=False."
        )
    return RegNet(
        **REGNET_SIZES[trunk]._asdict(),
        zero_init_residual=model_config.zero_init_residual,
        dtype=_dtype(model_config.dtype),
        bn_axis_name=bn_axis_name,
        remat=_remat(model_config),
    )


def _remat(model_config: ml_collections.ConfigDict) -> str:
    value = str(model_config.get("remat", "none"))
    remat_lib.check(value)
    return value


def build_model(
    model_config: ml_collections.ConfigDict, *, bn_axis_name: str | None = None
) -> TrunkAndHead:
    """Trunk + MLP head (none when ``head_dims`` is empty), fed from the ``avgpool`` tap."""
    trunk = build_trunk(model_config, bn_axis_name=bn_axis_name)
    head_dims = tuple(model_config.head_dims)
    head = None
    if head_dims:
        feat = trunk_feature_dim(model_config)
        if len(head_dims) < 2 or head_dims[0] != feat:
            raise ValueError(
                f"model.head_dims={head_dims} must start with the trunk's feature dim "
                f"({model_config.trunk}, width_multiplier={model_config.width_multiplier} -> "
                f"{feat}) and have an output dim; set e.g. "
                f"model.head_dims=({feat}, {feat}, 128), or () for no head."
            )
        head = MLPHead(
            dims=head_dims,
            use_bn=model_config.head_bn,
            last_bn=model_config.head_last_bn,
            use_bias=model_config.get("head_bias", True),
            dtype=_dtype(model_config.dtype),
            bn_axis_name=bn_axis_name,
        )
    return TrunkAndHead(trunk=trunk, head=head)
