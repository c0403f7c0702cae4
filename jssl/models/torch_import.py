"""Import PyTorch ResNet weights (torchvision, VISSL model zoo, MoCo/DINO) into jssl's ResNet,
so that published checkpoints can be benchmarked with jssl's evaluators:

  variables = import_torch_resnet("converted_vissl_rn50_simclr.torch", config.model)
  # -> {"params": {"trunk": ...}, "batch_stats": {"trunk": ...}}, merge into TrunkAndHead's

``load_torch_state_dict`` reads torchvision state dicts, VISSL checkpoints
(``vissl/utils/checkpoint.py``, ``_feature_blocks.`` keys; older model-zoo files holding
``model_state_dict`` or the trunk itself), MoCo's and DINO's training checkpoints (any single
prefix before torchvision names) and ``.safetensors`` files (read without torch). ``torch``
only reads the pickled files, with ``weights_only=True`` so untrusted checkpoints cannot run
code. The one name table, ``_torch_name`` (and ``vit_import.torch_name``), with
``to_flax_layout`` / ``to_torch_layout``, serves both the import and the export
(``jssl.models.torch_export``). Which files and flags: docs/evaluation.md#which-weights.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import traverse_util

from jssl.models import build_trunk
from jssl.models.resnet import _ARCHS, ResNet

# Dict keys that wrap the weights we want, tried in this order at every level: VISSL's
# classy state (vissl/utils/checkpoint.py), MoCo's / generic "state_dict", DINO's teacher
# (the network DINO evaluates), older VISSL model-zoo "model_state_dict".
_WRAPPER_KEYS = (
    "classy_state_dict",
    "base_model",
    "model",
    "trunk",
    "model_state_dict",
    "state_dict",
    "teacher",
)
# When a dict holds several ResNets (MoCo's query and key encoders), the first of these
# prefixes present is the one evaluated in the papers.
_PREFERRED_PREFIXES = (
    "_feature_blocks.",
    "module.encoder_q.",
    "encoder_q.",
    "module.base_encoder.",
    "base_encoder.",
    "module.backbone.",
    "backbone.",
    "module.",
    "",
)
_ANCHOR = "layer1.0.conv1.weight"  # every torchvision-layout ResNet has this key
_TRUNK_KEY = re.compile(r"(conv1|bn1|layer\d+)\.")
_FC_KEYS = ("fc.weight", "fc.bias")
_LEAF_NAMES = {
    ("params", "kernel"): "weight",
    ("params", "scale"): "weight",
    ("params", "bias"): "bias",
    ("batch_stats", "mean"): "running_mean",
    ("batch_stats", "var"): "running_var",
}


SAFETENSORS_SUFFIX = ".safetensors"


def to_flax_layout(value: np.ndarray) -> np.ndarray:
    """A PyTorch array in jssl's layout: conv OIHW -> HWIO, Linear (out, in) -> (in, out)."""
    if value.ndim == 4:
        return value.transpose(2, 3, 1, 0)
    if value.ndim == 2:
        return value.T
    return value


def to_torch_layout(value: np.ndarray) -> np.ndarray:
    """The inverse of ``to_flax_layout``: HWIO -> OIHW, Dense (in, out) -> (out, in)."""
    if value.ndim == 4:
        return value.transpose(3, 2, 0, 1)
    if value.ndim == 2:
        return value.T
    return value


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as err:
        raise ImportError(
            "Reading PyTorch checkpoints needs torch: pip install torch==2.13.0 "
            "(see requirements-dev.txt)."
        ) from err
    return torch


def _is_tensor_dict(obj: Any, torch: Any) -> bool:
    return isinstance(obj, Mapping) and any(isinstance(v, torch.Tensor) for v in obj.values())


