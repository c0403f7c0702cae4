"""SimCLR (Chen et al. 2020, "A Simple Framework for Contrastive Learning of Visual
Representations"), as VISSL trains it (configs/config/pretrain/simclr/simclr_8node_resnet.yaml,
vissl/losses/simclr_info_nce_loss.py).

Per step: every crop of every image goes through the one online network (trunk + MLP
projection head). With two crops, NT-Xent (``jssl.losses.simclr_info_nce``) contrasts each view
with the other view of its image against the 2N - 2 other embeddings of the global batch,
gathered from every device with gradients flowing back. With more crops (crop groups such as
2x224 + 4x96, ``data.augment.num_crops``), VISSL's multi-crop loss
(``jssl.losses.multicrop_simclr_info_nce``): every crop is an anchor, every other crop of its
image a positive, the crops of the other images of the global batch the negatives, and the
loss the mean over (anchor, positive) pairs. No momentum encoder, no queue, nothing to update
after the step.

Deliberate differences from VISSL:
- Crops of one size go through the trunk as one concatenated batch and the head sees all
  crops at once (VISSL's multi-resolution forward), so batch-norm statistics in train mode
  cover every crop of a resolution.
- Per-device batch-norm running statistics (``model.sync_bn=False``) are averaged over devices
  after each step; VISSL's recipe converts every BN to SyncBN (our ``sync_bn=True`` preset).
- In the test phase (evaluation mode) the padding rows of the last test batch take part in the
  negatives; the per-example losses of real rows are what the test loss averages.
- Multi-crop negatives come from the global batch (VISSL's multi-crop criterion masks out
  other ranks' crops, so its loss depends on the GPU count); see
  ``jssl.losses.multicrop_simclr_info_nce``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jssl import losses, models
from jssl.methods import Forward, Method, Objective, common
from jssl.parallel import DATA_AXIS

TERMS = ("info_nce",)


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    mcfg = config.method
    model = models.build_model(
        config.model, bn_axis_name=DATA_AXIS if config.model.sync_bn else None
    )

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        variables = model.init(rng, images, train=False)
        return dict(params=variables["params"], batch_stats=variables.get("batch_stats", {}))

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        count = common.num_crops(batch)
        out, batch_stats = common.forward_crops(
            model, params, state.batch_stats, batch["crops"], train, rng, batch.get("index")
        )
        embeddings = common.split_crops(out["head"].astype(jnp.float32), count)  # (C, n, d)
        n = embeddings.shape[1]
        return Forward(
            embeddings=embeddings,
            features=out["avgpool"][:n],
            batch_stats=batch_stats,
            head=out["head"][:n],
        )

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        _, metrics, info_nce = losses.multicrop_simclr_info_nce(
            embeddings, mcfg.temperature, DATA_AXIS
        )
        return Objective(terms={"info_nce": info_nce}, metrics=metrics)

    return Method(init=init, forward=forward, objective=objective, model=model)


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
