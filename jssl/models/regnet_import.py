"""Import PyTorch RegNetY weights (torchvision, SEER / VISSL, ClassyVision) into jssl's RegNet.

So that SEER's published RegNets and torchvision's can be benchmarked with jssl's evaluators
(``--config.init.checkpoint=FILE`` with ``--config.model.trunk=regnet_y_*``). The name tables
(``LAYOUTS``, ``_PARTS``; :func:`torch_name`) follow ``torchvision/models/regnet.py`` and
``classy_vision/models/anynet.py``: jssl's ``block{s}_{i}`` is
``trunk_output.block{s}.block{s}-{i}`` in both. VISSL's trunk
(``vissl/models/trunks/regnet.py``) holds ClassyVision's stem as ``conv1`` and its stages as
``res2`` .. ``res5`` under ``_feature_blocks.``; its FSDP trunk (``regnet_fsdp.py``) groups a
stage's blocks as ``block{s}-part{g}``, a group that is dropped. Wrappers and prefixes are
removed by ``torch_import.load_torch_state_dict``. docs/evaluation.md#which-weights.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import traverse_util

from jssl.models import build_trunk
from jssl.models.regnet import SIZES, Design, RegNet, stages
from jssl.models.torch_import import (
    _WRAPPER_KEYS,
    _import_torch,
    _summarise,
    load_torch_state_dict,
)


class Layout(NamedTuple):
    """Where one checkpoint family keeps a RegNet's parts (see the module docstring)."""

    stem: str  # the stem's conv + BN Sequential
    block: str  # block i of stage s, ``r`` = s + 1 (VISSL's res2 .. res5)
    classy: bool  # ClassyVision's names inside a block (False: torchvision's)
    trunk_key: re.Pattern  # keys of the trunk; others (fc, heads) are ignored


_TRUNK = re.compile(r"(stem|trunk_output)\.")
LAYOUTS = {
    "torchvision": Layout("stem", "trunk_output.block{s}.block{s}-{i}", False, _TRUNK),
    "classy": Layout("stem.stem", "trunk_output.block{s}.block{s}-{i}", True, _TRUNK),
    "vissl": Layout("conv1.stem", "res{r}.block{s}-{i}", True, re.compile(r"(conv1|res\d+)\.")),
}
# A key each family has once, so that load_torch_state_dict strips exactly the prefix in front
# (VISSL's "_feature_blocks.", a training wrapper's "module.").
_ANCHORS = {
    "vissl": "conv1.stem.0.weight",
    "torchvision": "trunk_output.block1.block1-0.f.a.0.weight",  # and ClassyVision's
}
# jssl submodule -> (torchvision, ClassyVision) name inside a block, in the state dicts' order.
_PARTS = {
    "proj": ("proj.0", "proj"),
    "proj_bn": ("proj.1", "bn"),
    "a": ("f.a.0", "f.a.0"),
    "a_bn": ("f.a.1", "f.a.1"),
    "b": ("f.b.0", "f.b.0"),
    "b_bn": ("f.b.1", "f.b.1"),
    "se_reduce": ("f.se.fc1", "f.se.excitation.0"),
    "se_expand": ("f.se.fc2", "f.se.excitation.2"),
    "c": ("f.c.0", "f.c"),
    "c_bn": ("f.c.1", "f.final_bn"),
}
_LEAVES = {"kernel": "weight", "scale": "weight", "bias": "bias"}
_STATS = {"mean": "running_mean", "var": "running_var"}
_ORDER = ("stem", "stem_bn", *_PARTS)
_LEAF_ORDER = ("kernel", "scale", "bias", "mean", "var")
_BLOCK = re.compile(r"block(\d+)_(\d+)")


def torch_name(layout: str, path: tuple[str, ...]) -> str:
    """jssl variable path -> the layout's key: ``("block2_0", "se_reduce", "kernel")`` ->
    ``trunk_output.block2.block2-0.f.se.fc1.weight`` (torchvision)."""
    spec = LAYOUTS[layout]
    *modules, leaf = path
    leaf = _STATS.get(leaf) or _LEAVES[leaf]
    if modules[0] in ("stem", "stem_bn"):
        return f"{spec.stem}.{0 if modules[0] == 'stem' else 1}.{leaf}"
    stage, index = map(int, _BLOCK.fullmatch(modules[0]).groups())
    block = spec.block.format(s=stage, i=index, r=stage + 1)
    return f"{block}.{_PARTS[modules[1]][spec.classy]}.{leaf}"


