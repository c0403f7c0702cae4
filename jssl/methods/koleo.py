"""KoLeo (``losses.koleo_losses``) as a loss term of the distillation methods: always one of
DINOv2's terms, an optional one of DINO's, iBOT's and MSN's.

DINOv2 (Oquab et al. 2023, Sec. 4) adds KoLeo to DINO's and iBOT's losses: the entropy of the
student's normed class tokens, estimated from each token's distance to its nearest neighbour
among ``method.koleo_group_size`` examples, pushes the tokens apart. DINO, iBOT and MSN have
no such term. Here they get it when ``loss.weights.koleo`` is set (a placeholder, unset in
their presets but the small-data ViT demos, where it is a deliberate difference:
docs/methods.md): ``koleo_crop<t>`` per crop t (DINO, iBOT: each teacher crop's student
pass; MSN: each random-masked anchor's), each at share 1 (DINOv2 sums the crops' terms).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import ml_collections

from jssl import losses, parallel
from jssl.methods import common
from jssl.parallel import DATA_AXIS

FAMILY = "koleo"


def crop_terms(crops: Sequence[int]) -> tuple[common.LossTerm, ...]:
    """``koleo_crop<t>`` for each crop t, each at share 1 (family ``koleo``)."""
    return tuple(common.LossTerm(f"{FAMILY}_crop{int(t)}", FAMILY, 1.0) for t in crops)


def enabled(config: ml_collections.ConfigDict) -> bool:
    """Whether a DINO, iBOT or MSN config turns the optional term on (``loss.weights.koleo``
    set; a config without the field, e.g. a workdir's saved before it existed, has it off)."""
    weights = (config.get("loss") or {}).get("weights") or {}
    return weights.get(FAMILY) is not None


def optional_terms(
    config: ml_collections.ConfigDict, crops: Sequence[int]
) -> tuple[common.LossTerm, ...]:
    """The optional KoLeo terms, one per crop of ``crops`` (DINO's and iBOT's teacher crops,
    MSN's random-masked anchors) where :func:`enabled`, else none."""
    return crop_terms(crops) if enabled(config) else ()


def crop_losses(tokens: jax.Array, group_size: int, *after: jax.Array) -> list[jax.Array]:
    """Each crop's KoLeo term, ``(n,)`` per row of ``tokens`` (T, n, D), the student's normed
    class tokens (a ResNet's pooled features), over groups of ``group_size`` examples of the
    global batch; its gathers run after every leaf of ``after`` (``parallel.after``)."""
    return [
        losses.koleo_losses(parallel.after(crop, *after), group_size, DATA_AXIS) for crop in tokens
    ]


def check_group_size(config: ml_collections.ConfigDict) -> None:
    """``method.koleo_group_size`` divides the batch and is at least 2 (or 0: the batch)."""
    group, batch = int(config.method.koleo_group_size), int(config.data.batch_size)
    if group < 0 or group == 1 or (group and batch % group):
        raise ValueError(
            f"method.koleo_group_size={group}: KoLeo finds each example's nearest neighbour "
            f"within groups of this many examples of the batch; it must divide "
            f"data.batch_size={batch} and be at least 2 (DINOv2: each GPU's batch, e.g. 64), "
            "or 0 for the whole batch."
        )
