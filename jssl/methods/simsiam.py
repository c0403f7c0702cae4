"""SimSiam (Chen & He 2021, "Exploring Simple Siamese Representation Learning"). VISSL has no
SimSiam; this follows the paper and its official code (facebookresearch/simsiam,
main_simsiam.py and simsiam/builder.py).

Per step: each view goes through the one network on its own, as the official code does
(train-mode BN normalises each view's batch separately): trunk + 3-layer projector (affine-free
BN at the output) giving ``z``, then the predictor (``params["predictor"]``) giving ``p``. The
loss is ``D(p1, sg(z2)) / 2 + D(p2, sg(z1)) / 2`` with ``D`` the negative cosine
(``jssl.losses.simsiam_loss``, term ``negative_cosine``): the stop-gradient keeps the outputs
from collapsing (Sec. 4.1). No momentum encoder, no queue, nothing to update after the step.

Recipe and deliberate differences: docs/methods.md#simsiam.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jssl import losses, models
from jssl.methods import Forward, Method, Objective, common
from jssl.methods.predictor import (
    PREDICTOR,
    apply_predictor,
    build_predictor,
    check_predictor,
    init_with_predictor,
    without_predictor,
)
from jssl.parallel import DATA_AXIS

TERMS = ("negative_cosine",)


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    model = models.build_model(
        config.model, bn_axis_name=DATA_AXIS if config.model.sync_bn else None
    )
    predictor = build_predictor(config, model)

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        params, batch_stats, _ = init_with_predictor(model, predictor, rng, images)
        return dict(params=params, batch_stats=batch_stats)

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        model_params = without_predictor(params)
        model_stats = without_predictor(state.batch_stats)
        stats = {PREDICTOR: state.batch_stats[PREDICTOR]}
        outs, predictions = [], []
        for crop, view in enumerate(common.views(batch)):
            drop_keys = common.view_drop_keys(model, rng, batch, crop, train)
            out, model_stats = common.apply_model(
                model, model_params, model_stats, view, train, drop_keys
            )
            p, stats[PREDICTOR] = apply_predictor(predictor, params, stats, out["head"], train)
            outs.append(out)
            predictions.append(p)
        return Forward(
            # The projections keep their gradient here: the loss stops it (its target branch).
            embeddings={
                "predictions": jnp.stack(predictions),
                "projections": jnp.stack([o["head"] for o in outs]),
            },
            features=outs[0]["avgpool"],
            batch_stats={**model_stats, **stats},
            head=outs[0]["head"],
        )

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        _, metrics, negative_cosine = losses.simsiam_loss(
            embeddings["predictions"], embeddings["projections"], DATA_AXIS
        )
        return Objective(terms={"negative_cosine": negative_cosine}, metrics=metrics)

    return Method(init=init, forward=forward, objective=objective, model=model)


def check_config(config: ml_collections.ConfigDict) -> None:
    """Start-up checks that would otherwise fail deep inside the step."""
    from jssl import data

    total = data.total_crops(config.data)
    if total != 2:
        raise ValueError(
            f"data.augment.num_crops={tuple(config.data.augment.num_crops)}: SimSiam takes "
            "exactly two crops of each image (each predicts the other's projection); set "
            "--config.data.augment.num_crops=2."
        )
    check_predictor(config, "SimSiam: (2048, 512, 2048)")
