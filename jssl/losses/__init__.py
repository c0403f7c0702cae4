"""Pure loss functions of the SSL methods, by topic (contrastive, swav, distillation,
decorrelation, supervised), all importable from here. No model code: inputs are embeddings
or scores.

The losses run per replica inside ``jax.shard_map`` over the ``data`` mesh axis; those whose
terms span the global batch (SimCLR's negatives, SwAV's Sinkhorn sums) take that axis as
``axis_name`` (None: a single device, no collectives). Each returns the mean over its LOCAL
examples: the train step's ``pmean`` of loss and gradients then yields the global mean.
"""

from jssl.losses._util import l2_normalize
from jssl.losses.contrastive import (
    info_nce_with_queue,
    mocov3_info_nce,
    multicrop_simclr_info_nce,
    simclr_info_nce,
)
from jssl.losses.decorrelation import barlow_twins_terms, vicreg_terms
from jssl.losses.distillation import (
    byol_loss,
    dino_batch_center,
    dino_cross_entropy,
    dino_teacher_crop_losses,
    dino_update_center,
    simsiam_loss,
)
from jssl.losses.mixing import (
    MixSettings,
    PairMix,
    cutmix_box,
    dominant_labels,
    draw_mixes,
    draw_pair_mix,
    mix_images,
    mixed_targets,
    soft_target_cross_entropy,
)
from jssl.losses.supervised import cross_entropy, multi_output_cross_entropy, top_k_hits
from jssl.losses.swav import sinkhorn_knopp, swav_crop_losses, swav_loss

__all__ = [
    "MixSettings",
    "PairMix",
    "barlow_twins_terms",
    "byol_loss",
    "cross_entropy",
    "cutmix_box",
    "dino_batch_center",
    "dino_cross_entropy",
    "dino_teacher_crop_losses",
    "dino_update_center",
    "dominant_labels",
    "draw_mixes",
    "draw_pair_mix",
    "info_nce_with_queue",
    "l2_normalize",
    "mix_images",
    "mixed_targets",
    "mocov3_info_nce",
    "multi_output_cross_entropy",
    "multicrop_simclr_info_nce",
    "simclr_info_nce",
    "simsiam_loss",
    "sinkhorn_knopp",
    "soft_target_cross_entropy",
    "swav_crop_losses",
    "swav_loss",
    "top_k_hits",
    "vicreg_terms",
]
