"""Loading trained weights for evaluation and initialisation: the one place that reads them.

Sources (``init.checkpoint``): a jssl workdir (its newest readable checkpoint), its
``checkpoints`` directory or one step directory ``checkpoints/<step>``, of which only the parts
asked for are read (orbax partial restore: the optimizer config need not match); or a PyTorch
ResNet (VISSL ``.torch``, torchvision / MoCo ``.pth``) or ViT (timm, DINO, MoCo v3, DINOv2)
file, or ``.safetensors`` of either: the trunk only. The users: ``load_variables``, the online
model's ``{"params", "batch_stats"}`` for the evaluation engines (through
jssl.evaluation.frozen; with ``trunk_only`` the trunk alone, so any method's workdir
evaluates); ``checkpoints.warm_start.init_train_state``, a fresh TrainState started from those
weights (through ``read_newest``, ``saved_shapes``, ``read_arrays`` and ``read_torch``); and
``read_state_fields``, the whole state but the optimizer, for the test loss. From a workdir an
incomplete or corrupt checkpoint (``integrity``'s verdict) is skipped, loudly, for the next
older one; an explicit step dir is never replaced. Other read errors propagate.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import traverse_util
from jax.sharding import Mesh

from jssl import methods, models, parallel
from jssl.checkpoints import integrity

# What must fit and the mismatch advice live in fit; re-exported here for the loader's users.
from jssl.checkpoints.fit import (  # noqa: F401
    COLLECTIONS,
    MASK_TOKEN,
    STRICT,
    TRAINING_ONLY,
    Flat,
    describe_model,
    differences,
    match_hint,
    natural_key,
)

TORCH_SUFFIXES = (".torch", ".pth", ".pt", ".safetensors")
_VALID = (
    "Pass the workdir of a jssl training run (e.g. runs/demo, which holds "
    "checkpoints/<step>/state/), its checkpoints/ dir, one step dir checkpoints/<step>, or a "
    "PyTorch ResNet or ViT file ending in .torch/.pth/.pt/.safetensors."
)


class WeightsError(ValueError):
    """The weights could not be found or do not fit the configured model."""


def abstract_variables(config: ml_collections.ConfigDict, model: Any = None) -> dict[str, Any]:
    """Shapes and dtypes of ``{"params", "batch_stats"}`` of the configured online model."""
    model = methods.get(config).model if model is None else model
    size = config.data.image_size
    variables = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3)), train=False)
    )
    return {name: dict(variables.get(name, {})) for name in COLLECTIONS}


def trunk_model(config: ml_collections.ConfigDict) -> models.TrunkAndHead:
    """The configured trunk alone (``model.head_dims=()``), whatever the method's head."""
    model_config = ml_collections.ConfigDict(config.model.to_dict())
    model_config.head_dims = ()
    return models.build_model(model_config)