def _unwrap(obj: Any, torch: Any, anchor: str = _ANCHOR) -> Mapping[str, Any]:
    """Descend through known wrapper keys until a dict holding the network's tensors (a key
    ending in ``anchor``)."""
    while isinstance(obj, Mapping) and not any(str(k).endswith(anchor) for k in obj):
        inner = next((obj[k] for k in _WRAPPER_KEYS if isinstance(obj.get(k), Mapping)), None)
        if inner is None:
            break
        obj = inner
    if not _is_tensor_dict(obj, torch) or not any(str(k).endswith(anchor) for k in obj):
        found = sorted(map(str, obj)) if isinstance(obj, Mapping) else type(obj).__name__
        raise _not_found(found, anchor)
    return obj


def _not_found(found: Any, anchor: str) -> ValueError:
    """The error for a file without the network's anchor key, listing the keys it holds."""
    if anchor == _ANCHOR:
        expected = (
            "a torchvision state dict (conv1.weight, layer1.0.conv1.weight, ...), a VISSL "
            "checkpoint (classy_state_dict -> base_model -> model -> trunk with "
            "_feature_blocks.* keys)"
        )
        network = "ResNet"
    else:
        expected = (
            "a timm / DINO / MoCo v3 ViT state dict (cls_token, pos_embed, "
            "patch_embed.proj.weight, blocks.0.attn.qkv.weight, ...)"
        )
        network = "ViT"
    return ValueError(
        f"No {network} weights found (no key ending in {anchor!r}); innermost keys found: "
        f"{_summarise(found, 12)}. Expected {expected}, or a dict under one of "
        f"{list(_WRAPPER_KEYS)} holding such keys; model.trunk must name the network "
        "the file holds."
    )


