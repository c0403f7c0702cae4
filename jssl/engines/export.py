"""The export engine: a trained trunk written as a PyTorch state dict, so a backbone trained
with jssl can go to detection or segmentation code in PyTorch.

The trunk is read as the evaluation engines read it (``jssl.evaluation.frozen``): a workdir at
its newest complete checkpoint, whose step is recorded, one ``checkpoints/<step>`` dir or a
PyTorch / safetensors file; a damaged newest checkpoint stops the export (pass an older
``checkpoints/<step>``) rather than silently exporting another. ``jssl.models.torch_export``
names it as torchvision does (ResNet), timm (ViT) or DINOv2 (a ViT with LayerScale, registers
or SwiGLU, with the trained mask token of an iBOT or DINOv2 checkpoint). Writes
``trunk.safetensors`` (without torch), ``trunk.pth`` (where torch imports and ``export.pth``
is set) and ``export.json`` (the architecture and the PyTorch constructor that builds it);
``trunk.safetensors`` is imported back first and must give the checkpoint's arrays bit for
bit. More: docs/evaluation.md, "Export to PyTorch".
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import traverse_util

from jssl import parallel
from jssl.checkpoints import weights
from jssl.evaluation import frozen
from jssl.models import torch_export

SAFETENSORS = "trunk.safetensors"
PTH = "trunk.pth"
DESCRIPTION = "export.json"


def validate(config: ml_collections.ConfigDict) -> None:
    """The export engine's start-up checks, run before anything is written."""
    if "export" not in config:
        raise ValueError(
            "engine='export' needs the fields of configs/export.py: run "
            "--config=configs/export.py:demo (or its '' / 'test' presets)."
        )
    if not config.init.checkpoint:
        raise ValueError(
            "engine='export' writes the trunk of trained weights: set "
            "--config.init.checkpoint to a jssl workdir (e.g. runs/demo), one of its "
            "checkpoints/<step> dirs, or a .torch/.pth/.safetensors file."
        )
    torch_export.check_exportable(config.model)


def _source(path: str) -> tuple[str, int | None]:
    """(what to read, its step): a file as it is; for a workdir or checkpoints dir, the step dir
    of its newest complete checkpoint, read explicitly so that the step recorded is the one
    exported."""
    if path.endswith(weights.TORCH_SUFFIXES):
        return os.path.abspath(path), None
    step_dir = os.path.dirname(weights.resolve_checkpoint(path))
    return step_dir, int(os.path.basename(step_dir))


def _trained_mask_token(source: str) -> np.ndarray | None:
    """The trunk's mask token saved at ``source`` (a step dir), None where it has none or is a
    PyTorch file. The evaluated trunk is built without it (``weights.TRAINING_ONLY``), but
    DINOv2's layout holds one: the trained one, not zeros, is exported."""
    if source.endswith(weights.TORCH_SUFFIXES):
        return None

    def read(state_dir: str) -> np.ndarray | None:
        shape = weights.saved_shapes(state_dir).get(weights.MASK_TOKEN)
        if shape is None:
            return None
        return weights.read_arrays(state_dir, {weights.MASK_TOKEN: shape})[weights.MASK_TOKEN]

    return weights.read_newest(source, read)[1]