def load_variables(
    path: str,
    config: ml_collections.ConfigDict,
    *,
    mesh: Mesh | None = None,
    trunk_only: bool = False,
    model: Any = None,
    abstract: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``{"params", "batch_stats"}`` of ``methods.get(config).model`` (or ``model``) loaded
    from ``path``.

    Args:
      path: a jssl workdir, its ``checkpoints`` dir, a step dir ``checkpoints/<step>``, or a
        PyTorch ResNet file ending in .torch/.pth/.pt/.safetensors (trunk only, the head
        stays random).
        A workdir's newest checkpoint, if incomplete or corrupt, is skipped (with an error
        logged) for the newest readable one; a step dir is read as given or not at all.
      config: the run config; ``config.model`` must describe the architecture the weights
        were trained with, ``config.seed`` seeds the random head of imported trunks.
      mesh: the arrays come back replicated over it (default: all devices).
      trunk_only: read only the trunk (the variables of ``trunk_model(config)``); the saved
        head, whatever its shape, is neither read nor checked.
      model: the flax model to load into, when not the one ``config`` builds (an evaluation
        reading a head with the method of the evaluated workdir).
      abstract: the ``{"params", "batch_stats"}`` shapes to read, when not those that
        ``model.init`` builds (every leaf the method trained: ``jssl.evaluation.frozen``).

    Only the top-level parts of the model (``trunk``, ``head``) are read and checked: a network
    it does not apply (a predictor, prototypes, MAE's decoder) is not. A ``TRAINING_ONLY``
    leaf of the checkpoint that the model lacks (the mask token) is left out, logged.

    Raises:
      WeightsError: nothing readable at ``path``, or the weights do not fit ``config.model``.
    """
    if not path:
        raise WeightsError(
            "No weights given: set --config.init.checkpoint to a jssl workdir (e.g. runs/demo), "
            "a checkpoint step dir (runs/demo/checkpoints/<step>) or a .torch/.pth file."
        )
    mesh = parallel.make_mesh() if mesh is None else mesh
    if model is None:
        model = trunk_model(config) if trunk_only else methods.get(config).model
    if path.endswith(TORCH_SUFFIXES):
        return _load_torch(path, config, model, mesh)
    expected = abstract_variables(config, model) if abstract is None else abstract
    sharding = parallel.replicated(mesh)
    # An empty collection (a ViT trunk has no batch_stats) is left out of the restore target:
    # orbax cannot trim a saved subtree to an empty dict.
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        {name: tree for name, tree in expected.items() if tree},
    )

    def read(state_dir: str) -> dict[str, Any]:
        saved = _parts_of(state_dir, saved_shapes(state_dir), expected)
        _check_architecture(state_dir, saved, expected, config)
        return _restore(state_dir, target, ocp.checkpoint_utils.construct_restore_args(target))

    state_dir, restored = read_newest(path, read)
    part = "trunk" if trunk_only else "online model"
    logging.info("Loaded params and batch_stats of the %s from %s", part, state_dir)
    return {name: restored.get(name, {}) for name in COLLECTIONS}


def read_state_fields(
    path: str, target: dict[str, Any], config: ml_collections.ConfigDict
) -> tuple[str, dict[str, Any]]:
    """``(state_dir, fields)``: the TrainState fields of ``target`` (field name -> tree of
    ``jax.ShapeDtypeStruct`` with shardings) read from the newest readable checkpoint at
    ``path``; the rest (the optimizer state) is not read. For what needs more of the trained
    state than the online model: the method's own loss needs its teacher and queue too.
    ``params`` and ``batch_stats`` must fit ``config.model`` (named in the error otherwise)."""

    def read(state_dir: str) -> dict[str, Any]:
        saved = saved_shapes(state_dir)
        expected = {name: target.get(name, {}) for name in COLLECTIONS}
        _check_architecture(state_dir, saved, expected, config)
        args = ocp.checkpoint_utils.construct_restore_args(target)
        return _restore(state_dir, target, args)

    return read_newest(path, read)


def resolve_checkpoint(path: str) -> str:
    """The ``state`` directory of the newest checkpoint that ``path`` points at whose save
    completed (it is not read here, so it may still turn out corrupt; ``load_variables``
    then falls back to an older one)."""
    return _candidates(path)[0][0]


def _candidates(path: str) -> tuple[list[str], bool]:
    """``state`` dirs at ``path``, newest first, and whether ``path`` named one explicitly."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise WeightsError(
            f"Checkpoint path {path} does not exist. {_VALID} For example "
            "--config.init.checkpoint=runs/demo after `python launch.py "
            "--config=configs/moco.py:demo --workdir=runs/demo`."
        )
    if not os.path.isdir(path):
        raise WeightsError(f"{path} is a file, not a PyTorch checkpoint. {_VALID}")
    parent = os.path.basename(os.path.dirname(path))
    if os.path.basename(path) == "state" and parent.isdigit():  # the state dir itself
        return [path], True
    if os.path.isdir(os.path.join(path, "state")):  # a step dir
        return [os.path.join(path, "state")], True
    if os.path.basename(path).isdigit() and parent == "checkpoints":
        raise WeightsError(
            f"The step dir {path} has no state/ subdirectory: its save never completed or "
            f"it was damaged. Pass the workdir ({os.path.dirname(os.path.dirname(path))}) to "
            "use its newest complete checkpoint, or another step dir."
        )
    ckpt_dir = path
    if os.path.isdir(os.path.join(path, "checkpoints")):  # a workdir
        ckpt_dir = os.path.join(path, "checkpoints")
    entries = sorted(os.listdir(ckpt_dir))
    found = []
    for step in sorted((int(e) for e in entries if e.isdigit()), reverse=True):
        state_dir = os.path.join(ckpt_dir, str(step), "state")
        if os.path.isdir(state_dir):
            found.append(state_dir)
        else:
            logging.warning("Skipping %s: it has no state/ (an incomplete save).", state_dir)
    if not found:
        listing = ", ".join(entries[:8]) + (" ..." if len(entries) > 8 else "") or "nothing"
        raise WeightsError(
            f"No checkpoint found in {path} (it holds: {listing}). {_VALID} Has the training "
            "run saved one yet (checkpoints are written at the end of every epoch)?"
        )
    return found, False