def _strip_prefix(state: Mapping[str, Any], anchor: str = _ANCHOR) -> dict[str, Any]:
    prefixes = sorted({k[: -len(anchor)] for k in state if k.endswith(anchor)})
    prefix = next((p for p in _PREFERRED_PREFIXES if p in prefixes), None)
    if prefix is None:
        if len(prefixes) > 1:
            raise ValueError(
                f"Several networks in one state dict, under prefixes {prefixes}; extract the one "
                "you want and save it alone (torch.save({k[len(prefix):]: v ...}))."
            )
        prefix = prefixes[0]
    dropped = [k for k in state if not k.startswith(prefix)]
    if dropped:
        logging.info(
            "Ignoring %d keys outside prefix %r, e.g. %s", len(dropped), prefix, dropped[:3]
        )
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def load_torch_state_dict(path: str, anchor: str = _ANCHOR) -> dict[str, np.ndarray]:
    """Reads a PyTorch ResNet checkpoint as numpy arrays under torchvision names (a ViT's
    under timm's names with ``anchor="blocks.0.attn.qkv.weight"``).

    Accepts the layouts listed in the module docstring; wrapper dicts and prefixes
    (``_feature_blocks.``, ``module.encoder_q.`` ...) are removed, non-tensor entries
    dropped. Loads with ``weights_only=True``: a file that pickles arbitrary objects is
    refused rather than executed. An empty, truncated or non-torch file is a ValueError
    that says so. A ``.safetensors`` file is read without torch (``_load_safetensors``).
    """
    if path.endswith(SAFETENSORS_SUFFIX):
        return _load_safetensors(path, anchor)
    torch = _import_torch()
    with open(path, "rb") as f:
        head = f.read(4)
    # torch.save writes a zip archive (PK..), older versions a pickle (protocol byte 0x80).
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):
        raise ValueError(
            _unreadable(path, ValueError(f"it starts with {head!r}: neither zip nor pickle"))
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # Objects the safe unpickler refuses say so (torch/_weights_only_unpickler.py); random
        # or cut bytes fail in it too, with other words.
        refused = ("Unsupported global", "Can only create new object", "is blocked")
        if not any(word in str(err) for word in refused):
            raise ValueError(_unreadable(path, err)) from err
        raise ValueError(
            f"{path} holds pickled objects other than tensors and containers, so it was not "
            "loaded (torch.load(weights_only=True) refuses them; unpickling can run code). "
            "If you trust the file, load it yourself with weights_only=False, and torch.save "
            "only its model state dict.\n"
            f"torch said: {err}"
        ) from err
    except Exception as err:  # damaged bytes fail anywhere in the unpickler or zip reader
        raise ValueError(_unreadable(path, err)) from err
    state = _strip_prefix(_unwrap(checkpoint, torch, anchor), anchor)
    # bfloat16 tensors have no numpy equivalent: widen to float32 before converting.
    return {
        k: (v.float() if v.dtype == torch.bfloat16 else v).detach().cpu().numpy()
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }


def _load_safetensors(path: str, anchor: str) -> dict[str, np.ndarray]:
    """A flat safetensors state dict as numpy arrays, a single prefix removed as for torch
    files; bfloat16 tensors (no numpy type) are refused with a message saying how to widen."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        state = load_file(path)
    except (SafetensorError, OSError, ValueError, TypeError) as err:
        raise ValueError(
            f"{path} could not be read as a safetensors file ({type(err).__name__}: "
            f"{str(err)[:200]}): it is truncated, damaged, or holds bfloat16 tensors (numpy has "
            "no bfloat16; save them as float32)."
        ) from err
    if not any(k.endswith(anchor) for k in state):
        raise _not_found(sorted(state), anchor)
    return _strip_prefix(state, anchor)


def _unreadable(path: str, err: BaseException) -> str:
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
    return (
        f"{path} could not be read as a PyTorch checkpoint ({type(err).__name__}: {first}): "
        "it is truncated, damaged or not a torch.save file. Download or copy it again, or "
        "check it with python -c \"import torch; torch.load('FILE', weights_only=True)\"."
    )


def _torch_name(collection: str, path: tuple[str, ...]) -> str:
    """Flax path in jssl's ResNet -> torchvision key, e.g. layer1_0/downsample_bn/mean ->
    layer1.0.downsample.1.running_mean."""
    modules = []
    for name in path[:-1]:
        name = re.sub(r"^(layer\d+)_(\d+)$", r"\1.\2", name)
        name = {"downsample_conv": "downsample.0", "downsample_bn": "downsample.1"}.get(name, name)
        modules.append(name)
    return ".".join([*modules, _LEAF_NAMES[(collection, path[-1])]])


# Rank of name parts in torchvision's state dict order, so messages list keys as torch does.
_PART_RANK = {
    **{name: rank for rank, name in enumerate(("conv1", "bn1", "conv2", "bn2", "conv3", "bn3"))},
    **{name: 10 + rank for rank, name in enumerate(_LEAF_NAMES.values())},
    "downsample": 20,
    "fc": 100,
}


def _torchvision_order(name: str) -> list[tuple[int, int, str]]:
    """Sort key: conv1, bn1, layer1.0.conv1 ..., layer1.0.downsample, ..., fc."""
    return [
        (_PART_RANK.get(part, 50), int(part) if part.isdigit() else 0, part)
        for part in name.split(".")
    ]


def _guess_architecture(state_dict: Mapping[str, np.ndarray]) -> str:
    """Which ResNet the keys describe, for error messages: "resnet50, width_multiplier=2.0"."""
    blocks = tuple(
        len({k.split(".")[1] for k in state_dict if k.startswith(f"layer{i}.")})
        for i in range(1, 5)
    )
    kind = "bottleneck" if "layer1.0.conv3.weight" in state_dict else "basic"
    depth = next((d for d, arch in _ARCHS.items() if arch == (kind, blocks)), None)
    name = f"resnet{depth}" if depth else f"an unsupported ResNet ({kind}, blocks {blocks})"
    if "conv1.weight" in state_dict:
        name += f", width_multiplier={state_dict['conv1.weight'].shape[0] / 64:g}"
    return name


def _expected_variables(
    depth: int, width_multiplier: float, cifar_stem: bool, num_classes: int | None
) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """Flattened (collection, *path) -> shape of the variables jssl's ResNet creates."""
    model = ResNet(
        depth=depth,
        width_multiplier=width_multiplier,
        cifar_stem=cifar_stem,
        num_classes=num_classes,
    )
    variables = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)
    )
    return traverse_util.flatten_dict(variables)


