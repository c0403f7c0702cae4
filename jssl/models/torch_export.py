"""jssl trunks as PyTorch state dicts: a ResNet under torchvision's names
(``torchvision/models/resnet.py``), a ViT under timm's (``timm/models/vision_transformer.py``),
or, with LayerScale, registers or SwiGLU, under DINOv2's (``dinov2/models/
vision_transformer.py``), in PyTorch layouts (conv OIHW, Linear (out, in)), for detection or
segmentation code in PyTorch.

The names come from the import's own table (``torch_import._torch_name``,
``vit_import.torch_name``) and the layouts from the inverse of its transform
(``torch_import.to_torch_layout``), so importing an export gives back the same arrays.
``pytorch_model`` says which torchvision / timm constructor and arguments build the network
the tensors fit, and what the jssl settings without a torchvision equivalent mean.
"""

from __future__ import annotations

from typing import Any

import ml_collections
import numpy as np
from flax import traverse_util

from jssl import models
from jssl.models import resnet, vit_import
from jssl.models.torch_import import _torch_name, _torchvision_order, to_torch_layout
from jssl.models.vit import SIZES as VIT_SIZES

SUPPORTED = (
    "ResNets (resnet18/34/50/101/152, under torchvision's names) and ViTs "
    "(vit_tiny/small/base/large/huge/giant, under timm's names; with LayerScale, registers or "
    "SwiGLU under DINOv2's)"
)


def check_exportable(model_config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming ``model.trunk`` when it is not a ResNet or a ViT."""
    trunk = str(model_config.trunk)
    if models.is_vit(model_config) or trunk in (f"resnet{d}" for d in resnet.supported_depths()):
        return
    kind = "a RegNet" if models.is_regnet(model_config) else "not a trunk jssl knows"
    raise ValueError(
        f"model.trunk={trunk!r} is {kind}: export writes {SUPPORTED}. Export a workdir that "
        "trained one of those, or set --config.model.trunk to the trunk the weights hold."
    )


def resnet_state_dict(
    variables: dict[str, Any], num_batches_tracked: int = 0
) -> dict[str, np.ndarray]:
    """``{"params", "batch_stats"}`` of jssl's ResNet -> torchvision's state dict, in its order.

    Every BatchNorm also gets torchvision's int64 ``num_batches_tracked`` (jssl keeps no
    count), so ``load_state_dict`` is strict-clean; it only matters to a BN with
    ``momentum=None``."""
    state = {}
    for collection in ("params", "batch_stats"):
        for path, value in traverse_util.flatten_dict(variables[collection]).items():
            name = _torch_name(collection, path)
            state[name] = np.ascontiguousarray(to_torch_layout(np.asarray(value, np.float32)))
            if path[-1] == "mean":
                counter = name.rsplit(".", 1)[0] + ".num_batches_tracked"
                state[counter] = np.asarray(num_batches_tracked, np.int64)
    return dict(sorted(state.items(), key=lambda item: _torchvision_order(item[0])))


def vit_state_dict(
    params: dict[str, Any], mask_token: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """``params`` of jssl's ViT -> timm's ``VisionTransformer`` state dict (no head), or
    DINOv2's ``DinoVisionTransformer``'s for a trunk with LayerScale, registers or SwiGLU,
    with the ``mask_token`` of shape (1, D) that DINOv2's model holds, so that it loads
    strictly: ``mask_token`` (the trained one, which the evaluated trunk lacks), else the
    one in ``params``, else zeros. timm's model has none, so it is not written there."""
    state = {
        vit_import.torch_name(path): np.ascontiguousarray(
            to_torch_layout(np.asarray(value, np.float32))
        )
        for path, value in traverse_util.flatten_dict(params).items()
    }
    held = state.pop("mask_token", None)
    if _dinov2_layout(state):
        width = state["cls_token"].shape[-1]
        mask = next((m for m in (mask_token, held) if m is not None), np.zeros((1, width)))
        state["mask_token"] = np.ascontiguousarray(np.asarray(mask, np.float32).reshape(1, width))
    return state


def _dinov2_layout(state: dict[str, Any]) -> bool:
    return any(k == "register_tokens" or ".ls1." in k or ".mlp.w12." in k for k in state)


