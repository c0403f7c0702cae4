"""SimCLR (Chen et al. 2020, "A Simple Framework for Contrastive Learning of Visual
Representations"), as VISSL trains it (configs/config/pretrain/simclr/simclr_8node_resnet.yaml,
vissl/losses/simclr_info_nce_loss.py and multicrop_simclr_info_nce_loss.py).

Per step: every crop of every image goes through the one online network (trunk + MLP
projection head; one trunk pass per resolution, as VISSL's multi-resolution forward).
``jssl.losses.multicrop_simclr_info_nce`` contrasts every crop with the other crops of its
image against the crops of every other image of the global batch, gathered from every device
with gradients flowing back; with two crops it is NT-Xent (``jssl.losses.simclr_info_nce``).
No momentum encoder, no queue, nothing to update after the step.

Recipes and deliberate differences: docs/methods.md#simclr.
"""

from __future__ import annotations

import ml_collections

from jssl import losses
from jssl.methods import Method, Objective, single_network
from jssl.parallel import DATA_AXIS

TERMS = ("info_nce",)


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    temperature = config.method.temperature

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        _, metrics, info_nce = losses.multicrop_simclr_info_nce(embeddings, temperature, DATA_AXIS)
        return Objective(terms={"info_nce": info_nce}, metrics=metrics)

    return single_network.method(config, objective)


def check_config(config: ml_collections.ConfigDict) -> None:
    """Start-up checks that would otherwise fail deep inside the step."""
    if config.method.temperature <= 0:
        raise ValueError(
            f"method.temperature={config.method.temperature} must be positive "
            "(SimCLR's recipes use 0.1): set --config.method.temperature."
        )
    crops = tuple(config.data.augment.num_crops)
    if sum(crops) < 2:
        raise ValueError(
            f"data.augment.num_crops={crops}: SimCLR needs at least two crops of each image "
            "(the positives); set --config.data.augment.num_crops=2, or e.g. '(2, 4)' for "
            "multi-crop."
        )
