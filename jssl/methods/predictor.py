"""The predictor MLP of BYOL, SimSiam and MoCo v3: the online network's last stage, its own
parameter subtree ``params["predictor"]`` (and ``batch_stats["predictor"]``), which the
target or momentum encoder does not have. Shared here so that no method imports another.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jssl import models
from jssl.methods import common

PREDICTOR = "predictor"


def build_predictor(config: ml_collections.ConfigDict, model: Any, **options: Any) -> Any:
    """The predictor MLP of ``method.predictor_dims``, BN after its hidden layer(s) when
    ``method.predictor_bn``, in the projector's dtype and batch-norm axis; ``options`` go to
    ``models.MLPHead`` (MoCo v3: ``last_bn``, ``use_bias=False``)."""
    return models.MLPHead(
        dims=tuple(int(d) for d in config.method.predictor_dims),
        use_bn=config.method.predictor_bn,
        dtype=model.head.dtype,
        bn_axis_name=model.head.bn_axis_name,
        **options,
    )


def init_with_predictor(
    model: Any, predictor: Any, rng: jax.Array, images: jax.Array
) -> tuple[dict, dict, dict]:
    """``(params, batch_stats, online model variables)``: the model's variables with the
    predictor's under ``"predictor"`` in both collections."""
    model_rng, predictor_rng = jax.random.split(rng)
    variables = model.init(model_rng, images, train=False)
    dim = predictor.dims[0]
    pred = predictor.init(predictor_rng, jnp.zeros((2, dim), jnp.float32), train=False)
    model_stats = variables.get("batch_stats", {})
    params = {**variables["params"], PREDICTOR: pred["params"]}
    batch_stats = {**model_stats, PREDICTOR: pred.get("batch_stats", {})}
    return params, batch_stats, {"params": variables["params"], "batch_stats": model_stats}


def init_online_and_target(model: Any, predictor: Any, rng: jax.Array, images: jax.Array):
    """A predictor method's initial state: the online network with its predictor, and a
    target / momentum encoder that starts as a copy of the online trunk and projector (VISSL
    ``_build_byol_target_network``; MoCo v3 builder.py ``param_m.data.copy_(param_b.data)``);
    the predictor has no counterpart there."""
    params, batch_stats, variables = init_with_predictor(model, predictor, rng, images)
    return dict(
        params=params,
        batch_stats=batch_stats,
        ema_params=jax.tree.map(jnp.copy, variables["params"]),
        ema_batch_stats=jax.tree.map(jnp.copy, variables.get("batch_stats", {})),
    )


def without_predictor(tree: dict) -> dict:
    return {k: v for k, v in tree.items() if k != PREDICTOR}


def apply_predictor(predictor, params, batch_stats, z: jax.Array, train: bool):
    """``(predictions, new predictor batch_stats)``, as ``common.apply_model`` for the model."""
    if not batch_stats[PREDICTOR]:  # no BN in the predictor (method.predictor_bn False)
        return predictor.apply({"params": params[PREDICTOR]}, z, train=train), {}
    return common.apply_model(predictor, params[PREDICTOR], batch_stats[PREDICTOR], z, train)


def check_predictor(config: ml_collections.ConfigDict, example: str) -> None:
    """The predictor maps the projector's output to a vector of the same size."""
    head = tuple(config.model.head_dims)
    if len(head) < 2:
        raise ValueError(
            f"model.head_dims={head}: {config.method.name} needs a projector head, "
            "(trunk features, hidden..., embedding)."
        )
    dims = tuple(config.method.predictor_dims)
    if len(dims) < 2 or dims[0] != head[-1] or dims[-1] != head[-1]:
        raise ValueError(
            f"method.predictor_dims={dims} must start and end with the projector's output "
            f"dim, model.head_dims[-1]={head[-1]} (the prediction regresses onto a projection), "
            f"e.g. --config.method.predictor_dims='({head[-1]}, {4 * head[-1]}, {head[-1]})'; "
            f"{example}."
        )
