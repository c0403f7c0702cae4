"""Mixup and CutMix with label smoothing, and the soft-target cross-entropy they train with:
the supervised fine-tuning protocol of DeiT, BEiT and MAE (Zhang et al. 2018, "mixup"; Yun et
al. 2019, "CutMix"), with timm's semantics (``timm/data/mixup.py`` ``Mixup``,
``timm/loss/cross_entropy.py`` ``SoftTargetCrossEntropy``), as pure functions of one key per
pair of examples.

The partners are the adjacent rows (2j, 2j + 1) of the global batch and each pair draws its
own mix (:func:`draw_pair_mix`) from a key of the step and its first example, so a run mixes
the same way on any number of devices, in any micro-batch and across a resume; timm pairs i
with N - 1 - i of each GPU's batch and MAE's recipe draws once per batch. The differences
from timm: docs/methods.md#fine-tuning-a-vit-finetune_vit.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jssl.losses._util import l2_normalize


class MixSettings(NamedTuple):
    """timm ``Mixup``'s arguments (MAE's fine-tuning: 0.8, 1.0, 1.0, 0.5)."""

    mixup_alpha: float = 0.8  # > 0: mixup on, lam ~ Beta(alpha, alpha)
    cutmix_alpha: float = 1.0  # > 0: CutMix on
    mix_prob: float = 1.0  # probability that a pair is mixed at all
    switch_prob: float = 0.5  # CutMix rather than mixup, when both are on

    @property
    def enabled(self) -> bool:
        return (self.mixup_alpha > 0 or self.cutmix_alpha > 0) and self.mix_prob > 0


class PairMix(NamedTuple):
    """One pair's draw (leaves with a leading pairs axis when drawn for many pairs)."""

    lam: jax.Array  # weight of each example's own image and label (area-corrected for CutMix)
    cutmix: jax.Array  # bool: the box is swapped (else the images are blended with lam)
    box: jax.Array  # int32 (top, bottom, left, right), rows top..bottom-1; empty for mixup


def cutmix_box(
    lam: jax.Array, center_y: jax.Array, center_x: jax.Array, height: int, width: int
) -> tuple[jax.Array, jax.Array]:
    """``(box, corrected lam)`` of timm's ``rand_bbox`` and ``cutmix_bbox_and_lam`` for a drawn
    ``lam`` and box centre: sides ``int(H sqrt(1 - lam))`` and ``int(W sqrt(1 - lam))``, the box
    ``centre -+ side // 2`` clipped to the image (an odd side loses a row, as in timm), lam
    corrected to ``1 - area / (H W)`` of the clipped box."""
    ratio = jnp.sqrt(1.0 - jnp.asarray(lam, jnp.float32))
    half_h = jnp.floor(height * ratio).astype(jnp.int32) // 2
    half_w = jnp.floor(width * ratio).astype(jnp.int32) // 2
    top, bottom = jnp.clip(center_y - half_h, 0, height), jnp.clip(center_y + half_h, 0, height)
    left, right = jnp.clip(center_x - half_w, 0, width), jnp.clip(center_x + half_w, 0, width)
    area = (bottom - top) * (right - left)
    box = jnp.stack([top, bottom, left, right]).astype(jnp.int32)
    return box, 1.0 - area.astype(jnp.float32) / float(height * width)


def draw_pair_mix(key: jax.Array, height: int, width: int, settings: MixSettings) -> PairMix:
    """One pair's mix from its own key: timm's ``_params_per_elem`` for one pair, and for
    CutMix its box and corrected lam (:func:`cutmix_box`). A pair not mixed (``mix_prob``) has
    lam 1 and an empty box."""
    k_switch, k_apply, k_lam, k_y, k_x = jax.random.split(key, 5)
    if settings.mixup_alpha > 0 and settings.cutmix_alpha > 0:
        use_cutmix = jax.random.uniform(k_switch) < settings.switch_prob
    else:
        use_cutmix = jnp.asarray(settings.cutmix_alpha > 0)
    # Beta(a, a) = G1 / (G1 + G2) of two Gamma(a) draws, in log space (as jax.random.beta,
    # safe for small a); mixup's and CutMix's pairs from one sampler (an off one at a = 1).
    a_mix, a_cut = settings.mixup_alpha or 1.0, settings.cutmix_alpha or 1.0
    log_gammas = jax.random.loggamma(k_lam, jnp.array([a_mix, a_mix, a_cut, a_cut], jnp.float32))
    lam_mixup = jax.nn.sigmoid(log_gammas[0] - log_gammas[1])
    lam_cutmix = jax.nn.sigmoid(log_gammas[2] - log_gammas[3])
    apply = jax.random.uniform(k_apply) < settings.mix_prob
    lam = jnp.where(apply, jnp.where(use_cutmix, lam_cutmix, lam_mixup), 1.0)
    center_y = jax.random.randint(k_y, (), 0, height)
    center_x = jax.random.randint(k_x, (), 0, width)
    box, corrected = cutmix_box(lam, center_y, center_x, height, width)
    cutmix = use_cutmix & apply
    return PairMix(
        lam=jnp.where(cutmix, corrected, lam).astype(jnp.float32),
        cutmix=cutmix,
        box=jnp.where(cutmix, box, jnp.zeros_like(box)),
    )


