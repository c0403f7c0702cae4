"""Loading trained weights for evaluation and initialisation: the one place that does it.

``load_variables(path, config)`` returns ``{"params", "batch_stats"}`` of the online model
(trunk + head) that ``jssl.methods.get(config)`` builds, replicated over the mesh, from

- a jssl workdir (its newest checkpoint), its ``checkpoints`` directory, or one step
  directory ``workdir/checkpoints/<step>``: only ``params`` and ``batch_stats`` of the saved
  TrainState are read (orbax partial restore), so the optimizer, the momentum encoder and
  the queue are never loaded and the optimizer config does not have to match;
- a PyTorch ResNet file (``.torch`` from VISSL's model zoo, ``.pth``/``.pt`` from
  torchvision or MoCo): the trunk comes from the file, the head stays randomly initialised.

This plays the part of VISSL's ``MODEL.WEIGHTS_INIT.PARAMS_FILE`` handling
(``vissl/utils/checkpoint.py``, ``init_model_from_consolidated_weights``).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp
from absl import logging
from flax import traverse_util
from jax.sharding import Mesh

from jssl import methods, parallel

TORCH_SUFFIXES = (".torch", ".pth", ".pt")
_COLLECTIONS = ("params", "batch_stats")


class WeightsError(ValueError):
    """The weights could not be found or do not fit the configured model."""


def abstract_variables(config: ml_collections.ConfigDict, model: Any = None) -> dict[str, Any]:
    """Shapes and dtypes of ``{"params", "batch_stats"}`` of the configured online model."""
    model = methods.get(config).model if model is None else model
    size = config.data.image_size
    variables = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3)), train=False)
    )
    return {name: dict(variables.get(name, {})) for name in _COLLECTIONS}


def load_variables(
    path: str, config: ml_collections.ConfigDict, *, mesh: Mesh | None = None
) -> dict[str, Any]:
    """``{"params", "batch_stats"}`` of ``methods.get(config).model`` loaded from ``path``.

    Args:
      path: a jssl workdir, its ``checkpoints`` dir, a step dir ``checkpoints/<step>``, or a
        PyTorch ResNet file ending in .torch/.pth/.pt (trunk only, the head stays random).
      config: the run config; ``config.model`` must describe the architecture the weights
        were trained with, ``config.seed`` seeds the random head of imported trunks.
      mesh: the arrays come back replicated over it (default: all devices).

    Raises:
      WeightsError: nothing to load at ``path``, or the weights do not fit ``config.model``.
    """
    if not path:
        raise WeightsError(
            "No weights given: set --config.init.checkpoint to a jssl workdir (e.g. runs/demo), "
            "a checkpoint step dir (runs/demo/checkpoints/<step>) or a .torch/.pth file."
        )
    mesh = parallel.make_mesh() if mesh is None else mesh
    model = methods.get(config).model
    if path.endswith(TORCH_SUFFIXES):
        return _load_torch(path, config, model, mesh)
    state_dir = resolve_checkpoint(path)
    expected = abstract_variables(config, model)
    _check_architecture(state_dir, expected, config)
    sharding = parallel.replicated(mesh)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), expected
    )
    restored = ocp.PyTreeCheckpointer().restore(
        state_dir,
        args=ocp.args.PyTreeRestore(
            item=target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True,
        ),
    )
    logging.info("Loaded params and batch_stats of the online model from %s", state_dir)
    return {name: restored[name] for name in _COLLECTIONS}


def resolve_checkpoint(path: str) -> str:
    """The ``state`` directory of the newest complete checkpoint that ``path`` points at."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise WeightsError(
            f"Checkpoint path {path} does not exist. Pass the workdir of a jssl training run "
            "(e.g. --config.init.checkpoint=runs/demo after `python launch.py "
            "--config=configs/moco.py:demo --workdir=runs/demo`), a step dir inside its "
            "checkpoints/, or a .torch/.pth file."
        )
    if os.path.isdir(os.path.join(path, "state")):  # a step dir
        return os.path.join(path, "state")
    ckpt_dir = path
    if os.path.isdir(os.path.join(path, "checkpoints")):  # a workdir
        ckpt_dir = os.path.join(path, "checkpoints")
    steps = sorted(
        (int(name) for name in os.listdir(ckpt_dir) if name.isdigit()),
        reverse=True,
    )
    for step in steps:
        step_dir = os.path.join(ckpt_dir, str(step))
        # orbax renames a step dir into place once it is complete; older layouts mark it.
        if os.path.isdir(os.path.join(step_dir, "state")):
            logging.info("Using checkpoint step %d of %s", step, ckpt_dir)
            return os.path.join(step_dir, "state")
    raise WeightsError(
        f"No checkpoint found in {path}: expected a jssl workdir with checkpoints/<step>/state, "
        "a checkpoints dir, or a step dir. Has the training run saved one yet (checkpoints "
        "are written at the end of every epoch)?"
    )


def _check_architecture(
    state_dir: str, expected: dict[str, Any], config: ml_collections.ConfigDict
) -> None:
    """Compares saved shapes with the configured model, naming the first differences."""
    metadata = ocp.PyTreeCheckpointer().metadata(state_dir)
    tree = getattr(metadata, "item_metadata", metadata)
    tree = getattr(tree, "tree", tree)
    missing_collections = [name for name in _COLLECTIONS if name not in tree]
    if missing_collections:
        raise WeightsError(
            f"{state_dir} is not a jssl TrainState checkpoint (no {missing_collections}); "
            f"it holds {sorted(tree)}."
        )
    problems = []
    for name in _COLLECTIONS:
        saved = traverse_util.flatten_dict(dict(tree[name]), sep="/")
        wanted = traverse_util.flatten_dict(expected[name], sep="/")
        problems += [f"{name}/{k}: missing in the checkpoint" for k in wanted if k not in saved]
        problems += [f"{name}/{k}: not in the configured model" for k in saved if k not in wanted]
        problems += [
            f"{name}/{k}: checkpoint {tuple(saved[k].shape)}, model {tuple(v.shape)}"
            for k, v in wanted.items()
            if k in saved and tuple(saved[k].shape) != tuple(v.shape)
        ]
    if problems:
        shown = "\n  ".join(problems[:8])
        more = f"\n  ... ({len(problems)} differences in all)" if len(problems) > 8 else ""
        m = config.model
        raise WeightsError(
            f"The checkpoint {state_dir} does not fit the configured model (trunk={m.trunk}, "
            f"width_multiplier={m.width_multiplier}, cifar_stem={m.cifar_stem}, "
            f"head_dims={tuple(m.head_dims)}, head_bn={m.head_bn}):\n  {shown}{more}\n"
            "Use the model config the checkpoint was trained with (e.g. the same configs/*.py "
            "preset and --config.model.* overrides; the workdir's config.json has them)."
        )


def _load_torch(path: str, config: ml_collections.ConfigDict, model: Any, mesh: Mesh):
    if not os.path.isfile(path):
        raise WeightsError(f"PyTorch weights file {path} does not exist.")
    from jssl.models import torch_import

    imported = torch_import.import_torch_resnet(path, config.model)
    size = config.data.image_size
    init = jax.jit(
        lambda rng: model.init(rng, jnp.zeros((1, size, size, 3)), train=False),
        out_shardings=parallel.replicated(mesh),
    )
    fresh = init(jax.random.PRNGKey(config.seed))
    variables = {name: dict(fresh.get(name, {})) for name in _COLLECTIONS}
    for name in _COLLECTIONS:
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
