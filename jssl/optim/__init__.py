"""Optimizers built from optax: :mod:`.transforms` (the optimizers, masks, LARC, weight-decay
schedule, clipping) and :mod:`.groups` (learning rates per parameter group, parameters frozen
for their first steps). Everything is re-exported here.

VISSL's optimizer block maps onto ``config.optim``: ``sgd`` / ``adamw`` are PyTorch's SGD
(coupled weight decay, momentum on the raw step) and AdamW (decoupled decay); ``larc`` is
VISSL's ``sgd`` with ``use_larc: True``, apex's LARC around SGD (``apex/parallel/LARC.py``,
``vissl/optimizers/larc_fsdp.py``; :func:`scale_by_larc`); ``lars`` is VISSL's ``lars``
(``vissl/optimizers/lars.py``, from Barlow Twins: the trust ratio of the decayed gradient,
momentum on the scaled step, the learning rate last). ``regularize_bn`` / ``regularize_bias``
become a weight-decay mask, ``exclude_bias_and_norm`` and friends a trust-ratio mask
(``trust_ratio_exclude``); ``param_schedulers.lr`` is :mod:`jssl.optim.schedules`, its weight
decay (DINO's cosine) :func:`weight_decay_schedule`; ``grad_clip_norm`` clips the global
gradient norm (VISSL ``GRAD_CLIP``), ``grad_clip_per_parameter`` each one's (DINO ``clip_grad``).
"""

from jssl.optim.groups import (  # noqa: F401
    GROUP_SCHEDULES,
    FrozenState,
    ParamGroup,
    PartitionState,
    build_grouped_optimizer,
    freeze_for_steps,
    param_groups,
)
from jssl.optim.transforms import (  # noqa: F401
    OPTIMIZERS,
    SCHEDULES,
    TRUST_RATIO_EXCLUDES,
    WEIGHT_DECAY_SCHEDULES,
    ScaleByLarcState,
    Schedule,
    build_optimizer,
    build_schedule,
    clip_by_parameter_norm,
    peak_learning_rate,
    scale_by_larc,
    trust_ratio_mask,
    warmup_start_learning_rate,
    weight_decay_mask,
    weight_decay_schedule,
)
