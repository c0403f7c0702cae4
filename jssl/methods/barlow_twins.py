"""Barlow Twins (Zbontar et al. 2021, "Barlow Twins: Self-Supervised Learning via Redundancy
Reduction"), as VISSL trains it
(configs/config/pretrain/barlow_twins/barlow_twins_4node_resnet.yaml,
vissl/losses/barlow_twins_loss.py).

Per step: both views of every image go through the one online network as one batch (trunk,
then a bias-free projector); the embeddings are standardised per feature over the global batch
and their cross-correlation C pulled towards the identity (``jssl.losses.barlow_twins_terms``).
The terms are unweighted, ``invariance`` = sum_i (1 - C_ii)^2 and ``redundancy_reduction`` =
sum_{i != j} C_ij^2, so the weights carry both of VISSL's constants: 0.024 (``scale_loss``) and
0.024 x 0.0051 (x ``lambda_``); a different lambda_ is
``--config.loss.weights.redundancy_reduction=<0.024 * lambda_>``. Nothing to update after the
step. Recipe and deliberate differences: docs/methods.md#barlow-twins.
"""

from __future__ import annotations

import ml_collections

from jssl import losses
from jssl.methods import Method, Objective, single_network
from jssl.parallel import DATA_AXIS

TERMS = ("invariance", "redundancy_reduction")


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    normalize_jointly = config.method.normalize_jointly

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        terms, metrics = losses.barlow_twins_terms(
            embeddings[0], embeddings[1], normalize_jointly=normalize_jointly, axis_name=DATA_AXIS
        )
        return Objective(terms=terms, metrics=metrics)

    # Both views through the network as one batch (VISSL's multi-resolution forward).
    return single_network.method(config, objective)


def check_config(config: ml_collections.ConfigDict) -> None:
    """Start-up checks that would otherwise fail deep inside the step (or silently)."""
    check_two_views_and_weights(config, "Barlow Twins", "0.024 and 1.224e-4")


def check_two_views_and_weights(
    config: ml_collections.ConfigDict, method: str, recipe_weights: str
) -> None:
    """What Barlow Twins and VICReg share: two views, a head, a batch, weights >= 0."""
    crops = tuple(config.data.augment.num_crops)
    if sum(crops) != 2:
        raise ValueError(
            f"data.augment.num_crops={crops}: {method} compares exactly two views of each "
            "image; set --config.data.augment.num_crops='(1, 1)' (two groups of one crop, "
            "each with its own blur and solarisation, as the recipe) or '(2,)'."
        )
    if not tuple(config.model.head_dims):
        raise ValueError(
            f"model.head_dims=(): {method} needs a projector whose output it decorrelates; "
            "set e.g. --config.model.head_dims='(2048, 8192, 8192, 8192)'."
        )
    if config.data.batch_size < 2:
        raise ValueError(
            f"data.batch_size={config.data.batch_size}: {method}'s statistics run over the "
            "batch; it needs at least 2 images (the recipes use 2048)."
        )
    for term, weight in config.loss.weights.items():
        if weight < 0:
            raise ValueError(
                f"loss.weights.{term}={weight} must be >= 0 (a negative weight rewards the "
                f"term it should penalise; {method}'s recipe: {recipe_weights})."
            )