def trunk_state_dict(
    model_config: ml_collections.ConfigDict,
    trunk: dict[str, Any],
    num_batches_tracked: int = 0,
    mask_token: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The PyTorch state dict of the trunk variables ``{"params", "batch_stats"}`` (host
    arrays) of ``build_trunk(model_config)``; ``mask_token``: a ViT's trained mask token, for
    DINOv2's layout (``vit_state_dict``)."""
    check_exportable(model_config)
    if models.is_vit(model_config):
        return vit_state_dict(trunk["params"], mask_token)
    return resnet_state_dict(trunk, num_batches_tracked)


def pytorch_model(
    model_config: ml_collections.ConfigDict, trained_mask_token: bool = False
) -> dict[str, Any]:
    """For export.json: the architecture, the PyTorch constructor and arguments that build the
    network the state dict fits, the statements to run after it, and notes on the settings
    torchvision / timm have no argument for (``trained_mask_token``: whether a DINOv2 layout's
    mask token is the trained one)."""
    check_exportable(model_config)
    if models.is_vit(model_config):
        return _vit_model(model_config, trained_mask_token)
    return _resnet_model(model_config)


def _resnet_model(m: ml_collections.ConfigDict) -> dict[str, Any]:
    depth = int(str(m.trunk)[len("resnet") :])
    width = float(m.width_multiplier)
    widths = resnet.stage_widths(width)
    kind = resnet._ARCHS[depth][0]
    dim = models.trunk_feature_dim(m)
    after = ["model.fc = torch.nn.Identity()"]
    notes = [
        f"The trunk alone: model(x) with fc replaced by Identity returns jssl's avgpool tap, "
        f"the ({dim},) mean of res5 over space. The method's projection head is not exported.",
        "Batch norm: eps 1e-5 as torchvision; jssl's BN momentum 0.9 is torch's momentum 0.1.",
    ]
    if m.cifar_stem:
        after += [
            f"model.conv1 = torch.nn.Conv2d(3, {widths[0]}, 3, 1, 1, bias=False)",
            "model.maxpool = torch.nn.Identity()",
        ]
        notes.append(
            "cifar_stem: conv1 is 3x3 stride 1 (padding 1) and there is no max-pool, for 32 px "
            "images (the demo presets); the statements under 'after' make torchvision's "
            "ResNet so. It downsamples by 8, not 32."
        )
    exact = width == 1.0
    if not exact:
        notes.append(
            f"width_multiplier={width:g}: every channel width is scaled (stages {widths}, "
            f"{dim} features; SimCLR's wide ResNets). torchvision's constructors build width 1 "
            "only (wide_resnet50_2 widens the 3x3 convs alone), so the names are "
            "torchvision's but the tensors load into a ResNet built with these widths: a copy "
            "of torchvision/models/resnet.py whose ResNet.__init__ uses "
            f"{list(widths)} for 64, 128, 256, 512 (inplanes {widths[0]}, fc input {dim})."
        )
    return {
        "architecture": {
            "family": "resnet",
            "trunk": str(m.trunk),
            "depth": depth,
            "block": kind,
            "width_multiplier": width,
            "stage_widths": list(widths),
            "cifar_stem": bool(m.cifar_stem),
            "feature_dim": dim,
        },
        "pytorch": {
            "library": "torchvision",
            "constructor": f"torchvision.models.resnet{depth}",
            "kwargs": {"weights": None},
            "after": after,
            "builds_exactly": exact,
        },
        "notes": notes,
    }


def _vit_model(m: ml_collections.ConfigDict, trained_mask_token: bool) -> dict[str, Any]:
    vit = models.build_vit(m)
    if vit.layerscale or vit.num_registers or vit.ffn == "swiglu":
        return _dinov2_model(m, vit, trained_mask_token)
    kwargs = {
        "img_size": vit.image_size,
        "patch_size": vit.patch_size,
        "embed_dim": vit.embed_dim,
        "depth": vit.depth,
        "num_heads": vit.num_heads,
        "mlp_ratio": vit.mlp_dim / vit.embed_dim,
        "qkv_bias": True,
        "class_token": True,
        "global_pool": "token",
        "num_classes": 0,
        "dynamic_img_size": True,
    }
    notes = [
        f"The trunk alone: model(x) returns jssl's avgpool tap, the ({vit.embed_dim},) class "
        "token after the final norm. The method's head is not exported.",
        f"pos_embed is laid out for {vit.image_size} px ({vit.image_size // vit.patch_size}^2 "
        "patches); dynamic_img_size=True resamples it for other sizes (bicubic, antialiased) "
        "as jssl does.",
        "LayerNorm eps 1e-6 and exact-erf GELU, timm's defaults.",
    ]
    if vit.depth != VIT_SIZES[str(m.trunk)][1]:
        notes.append(f"vit_depth={vit.depth}: fewer blocks than {m.trunk}'s own (demo/test).")
    if vit.pos_embed_init == "sincos":
        notes.append(
            "pos_embed holds MoCo v3's fixed 2-D sin-cos values; timm makes it a trainable "
            "parameter: set model.pos_embed.requires_grad_(False) to keep it fixed."
        )
    return {
        "architecture": {
            "family": "vit",
            "trunk": str(m.trunk),
            "embed_dim": vit.embed_dim,
            "depth": vit.depth,
            "num_heads": vit.num_heads,
            "mlp_dim": vit.mlp_dim,
            "patch_size": vit.patch_size,
            "image_size": vit.image_size,
            "pos_embed_init": vit.pos_embed_init,
            "feature_dim": vit.embed_dim,
        },
        "pytorch": {
            "library": "timm",
            "constructor": "timm.models.vision_transformer.VisionTransformer",
            "kwargs": kwargs,
            "after": [],
            "builds_exactly": True,
        },
        "notes": notes,
    }


def _dinov2_model(
    m: ml_collections.ConfigDict, vit: Any, trained_mask_token: bool
) -> dict[str, Any]:
    """DINOv2's ``DinoVisionTransformer`` (facebookresearch/dinov2, ``hubconf``'s
    ``dinov2_vit*14``), which holds LayerScale, registers and the fused SwiGLU as jssl does."""
    mask_token = (
        "mask_token is the trained one (of the masked-image loss; evaluation does not use it)."
        if trained_mask_token
        else "mask_token is zeros (the source trained none)."
    )
    kwargs = {
        "img_size": vit.image_size,
        "patch_size": vit.patch_size,
        "embed_dim": vit.embed_dim,
        "depth": vit.depth,
        "num_heads": vit.num_heads,
        "mlp_ratio": vit.mlp_dim / vit.embed_dim,
        "ffn_layer": "swiglufused" if vit.ffn == "swiglu" else "mlp",
        "init_values": vit.layerscale or None,
        "num_register_tokens": vit.num_registers,
        "block_chunks": 0,
    }
    notes = [
        f"The trunk alone: model(x) in eval mode returns jssl's avgpool tap, the "
        f"({vit.embed_dim},) class token after the final norm. The method's heads are not "
        f"exported; {mask_token}",
        f"pos_embed is laid out for {vit.image_size} px; DINOv2 resamples it for other sizes "
        "with its own bicubic interpolation (jssl resamples as timm does), so only that size "
        "gives jssl's figures exactly.",
        "timm reads the file as vit_*_dinov2 through its checkpoint filter.",
    ]
    if vit.depth != VIT_SIZES[str(m.trunk)][1]:
        notes.append(f"vit_depth={vit.depth}: fewer blocks than {m.trunk}'s own (demo/test).")
    return {
        "architecture": {
            "family": "vit",
            "trunk": str(m.trunk),
            "embed_dim": vit.embed_dim,
            "depth": vit.depth,
            "num_heads": vit.num_heads,
            "mlp_dim": vit.mlp_dim,
            "patch_size": vit.patch_size,
            "image_size": vit.image_size,
            "layerscale": vit.layerscale,
            "num_registers": vit.num_registers,
            "ffn": vit.ffn,
            "feature_dim": vit.embed_dim,
        },
        "pytorch": {
            "library": "dinov2",
            "constructor": "dinov2.models.vision_transformer.DinoVisionTransformer",
            "kwargs": kwargs,
            "after": [],
            "builds_exactly": True,
        },
        "notes": notes,
    }