def _host(tree: Any) -> Any:
    """Host numpy copies of replicated arrays (this process's copy: no collective)."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def _check_round_trip(path: str, config: ml_collections.ConfigDict, trunk: dict[str, Any]) -> None:
    """Imports the written safetensors back; every array must equal the exported one."""
    imported = weights.read_torch(path, config)
    for collection, tree in trunk.items():
        expected = traverse_util.flatten_dict(tree)
        got = traverse_util.flatten_dict(imported.get(collection, {}).get("trunk", {}))
        wrong = [k for k in expected if k not in got or not np.array_equal(got[k], expected[k])]
        if wrong or set(got) != set(expected):
            raise RuntimeError(
                f"Importing {path} back does not give the exported {collection} (e.g. "
                f"{['/'.join(k) for k in wrong][:3]}): the export mapping is broken; please "
                "report it."
            )


def _write_atomic(path: str, write) -> None:
    """``write(partial)``, then renamed into place, readable by all (safetensors creates its
    files 0600; an export is for sharing)."""
    partial = path + ".partial"
    write(partial)
    os.chmod(partial, 0o644)
    os.replace(partial, path)


def _write_json(path: str, value: Any) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(value, indent=2) + "\n")


def _save_pth(state: dict[str, np.ndarray], path: str) -> bool:
    """``torch.save`` of ``state`` as tensors; False (logged) where torch is not installed."""
    try:
        import torch
    except ImportError:
        logging.info("torch is not installed: %s not written (trunk.safetensors has it all).", path)
        return False
    tensors = {k: torch.from_numpy(np.array(v)) for k, v in state.items()}
    _write_atomic(path, lambda p: torch.save(tensors, p))
    return True


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Writes the trunk of ``init.checkpoint`` to ``workdir``; returns the paths written, the
    source, its step and the number of tensors and parameters."""
    from safetensors.numpy import save_file

    validate(config)
    given = config.init.checkpoint
    try:
        source, step = _source(given)
        _, variables = frozen.load_frozen_model(
            config, parallel.make_mesh(), ("avgpool",), path=source
        )
        mask_token = _trained_mask_token(source)
    except weights.WeightsError as e:
        raise weights.WeightsError(f"init.checkpoint={given!r}: {e}") from e
    trunk = {name: tree["trunk"] for name, tree in _host(variables).items() if tree}
    state = torch_export.trunk_state_dict(
        config.model, trunk, num_batches_tracked=step or 0, mask_token=mask_token
    )
    described = torch_export.pytorch_model(config.model, mask_token is not None)
    trunk_name = str(config.model.trunk)
    summary = {
        "safetensors": os.path.join(workdir, SAFETENSORS),
        "pth": None,
        "export_json": os.path.join(workdir, DESCRIPTION),
        "source": source,
        "step": step,
        "trunk": trunk_name,
        "num_tensors": len(state),
        "num_parameters": int(sum(np.size(v) for v in jax.tree.leaves(trunk.get("params")))),
    }
    if jax.process_index() == 0:
        metadata = {"format": "pt", "jssl_trunk": trunk_name, "jssl_step": str(step)}
        _write_atomic(summary["safetensors"], lambda p: save_file(state, p, metadata=metadata))
        try:
            _check_round_trip(summary["safetensors"], config, trunk)
        except BaseException:
            os.remove(summary["safetensors"])
            raise
        pth = os.path.join(workdir, PTH)
        if config.export.pth and _save_pth(state, pth):
            summary["pth"] = pth
        elif os.path.exists(pth):
            os.remove(pth)  # an earlier export's, which trunk.safetensors no longer matches
        files = {"safetensors": SAFETENSORS, "pth": PTH if summary["pth"] else None}
        description = {
            "files": files,
            "source": {"checkpoint": summary["source"], "step": step},
            **described,
            "load": _load_snippet(described["pytorch"]),
        }
        _write_atomic(summary["export_json"], lambda p: _write_json(p, description))
        library = described["pytorch"]["library"]
        at_step = f" (step {step})" if step is not None else ""
        lines = [
            f"Exported the {trunk_name} trunk of {source}{at_step} as a {library} state dict: "
            f"{len(state)} tensors, {summary['num_parameters']:,} parameters.",
            *(f"  {summary[k]}" for k in ("safetensors", "pth", "export_json") if summary[k]),
        ]
        if not described["pytorch"]["builds_exactly"]:
            lines += [f"  note: {n}" for n in described["notes"] if "width_multiplier=" in n]
        logging.info("\n".join(lines))
        print("\n".join(lines), flush=True)
    return summary


def _load_snippet(pytorch: dict[str, Any]) -> list[str]:
    """The lines of PyTorch that build the model and load the safetensors file."""
    module, _, name = pytorch["constructor"].rpartition(".")
    kwargs = ", ".join(f"{k}={v!r}" for k, v in pytorch["kwargs"].items())
    return [
        f"import torch, safetensors.torch, {module.split('.')[0]}",
        f"model = {module}.{name}({kwargs})",
        *pytorch["after"],
        f"model.load_state_dict(safetensors.torch.load_file({SAFETENSORS!r}))",
    ]
