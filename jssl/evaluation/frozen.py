"""A trained model frozen for evaluation: the online network (the trunk alone, or with its head)
of ``init.checkpoint`` in eval mode, for the kNN, linear and extraction engines."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import ml_collections
from absl import logging

from jssl import methods
from jssl.checkpoints import source_model, weights


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
    trunk's model fields; the head is the method's, as recorded by the evaluated workdir."""
    path = path or config.init.checkpoint
    if not path:
        raise weights.WeightsError(
            f"engine={config.engine!r} evaluates a trained model: set "
            "--config.init.checkpoint to a jssl workdir (or checkpoint step dir, or a VISSL "
            ".torch / torchvision .pth file), or use features already extracted to disk."
        )
    trunk_only = "head" not in layers
    if trunk_only:
        model = weights.trunk_model(config)
    else:
        model = methods.get(source_model.method_config(config, path)).model
    variables = weights.load_variables(path, config, mesh=mesh, trunk_only=trunk_only, model=model)
    logging.info("Evaluating the frozen weights of %s.", path)
    return model, variables
