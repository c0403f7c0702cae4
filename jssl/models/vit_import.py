"""Import PyTorch ViT weights (timm, DINO, MoCo v3, DINOv2) into jssl's ``VisionTransformer``.

timm, DINO (``vision_transformer.py``) and MoCo v3 (``vits.py``) publish timm's
``VisionTransformer`` layout; a classifier or projection ``head.*`` is dropped. DINOv2's
``DinoVisionTransformer`` (facebookresearch/dinov2 ``models/vision_transformer.py``) adds
LayerScale, ``register_tokens`` and SwiGLU (``mlp.w12`` / ``mlp.w3``): :func:`torch_name`.
timm's copies of the DINOv2 models (``vit_*_dinov2``: ``reg_token``, packed SwiGLU, a
class-token-free ``pos_embed``) become DINOv2's (:func:`dinov2_names`). Wrappers and prefixes
are removed as for ResNets (``jssl.models.torch_import``); ``.safetensors`` files are read
without torch. Position embeddings of another resolution than ``model.image_size`` are
resampled on import as timm does. Flags per checkpoint: docs/evaluation.md#which-weights.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import traverse_util

from jssl.models import build_vit
from jssl.models.torch_import import _summarise, load_torch_state_dict, to_flax_layout
from jssl.models.vit import resample_pos_embed

ANCHOR = "blocks.0.attn.qkv.weight"
_TRUNK_KEY = re.compile(
    r"(cls_token|pos_embed|patch_embed\.|blocks\.|norm\.|norm_pre\.|reg_token|register_tokens)"
)
_LEAVES = {"kernel": "weight", "scale": "weight", "bias": "bias", "gamma": "gamma"}
# jssl's module names under the timm / DINOv2 names (DINOv2's SwiGLU is mlp.w12 then mlp.w3).
_MODULES = {"patch_embed": "patch_embed.proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
_MODULES.update(w12="mlp.w12", w3="mlp.w3")


def torch_name(path: tuple[str, ...]) -> str:
    """Flax parameter path -> timm key, the one name table of import and export:
    ``blocks_3/fc1/kernel`` -> ``blocks.3.mlp.fc1.weight``, ``patch_embed/kernel`` ->
    ``patch_embed.proj.weight``, ``pos_embed`` -> ``pos_embed``."""
    if len(path) == 1:
        return path[0]
    parts = []
    for name in path[:-1]:
        name = re.sub(r"^blocks_(\d+)$", r"blocks.\1", name)
        parts.append(_MODULES.get(name, name))
    return ".".join([*parts, _LEAVES[path[-1]]])


def torch_vit_to_flax(
    state_dict: dict[str, np.ndarray], model_config: ml_collections.ConfigDict
) -> dict[str, Any]:
    """timm-named ViT weights -> ``{"params": ...}`` of ``build_vit(model_config)``.

    A missing or extra trunk key or a shape mismatch is a ValueError naming the keys and the
    architecture the file looks like.
    """
    model = build_vit(model_config)
    state_dict = dinov2_names(state_dict, model_config)
    size = model.image_size
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False)
    )["params"]
    expected = traverse_util.flatten_dict(shapes)
    by_name = {torch_name(path): path for path in expected}
    trunk_keys = [k for k in state_dict if _TRUNK_KEY.match(k)]
    missing = [k for k in by_name if k not in state_dict]
    unexpected = [k for k in trunk_keys if k not in by_name]
    depth = len({k.split(".")[1] for k in state_dict if k.startswith("blocks.")})
    width = np.shape(state_dict["cls_token"])[-1] if "cls_token" in state_dict else "?"
    patch = np.shape(state_dict.get("patch_embed.proj.weight", np.zeros((0, 0, 0))))[-1]
    hint = (
        f"The checkpoint looks like a ViT of width {width}, depth {depth}, patch {patch}; it was "
        f"read as {model_config.trunk} (width {model.embed_dim}, depth {model.depth}), patch "
        f"{model.patch_size}: set model.trunk and model.patch_size to match."
    )
    if missing or unexpected:
        raise ValueError(
            "PyTorch state dict does not match jssl's ViT.\n"
            f"Missing keys: {_summarise(missing) or 'none'}\n"
            f"Unexpected keys: {_summarise(unexpected) or 'none'}\n{hint}"
        )
    flat, mismatched = {}, []
    for name, path in by_name.items():
        value = to_flax_layout(np.asarray(state_dict[name], np.float32))
        want = expected[path].shape
        if name == "pos_embed" and value.shape[-1] == want[-1] and value.shape != want:
            grid = int(round((want[1] - 1) ** 0.5))
            logging.info(
                "Resampling pos_embed %s to %s (a %dx%d grid)", value.shape, want, grid, grid
            )
            patches = resample_pos_embed(jnp.asarray(value[:, 1:]), (grid, grid))
            value = np.concatenate([value[:, :1], np.asarray(patches)], axis=1)
        if value.shape != want:
            mismatched.append(f"{name}: {np.shape(state_dict[name])}, expected {want}")
        flat[path] = value
    if mismatched:
        raise ValueError(f"Shape mismatches: {_summarise(mismatched, 4)}\n{hint}")
    ignored = [k for k in state_dict if k not in by_name]
    if ignored:
        logging.info("Ignoring %d non-trunk keys, e.g. %s", len(ignored), ignored[:3])
    return {"params": traverse_util.unflatten_dict(flat)}


def dinov2_names(
    state_dict: dict[str, np.ndarray], model_config: ml_collections.ConfigDict
) -> dict[str, np.ndarray]:
    """timm's copies of DINOv2's models under DINOv2's own names (what ``torch_name`` reads):
    ``reg_token`` -> ``register_tokens``; with ``model.ffn="swiglu"`` the packed
    ``mlp.fc1`` / ``mlp.fc2`` -> ``mlp.w12`` / ``mlp.w3`` (the same halves: SiLU of the first
    times the second, timm's ``SwiGLUPacked``); a ``pos_embed`` without the class token's row
    (timm's ``no_embed_class``, whose class token already holds that position) gets a zero
    row. Anything else is returned as is."""
    out = dict(state_dict)
    if "reg_token" in out and "register_tokens" not in out:
        out["register_tokens"] = out.pop("reg_token")
    if str(model_config.get("ffn", "mlp")) == "swiglu":
        for key in [k for k in out if re.match(r"blocks\.\d+\.mlp\.fc[12]\.", k)]:
            new = key.replace("mlp.fc1.", "mlp.w12.").replace("mlp.fc2.", "mlp.w3.")
            out[new] = out.pop(key)
    pos = out.get("pos_embed")
    if pos is not None and np.ndim(pos) == 3:
        tokens = np.shape(pos)[1]
        if _is_square(tokens) and not _is_square(tokens - 1):
            zero = np.zeros((1, 1, np.shape(pos)[2]), np.asarray(pos).dtype)
            out["pos_embed"] = np.concatenate([zero, np.asarray(pos)], axis=1)
    return out


def _is_square(n: int) -> bool:
    return n > 0 and int(round(n**0.5)) ** 2 == n


def import_torch_vit(path: str, model_config: ml_collections.ConfigDict) -> dict[str, Any]:
    """Load + convert a ViT checkpoint as ``{"params": {"trunk": ...}}`` (no batch_stats: a
    ViT has none), to replace the trunk of a ``TrunkAndHead``'s variables."""
    variables = torch_vit_to_flax(load_torch_state_dict(path, ANCHOR), model_config)
    return {"params": {"trunk": variables["params"]}}