def read_newest(path: str, read: Callable[[str], Any]) -> tuple[str, Any]:
    """``(state_dir, read(state_dir))`` for the newest checkpoint at ``path`` that reads.

    Falls back to older checkpoints only past ones that are really incomplete or corrupt,
    and only when ``path`` is a workdir or checkpoints dir; the skipped ones are left as
    they are (an evaluation must not modify a training workdir).
    """
    candidates, explicit = _candidates(path)
    failures = []
    for state_dir in candidates:
        try:
            return state_dir, read(state_dir)
        except WeightsError:
            raise
        except Exception as e:  # noqa: BLE001 - classified below, re-raised unless damaged
            # Damage is decided by reading the files back, as the train engine's resume does.
            step_dir, item = os.path.split(state_dir)
            verdict, reason = integrity.diagnose(step_dir, e, pytrees=(item,), jsons=())
            if verdict != "damaged":
                logging.error("Reading the checkpoint %s failed: %s", state_dir, e)
                raise
            if explicit:
                raise WeightsError(
                    f"The checkpoint {state_dir} is incomplete or corrupt ({reason}). Pass the "
                    "workdir or its checkpoints/ dir to use the newest readable checkpoint, "
                    "or another step dir."
                ) from e
            logging.error(
                "Skipping the checkpoint %s: it is incomplete or corrupt (%s); trying the next "
                "older one. It is left in place; move it away once inspected.",
                os.path.dirname(state_dir),
                reason,
            )
            failures.append(f"  {os.path.dirname(state_dir)}: {reason}")
    raise WeightsError(
        f"Every checkpoint at {path} is incomplete or corrupt:\n" + "\n".join(failures) + "\n"
        "Pass another workdir or a .torch/.pth file, or retrain."
    )


def saved_shapes(state_dir: str) -> Flat:
    """``(collection, *path) -> shape`` of ``params`` and ``batch_stats`` in a saved state.

    Reads orbax's metadata through the handler, which raises on damaged files (the
    Checkpointer's ``metadata`` logs and returns None instead).
    """
    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree = handler.metadata(epath.Path(state_dir))
    finally:
        handler.close()
    tree = getattr(tree, "tree", tree)
    missing = [name for name in COLLECTIONS if name not in tree]
    if missing:
        raise WeightsError(
            f"{state_dir} is not a jssl TrainState checkpoint (no {missing}); it holds "
            f"{sorted(tree)}. {_VALID}"
        )
    return {
        (name, *key): tuple(leaf.shape)
        for name in COLLECTIONS
        for key, leaf in traverse_util.flatten_dict(dict(tree[name])).items()
    }


def read_arrays(state_dir: str, shapes: Flat) -> Flat:
    """The arrays at the keys of ``shapes`` (``(collection, *path) -> shape``) of a saved state,
    as host float32 numpy arrays; the rest of the checkpoint is not read."""
    target = traverse_util.unflatten_dict(
        {key: jax.ShapeDtypeStruct(shape, np.float32) for key, shape in shapes.items()}
    )
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    return traverse_util.flatten_dict(_restore(state_dir, target, args))


