"""SimCLR (Chen et al. 2020, "A Simple Framework for Contrastive Learning of Visual
Representations"), as VISSL trains it (configs/config/pretrain/simclr/simclr_8node_resnet.yaml,
vissl/losses/simclr_info_nce_loss.py).

Per step: both views of every image go through the one online network (trunk + MLP projection
head); NT-Xent (``jssl.losses.simclr_info_nce``) contrasts each view with the other view of its
image against the 2N - 2 other embeddings of the global batch, gathered from every device with
gradients flowing back. No momentum encoder, no queue, nothing to update after the step.

Deliberate differences from VISSL:
- The two views go through the network as one concatenated batch, so batch-norm statistics in
  train mode cover both views (VISSL forwards the two 224 px crops of a group together too).
- Per-device batch-norm running statistics (``model.sync_bn=False``) are averaged over devices
  after each step; VISSL's recipe converts every BN to SyncBN (our ``sync_bn=True`` preset).
- In the test phase (evaluation mode) the padding rows of the last test batch take part in the
  negatives; the per-example losses of real rows are what the test loss averages.
Multi-crop SimCLR (VISSL's multicrop_simclr_info_nce_loss) is in ``jssl.losses`` and follows
with the multi-crop data pipeline.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jssl import losses, models
from jssl.methods import LossOutput, Method, common
from jssl.parallel import DATA_AXIS


def make(config: ml_collections.ConfigDict) -> Method:
    mcfg = config.method
    model = models.build_model(
        config.model, bn_axis_name=DATA_AXIS if config.model.sync_bn else None
    )

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        variables = model.init(rng, images, train=False)
        return dict(params=variables["params"], batch_stats=variables["batch_stats"])

    def loss(params, state, batch, rng, train: bool = True):
        view1, view2 = batch["views"][0], batch["views"][1]
        n = view1.shape[0]
        both = jnp.concatenate([view1, view2])
        out, batch_stats = common.apply_model(model, params, state.batch_stats, both, train)
        embeddings = out["head"].astype(jnp.float32)
        value, metrics, per_example = losses.simclr_info_nce(
            embeddings[:n], embeddings[n:], mcfg.temperature, DATA_AXIS
        )
        return value, LossOutput(
            metrics=metrics,
            batch_stats=batch_stats,
            features=out["avgpool"][:n],
            embeddings=out["head"][:n],
            per_example_loss=per_example,
        )

    return Method(init=init, loss=loss, after_update=None, model=model)


def check_config(config: ml_collections.ConfigDict) -> None:
    """Start-up checks that would otherwise fail deep inside the step."""
    if config.method.temperature <= 0:
        raise ValueError(
            f"method.temperature={config.method.temperature} must be positive "
            "(SimCLR's recipes use 0.1): set --config.method.temperature."
        )
    if config.data.augment.num_views != 2:
        raise ValueError(
            f"data.augment.num_views={config.data.augment.num_views}: SimCLR here contrasts "
            "two views; set --config.data.augment.num_views=2."
        )