def draw_mixes(pair_keys: jax.Array, height: int, width: int, settings: MixSettings) -> PairMix:
    """:func:`draw_pair_mix` for every pair: ``pair_keys`` (pairs,), one key per pair."""
    return jax.vmap(lambda key: draw_pair_mix(key, height, width, settings))(pair_keys)


def _pairs(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows 0, 2, 4, ... and rows 1, 3, 5, ...: the two members of every pair."""
    if x.shape[0] % 2:
        raise ValueError(
            f"Mixup / CutMix pair adjacent examples, but this batch has {x.shape[0]} rows (odd)."
        )
    pairs = x.reshape(x.shape[0] // 2, 2, *x.shape[1:])
    return pairs[:, 0], pairs[:, 1]


def _interleave(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.stack([a, b], axis=1).reshape(2 * a.shape[0], *a.shape[1:])


def mix_images(images: jax.Array, mixes: PairMix) -> jax.Array:
    """The batch ``images`` (n, H, W, C), pairs (2j, 2j + 1), each pair mixed by ``mixes[j]``:
    blended with its lam, or its box's pixels swapped."""
    a, b = _pairs(images)
    rows = jnp.arange(images.shape[1])[None, :, None]
    cols = jnp.arange(images.shape[2])[None, None, :]
    top, bottom, left, right = (mixes.box[:, i, None, None] for i in range(4))
    inside = (rows >= top) & (rows < bottom) & (cols >= left) & (cols < right)  # (pairs, H, W)
    swap = (mixes.cutmix[:, None, None] & inside)[..., None]
    lam = mixes.lam.astype(images.dtype)[:, None, None, None]
    blend = ~mixes.cutmix[:, None, None, None]
    new_a = jnp.where(swap, b, jnp.where(blend, lam * a + (1 - lam) * b, a))
    new_b = jnp.where(swap, a, jnp.where(blend, lam * b + (1 - lam) * a, b))
    return _interleave(new_a, new_b).astype(images.dtype)


def mixed_targets(
    labels: jax.Array, lam: jax.Array, num_classes: int, label_smoothing: float = 0.0
) -> jax.Array:
    """(n, K) soft targets: row i is ``lam * smooth(label_i) + (1 - lam) * smooth(partner)``
    with the lam of its pair (``lam`` (n / 2,)), ``smooth`` timm's label smoothing (1 - s + s / K
    on the label, s / K elsewhere); ``lam`` all ones gives the smoothed labels."""
    off = label_smoothing / num_classes
    own = jax.nn.one_hot(labels, num_classes) * (1.0 - label_smoothing) + off
    a, b = _pairs(own)
    lam = lam.astype(jnp.float32)[:, None]
    return _interleave(lam * a + (1 - lam) * b, lam * b + (1 - lam) * a)


def dominant_labels(labels: jax.Array, targets: jax.Array) -> jax.Array:
    """Each row's label of the larger share in its soft target (its own on a tie): what the
    training top-k hits are counted against while the images are mixed."""
    own = jnp.take_along_axis(targets, labels[:, None], axis=-1)[:, 0]
    return jnp.where(own >= jnp.max(targets, axis=-1), labels, jnp.argmax(targets, axis=-1))


def soft_target_cross_entropy(
    logits: jax.Array,
    targets: jax.Array,
    temperature: float = 1.0,
    normalize_output: bool = False,
) -> jax.Array:
    """Per-example ``-sum(targets * log_softmax(logits))`` (timm's ``SoftTargetCrossEntropy``
    before its mean), (n,); the logits L2-normalised first and divided by ``temperature`` as
    ``jssl.losses.cross_entropy`` does, so that it is that loss when the targets are the
    smoothed labels."""
    logits = logits.astype(jnp.float32)
    if normalize_output:
        logits = l2_normalize(logits)
    return -jnp.sum(targets * jax.nn.log_softmax(logits / temperature, axis=-1), axis=-1)