def _summarise(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" ... ({len(keys)} in all)" if len(keys) > limit else "")


def torch_resnet_to_flax(
    state_dict: Mapping[str, np.ndarray],
    *,
    depth: int,
    width_multiplier: float = 1.0,
    cifar_stem: bool = False,
) -> dict[str, Any]:
    """torchvision-named ResNet weights -> ``{"params", "batch_stats"}`` of ``ResNet``.

    Conv kernels go from OIHW to HWIO, BN weight/bias to scale/bias and running
    mean/var to ``batch_stats``; ``fc.weight`` (out, in) becomes ``fc/kernel`` (in, out)
    when the state dict has ``fc.weight`` and ``fc.bias`` (use ``ResNet(num_classes=...)``
    to apply it). ``num_batches_tracked`` and keys outside conv1/bn1/layerN/fc (heads)
    are ignored; a missing trunk key, an extra one or a shape mismatch is a ValueError.
    """
    has_fc = all(k in state_dict for k in _FC_KEYS)
    num_classes = int(np.shape(state_dict["fc.weight"])[0]) if has_fc else None
    expected = _expected_variables(depth, width_multiplier, cifar_stem, num_classes)
    by_torch_name = {
        _torch_name(path[0], path[1:]): path
        for path in sorted(expected, key=lambda p: _torchvision_order(_torch_name(p[0], p[1:])))
    }

    trunk_keys = [
        k
        for k in state_dict
        if (_TRUNK_KEY.match(k) or (has_fc and k in _FC_KEYS))
        and not k.endswith("num_batches_tracked")
    ]
    missing = [k for k in by_torch_name if k not in state_dict]
    unexpected = [k for k in trunk_keys if k not in by_torch_name]
    hint = (
        f"The checkpoint looks like {_guess_architecture(state_dict)}; it was read as "
        f"resnet{depth}, width_multiplier={width_multiplier:g}, cifar_stem={cifar_stem}: "
        "change the model config to match."
    )
    if missing or unexpected:
        raise ValueError(
            "PyTorch state dict does not match jssl's ResNet.\n"
            f"Missing keys: {_summarise(missing) or 'none'}\n"
            f"Unexpected keys: {_summarise(unexpected) or 'none'}\n{hint}"
        )

    flat: dict[tuple[str, ...], np.ndarray] = {}
    mismatched = []
    for name, path in by_torch_name.items():
        value = to_flax_layout(np.asarray(state_dict[name], np.float32))
        if value.shape != expected[path].shape:
            mismatched.append(
                f"{name}: {np.shape(state_dict[name])} -> {value.shape}, "
                f"expected {expected[path].shape}"
            )
        flat[path] = value
    if mismatched:
        raise ValueError(f"Shape mismatches: {_summarise(mismatched, 4)}\n{hint}")
    ignored = [k for k in state_dict if k not in by_torch_name and k not in trunk_keys]
    ignored = [k for k in ignored if not k.endswith("num_batches_tracked")]
    if ignored:
        logging.info("Ignoring %d non-trunk keys, e.g. %s", len(ignored), ignored[:3])
    return traverse_util.unflatten_dict(flat)


def import_torch_resnet(path: str, model_config: ml_collections.ConfigDict) -> dict[str, Any]:
    """Load + convert a checkpoint for ``build_trunk(model_config)``, under the ``trunk`` name.

    Returns ``{"params": {"trunk": ...}, "batch_stats": {"trunk": ...}}``, to replace the
    trunk entries of a ``TrunkAndHead``'s variables (``jssl/models/model.py``). A
    classifier ``fc`` in the checkpoint is dropped: jssl evaluates its own heads.
    """
    trunk = build_trunk(model_config)
    state_dict = {k: v for k, v in load_torch_state_dict(path).items() if not k.startswith("fc.")}
    variables = torch_resnet_to_flax(
        state_dict,
        depth=trunk.depth,
        width_multiplier=trunk.width_multiplier,
        cifar_stem=trunk.cifar_stem,
    )
    return {collection: {"trunk": tree} for collection, tree in variables.items()}