def _order(key: tuple[str, ...]) -> tuple:
    """Sort key of ``(collection, *path)``: the model's order, stem first."""
    match = _BLOCK.fullmatch(key[1])
    block = tuple(map(int, match.groups())) if match else (0, 0)
    return block, _ORDER.index(key[-2]), _LEAF_ORDER.index(key[-1])


def _find_layout(path: str) -> str | None:
    """Which anchor of ``_ANCHORS`` the file holds, from its structure alone (torch memory-maps
    the tensors, so a many-GB SEER file is not read twice). None when the file does not read
    (the real read then says why); a ValueError when it holds no RegNet."""
    if path.endswith(".safetensors"):
        try:
            from safetensors import safe_open

            with safe_open(path, framework="np") as f:
                obj: Any = dict.fromkeys(f.keys())
        except Exception:  # noqa: BLE001 - the real read reports what is wrong
            return None
    else:
        torch = _import_torch()
        obj = None
        for mmap in (True, False):  # files of torch < 1.6 cannot be memory-mapped
            try:
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
                break
            except Exception:  # noqa: BLE001 - the real read reports what is wrong
                continue
        if obj is None:
            return None
    anchors = tuple(_ANCHORS.values())
    # The descent of torch_import._unwrap, stopping at the first level with either anchor.
    while isinstance(obj, Mapping) and not any(str(k).endswith(anchors) for k in obj):
        inner = next((obj[k] for k in _WRAPPER_KEYS if isinstance(obj.get(k), Mapping)), None)
        if inner is None:
            break
        obj = inner
    keys = [str(k) for k in obj] if isinstance(obj, Mapping) else []
    for layout, anchor in _ANCHORS.items():
        if any(k.endswith(anchor) for k in keys):
            return layout
    found = sorted(keys) if keys else type(obj).__name__
    raise ValueError(
        f"No RegNet weights found in {path}; innermost keys found: {_summarise(found, 12)}. "
        "Expected torchvision's RegNetY state dict (stem.0.weight, trunk_output.block1."
        "block1-0.f.a.0.weight, ...), a VISSL / SEER checkpoint (classy_state_dict -> "
        "base_model -> model -> trunk with _feature_blocks.conv1.stem.0.weight, "
        "_feature_blocks.res2.block1-0.f.a.0.weight, ...) or ClassyVision's (stem.stem.0.weight, "
        f"...), possibly under one of {list(_WRAPPER_KEYS)}; model.trunk must name the network "
        "the file holds."
    )


def load_regnet_state_dict(path: str) -> tuple[str, dict[str, np.ndarray]]:
    """``(layout, state dict)`` of a PyTorch RegNet file: numpy arrays under the names of
    ``LAYOUTS[layout]``, wrappers and prefixes removed (``torch.load(weights_only=True)``)."""
    anchor_layout = _find_layout(path) or "torchvision"  # unreadable: the read below says why
    state = load_torch_state_dict(path, _ANCHORS[anchor_layout])
    if anchor_layout == "vissl":
        state = {re.sub(r"^(res\d+)\.block\d+-part\d+\.", r"\1.", k): v for k, v in state.items()}
        return "vissl", state
    return ("classy" if "stem.stem.0.weight" in state else "torchvision"), state


def _stages_in(state: Mapping[str, Any], layout: str) -> list[tuple[int, int, int]]:
    """``(width, blocks, group width)`` of each stage the checkpoint holds, as ``stages``."""
    found = []
    while True:
        stage = len(found) + 1
        conv = torch_name(layout, (f"block{stage}_0", "b", "kernel"))
        if conv not in state:
            return found
        blocks = 1
        while torch_name(layout, (f"block{stage}_{blocks}", "b", "kernel")) in state:
            blocks += 1
        width, group_width = np.shape(state[conv])[:2]  # OIHW: I is the group width
        found.append((int(width), blocks, int(group_width)))


def _size_name(design: Design) -> str | None:
    return next((name for name, size in SIZES.items() if size == design), None)


