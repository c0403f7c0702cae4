"""A trained model frozen for evaluation: the online network (the trunk alone, or with its head)
of ``init.checkpoint`` in eval mode, for the kNN, linear and extraction engines, and the whole
trained state of a method (``load_train_state``) for its own loss on held-out data."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging

from jssl import methods
from jssl.checkpoints import source_model, weights
from jssl.training import fresh


def trunk_forward(
    config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, layers: Sequence[str]
) -> Callable[[jax.Array], Mapping[str, jax.Array]]:
    """Eval-mode taps of the model in ``init.checkpoint`` on a sharded image batch."""
    model, variables = load_frozen_model(config, mesh, layers)
    apply = jax.jit(lambda v, images: model.apply(v, images, train=False))
    return lambda images: apply(variables, images)


def load_frozen_model(
    config: ml_collections.ConfigDict,
    mesh: jax.sharding.Mesh,
    layers: Sequence[str],
    path: str = "",
):
    """(flax model, replicated variables) of the online network at ``path`` (default
    ``init.checkpoint``): the trunk alone unless ``layers`` asks for the ``head`` output, so a
    workdir of any method (its own head, predictor or prototypes) is evaluated with the
    trunk's model fields; the head is the method's, as recorded by the evaluated workdir, with
    every leaf the method's init gave it (iBOT's patch head included)."""
    path = _weights_path(config, path)
    trunk_only = "head" not in layers
    abstract = None
    if trunk_only:
        model = weights.trunk_model(config)
    else:
        method = methods.get(source_model.method_config(config, path))
        model, abstract = method.model, _method_variables(method, config)
    variables = weights.load_variables(
        path, config, mesh=mesh, trunk_only=trunk_only, model=model, abstract=abstract
    )
    logging.info("Evaluating the frozen weights of %s.", path)
    return model, variables


def _method_variables(method: methods.Method, config: ml_collections.ConfigDict) -> dict[str, Any]:
    """Shapes of ``{"params", "batch_stats"}`` of ``method.model`` as ``method.init`` builds
    them, i.e. every leaf training saved for it: an eval-mode call of the model builds fewer
    (iBOT's patch last layer, DINOv2's patch head, which only their patch losses apply). The
    method's other networks (predictor, prototypes, decoder) are left out: the model does not
    apply them."""
    size = config.data.image_size
    sample = jnp.zeros((1, size, size, 3))
    fields = jax.eval_shape(lambda: method.init(jax.random.PRNGKey(0), sample))
    parts = weights.abstract_variables(config, method.model)
    return {
        name: {k: v for k, v in dict(fields.get(name, {})).items() if k in parts[name]}
        for name in weights.COLLECTIONS
    }


def _weights_path(config: ml_collections.ConfigDict, path: str) -> str:
    path = path or config.init.checkpoint
    if not path:
        raise weights.WeightsError(
            f"engine={config.engine!r} evaluates a trained model: set "
            "--config.init.checkpoint to a jssl workdir (or checkpoint step dir, or a VISSL "
            ".torch / torchvision .pth file), or use features already extracted to disk."
        )
    return path


def load_frozen_model_recorded(
    config: ml_collections.ConfigDict,
    mesh: jax.sharding.Mesh,
    layers: Sequence[str],
    path: str = "",
) -> tuple[Any, Any, dict[str, Any]]:
    """``load_frozen_model`` with a record of what was read: ``{"checkpoint",
    "checkpoint_dir", "checkpoint_step"}``, the step dir of the newest readable checkpoint of
    a workdir (read as that one step dir, so that its step is known), or the weights file."""
    path = _weights_path(config, path)
    record: dict[str, Any] = {"checkpoint": os.path.abspath(path)}
    if path.endswith(weights.TORCH_SUFFIXES):
        model, variables = load_frozen_model(config, mesh, layers, path=path)
        record["checkpoint_step"] = None
        record["checkpoint_step_note"] = "a PyTorch/safetensors file records no training step"
        return model, variables, record

    def read(state_dir: str):
        try:
            return load_frozen_model(config, mesh, layers, path=state_dir)
        except weights.WeightsError as e:
            # A damaged step dir read on its own fails as a WeightsError caused by the read
            # error; raised as that error, read_newest diagnoses it and falls back to the
            # next older checkpoint, as load_variables does given the workdir.
            if e.__cause__ is not None:
                raise e.__cause__ from None
            raise

    state_dir, (model, variables) = weights.read_newest(path, read)
    step_dir = os.path.dirname(state_dir)
    record["checkpoint_dir"] = step_dir
    record["checkpoint_step"] = int(os.path.basename(step_dir))
    return model, variables, record


# The TrainState fields the method's loss reads; the optimizer state and the probe are not.
LOSS_FIELDS = (
    "step",
    "params",
    "batch_stats",
    "ema_params",
    "ema_batch_stats",
    "method_state",
    "rng",
)


def load_train_state(config: ml_collections.ConfigDict, method, mesh: jax.sharding.Mesh, path: str):
    """``(state, state_dir)``: the TrainState of ``method`` at ``path`` (the newest readable
    checkpoint of a workdir, or a step dir) with everything its loss reads (online model,
    teacher, queue or centre, step, key) and an empty optimizer state, laid out as training
    lays it out (``parallel.shard_params`` included)."""
    abstract = fresh.abstract_state(config, method, optax.identity(), mesh)
    target = {f: getattr(abstract, f) for f in LOSS_FIELDS if jax.tree.leaves(getattr(abstract, f))}
    state_dir, restored = weights.read_state_fields(path, target, config)
    state = fresh.init_state(config, method, optax.identity(), mesh).replace(**restored)
    logging.info("Evaluating the trained state of %s (step %d).", state_dir, int(state.step))
    return state, state_dir