def _restore(state_dir: str, target: Any, restore_args: Any) -> Any:
    return ocp.PyTreeCheckpointer().restore(
        state_dir,
        args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True),
    )


def _parts_of(state_dir: str, saved: Flat, expected: dict[str, Any]) -> Flat:
    """The saved shapes of the model's top-level parts, less the ``TRAINING_ONLY`` leaves the
    model lacks (logged): what the model must fit. Another network of the method (a
    predictor, prototypes, a decoder) is not the model's, so it is neither read nor checked."""
    parts = {part for name in COLLECTIONS for part in expected[name]}
    saved = {key: shape for key, shape in saved.items() if key[1] in parts}
    left_out = [key for key in TRAINING_ONLY if key in saved and not _holds(expected, key)]
    if left_out:
        logging.info(
            "Not reading %s of %s: used only in training, and the evaluated model has none.",
            ", ".join("/".join(key) for key in left_out),
            state_dir,
        )
    return {key: shape for key, shape in saved.items() if key not in left_out}


def _holds(tree: dict[str, Any], key: tuple[str, ...]) -> bool:
    """Whether the ``{"params", "batch_stats"}`` tree has a leaf at ``(collection, *path)``."""
    return key[1:] in traverse_util.flatten_dict(dict(tree.get(key[0], {})))


def _check_architecture(
    state_dir: str, saved: Flat, expected: dict[str, Any], config: ml_collections.ConfigDict
) -> None:
    """Compares saved shapes with the configured model, naming the first differences."""
    wanted = {
        (name, *key): tuple(v.shape)
        for name in COLLECTIONS
        for key, v in traverse_util.flatten_dict(expected[name]).items()
    }
    problems = differences(saved, wanted, lambda key: True)
    if problems:
        shown = "\n  ".join(line for _, line in problems[:8])
        more = f"\n  ... ({len(problems)} differences in all)" if len(problems) > 8 else ""
        model = describe_model(config)
        hint = match_hint(state_dir, config, [key for key, _ in problems])
        raise WeightsError(
            f"The checkpoint {state_dir} does not fit the configured model ({model})"
            f":\n  {shown}{more}\n{hint}"
        )


def read_torch(path: str, config: ml_collections.ConfigDict) -> dict[str, Any]:
    """``{"params", "batch_stats"}`` host trees imported from a PyTorch ResNet or RegNet file
    (only ``params`` from a ViT file: a ViT has no batch statistics)."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise WeightsError(f"PyTorch weights file {path} does not exist. {_VALID}")
    from jssl import models
    from jssl.models import regnet_import, torch_import, vit_import

    try:
        if models.is_vit(config.model):
            return vit_import.import_torch_vit(path, config.model)
        if models.is_regnet(config.model):
            return regnet_import.import_torch_regnet(path, config.model)
        return torch_import.import_torch_resnet(path, config.model)
    except ValueError as e:
        raise WeightsError(f"init.checkpoint {path}: {e}") from e


def _load_torch(path: str, config: ml_collections.ConfigDict, model: Any, mesh: Mesh):
    imported = read_torch(path, config)
    size = config.data.image_size
    init = jax.jit(
        lambda rng: model.init(rng, jnp.zeros((1, size, size, 3)), train=False),
        out_shardings=parallel.replicated(mesh),
    )
    fresh = init(jax.random.PRNGKey(config.seed))
    variables = {name: dict(fresh.get(name, {})) for name in COLLECTIONS}
    for name in COLLECTIONS:
        trunk = imported.get(name, {}).get("trunk")
        if trunk is None:
            continue
        shapes = jax.tree.map(lambda x: x.shape, variables[name]["trunk"])
        if jax.tree.map(lambda x: x.shape, trunk) != shapes:
            raise WeightsError(
                f"The trunk {name} imported from {path} do not fit config.model; use the model "
                "config of the network the file holds."
            )
        variables[name]["trunk"] = jax.device_put(trunk, parallel.replicated(mesh))
    if "head" in variables["params"]:
        logging.warning(
            "Imported the trunk from %s; the head (model.head_dims=%s) is randomly initialised.",
            path,
            tuple(config.model.head_dims),
        )
    return variables
