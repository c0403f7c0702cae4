"""Pure loss functions of the SSL methods, by topic (contrastive, swav, distillation,
decorrelation, supervised, mixing, reconstruction (MAE's masked-patch pixel loss),
masked_distillation (iBOT, DINOv2), msn, clustering (DeepCluster v2's k-means)), all
importable from here. No model code: inputs are embeddings
or scores.

The losses run per replica inside ``jax.shard_map`` over the ``data`` mesh axis; those whose
terms span the global batch (SimCLR's negatives, SwAV's Sinkhorn sums) take that axis as
``axis_name`` (None: a single device, no collectives). Each returns the mean over its LOCAL
examples: the train step's ``pmean`` of loss and gradients then yields the global mean.
"""

from jssl.losses._util import l2_normalize
from jssl.losses.clustering import cluster_prediction_loss, initial_centroids, kmeans
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
from jssl.losses.masked_distillation import (
    as_teacher_logits,
    centred_probs,
    koleo_losses,
    masked_batch_center,
    masked_patch_losses,
    sinkhorn_centering,
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
from jssl.losses.msn import msn_log_probabilities, msn_targets, msn_terms
from jssl.losses.reconstruction import masked_patch_mse, normalize_patches
from jssl.losses.supervised import cross_entropy, multi_output_cross_entropy, top_k_hits
from jssl.losses.swav import sinkhorn_knopp, swav_crop_losses, swav_loss

__all__ = [
    "MixSettings",
    "PairMix",
    "as_teacher_logits",
    "barlow_twins_terms",
    "byol_loss",
    "centred_probs",
    "cluster_prediction_loss",
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
    "initial_centroids",
    "kmeans",
    "koleo_losses",
    "l2_normalize",
    "masked_batch_center",
    "masked_patch_losses",
    "masked_patch_mse",
    "mix_images",
    "mixed_targets",
    "mocov3_info_nce",
    "msn_log_probabilities",
    "msn_targets",
    "msn_terms",
    "multi_output_cross_entropy",
    "multicrop_simclr_info_nce",
    "normalize_patches",
    "simclr_info_nce",
    "simsiam_loss",
    "sinkhorn_centering",
    "sinkhorn_knopp",
    "soft_target_cross_entropy",
    "swav_crop_losses",
    "swav_loss",
    "top_k_hits",
    "vicreg_terms",
]