def _hint(state: Mapping[str, Any], layout: str, trunk: RegNet, read_as: str) -> str:
    """Which ``--config.model.trunk`` the checkpoint's stage widths and depths are."""
    found = _stages_in(state, layout)
    match = next((name for name, size in SIZES.items() if stages(size) == found), None)
    described = f"stages (width, blocks, group width) {found}"
    wanted = stages(Design(trunk.depth, trunk.w_0, trunk.w_a, trunk.w_m, trunk.group_width))
    if match:
        return (
            f"The checkpoint looks like {match} ({described}); it was read as {read_as} "
            f"({wanted}): set --config.model.trunk={match}."
        )
    return (
        f"The checkpoint has {described}, none of jssl's RegNet sizes ({', '.join(SIZES)}); "
        f"it was read as {read_as} ({wanted}). Set --config.model.trunk to the size the file "
        "was trained with."
    )


def torch_regnet_to_flax(
    state_dict: Mapping[str, np.ndarray], trunk: RegNet, layout: str = "torchvision"
) -> dict[str, Any]:
    """RegNet weights named as in ``LAYOUTS[layout]`` -> ``{"params", "batch_stats"}`` of
    ``trunk``.

    Conv kernels (the SE block's included) go from OIHW to HWIO, grouped ones keeping their
    (in / groups) axis; BN weight/bias become scale/bias, running mean/var ``batch_stats``.
    ``num_batches_tracked`` and keys outside the trunk (``fc``, heads) are ignored. A missing
    or extra trunk key or a shape that differs is a ValueError naming the first one and the
    ``--config.model.trunk`` the checkpoint looks like.
    """
    spec = LAYOUTS[layout]
    design = Design(trunk.depth, trunk.w_0, trunk.w_a, trunk.w_m, trunk.group_width)
    read_as = _size_name(design) or f"a RegNet of {design}"
    shapes = jax.eval_shape(
        lambda: trunk.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)
    )
    expected = {
        key: tuple(leaf.shape)
        for key, leaf in traverse_util.flatten_dict(dict(shapes)).items()
        if key[0] in ("params", "batch_stats")
    }
    by_name = {torch_name(layout, key[1:]): key for key in sorted(expected, key=_order)}
    problems = []
    for name, key in by_name.items():
        if name not in state_dict:
            problems.append(f"{name}: missing in the checkpoint")
        elif (shape := np.shape(state_dict[name])) != _torch_shape(expected[key]):
            problems.append(
                f"{name}: checkpoint {shape}, model {_torch_shape(expected[key])} (jssl "
                f"{'/'.join(key)} {expected[key]})"
            )
    trunk_keys = [
        k for k in state_dict if spec.trunk_key.match(k) and not k.endswith("num_batches_tracked")
    ]
    problems += [f"{k}: not in the model" for k in trunk_keys if k not in by_name]
    if problems:
        raise ValueError(
            f"PyTorch RegNet weights ({layout} layout) do not fit jssl's {read_as}: "
            f"{len(problems)} differences, the first {problems[0]}"
            + (f"; then {_summarise(problems[1:], 4)}" if len(problems) > 1 else "")
            + f".\n{_hint(state_dict, layout, trunk, read_as)}"
            f"{_hint(state_dict, layout, trunk, read_as)}"
        )
    ignored = [k for k in state_dict if k not in by_name and not k.endswith("num_batches_tracked")]
    if ignored:
        logging.info("Ignoring %d non-trunk keys, e.g. %s", len(ignored), ignored[:3])
    flat = {}
    for name, key in by_name.items():
        value = np.asarray(state_dict[name], np.float32)
        flat[key] = value.transpose(2, 3, 1, 0) if value.ndim == 4 else value  # OIHW -> HWIO
    return traverse_util.unflatten_dict(flat)


def _torch_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """An HWIO kernel's shape as PyTorch's OIHW."""
    return (shape[3], shape[2], shape[0], shape[1]) if len(shape) == 4 else shape


def import_torch_regnet(path: str, model_config: ml_collections.ConfigDict) -> dict[str, Any]:
    """Load + convert a RegNet file for ``build_trunk(model_config)``: ``{"params": {"trunk":
    ...}, "batch_stats": {"trunk": ...}}``, to replace a ``TrunkAndHead``'s trunk. A
    classifier (torchvision's ``fc``, VISSL's heads) is dropped: jssl evaluates its own."""
    layout, state = load_regnet_state_dict(path)
    logging.info("Reading %s as a RegNet in the %s layout", path, layout)
    variables = torch_regnet_to_flax(state, build_trunk(model_config), layout)
    return {collection: {"trunk": tree} for collection, tree in variables.items()}
