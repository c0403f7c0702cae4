"""The one-network methods' shared build: SimCLR, Barlow Twins and VICReg (and the supervised
baseline's model) train one online network, trunk + head, with no teacher, queue or state to
update after the step. What differs between them is the objective and whether the crops go
through the network together or one view at a time; the rest is stated here once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jssl import models
from jssl.methods import Forward, Method, common
from jssl.parallel import DATA_AXIS


def build_model(config: ml_collections.ConfigDict) -> Any:
    """``models.build_model`` with batch norm synchronised over the data axis where
    ``model.sync_bn`` says so."""
    return models.build_model(
        config.model, bn_axis_name=DATA_AXIS if config.model.sync_bn else None
    )


def init_fn(model: Any) -> Callable[[jax.Array, jax.Array], dict[str, Any]]:
    """``init(rng, images) -> dict(params, batch_stats)``: the model's fresh variables."""

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        variables = model.init(rng, images, train=False)
        return dict(params=variables["params"], batch_stats=variables.get("batch_stats", {}))

    return init


def crops_forward(model: Any) -> Callable[..., Forward]:
    """Every crop through the network as one batch per resolution (``common.forward_crops``);
    embeddings: the heads of every crop, ``(crops, n, d)`` in float32."""

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        count = common.num_crops(batch)
        out, batch_stats = common.forward_crops(
            model, params, state.batch_stats, batch["crops"], train, rng, batch.get("index")
        )
        embeddings = common.split_crops(out["head"].astype(jnp.float32), count)
        n = embeddings.shape[1]
        return Forward(
            embeddings=embeddings,
            features=out["avgpool"][:n],
            batch_stats=batch_stats,
            head=out["head"][:n],
        )

    return forward


def per_view_forward(model: Any) -> Callable[..., Forward]:
    """Each crop through the network in its own pass, so train-mode batch norm normalises each
    view on its own (VICReg's authors' code); embeddings as :func:`crops_forward`'s."""

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        batch_stats, heads, first = state.batch_stats, [], None
        for crop, view in enumerate(common.views(batch)):
            keys = common.view_drop_keys(model, rng, batch, crop, train)
            out, batch_stats = common.apply_model(model, params, batch_stats, view, train, keys)
            heads.append(out["head"])
            first = out if first is None else first
        return Forward(
            embeddings=jnp.stack(heads).astype(jnp.float32),
            features=first["avgpool"],
            batch_stats=batch_stats,
            head=first["head"],
        )

    return forward


def method(
    config: ml_collections.ConfigDict, objective: Callable[..., Any], per_view: bool = False
) -> Method:
    """The :class:`Method` of one online network and ``objective`` (``(embeddings, state,
    batch, train) -> Objective``, embeddings ``(crops, n, d)``); nothing after the update."""
    model = build_model(config)
    forward = per_view_forward(model) if per_view else crops_forward(model)
    return Method(init=init_fn(model), forward=forward, objective=objective, model=model)
