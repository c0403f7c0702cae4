"""Masked-image self-distillation: iBOT's and DINOv2's patch loss, the teacher's centring by
Sinkhorn-Knopp (DINOv2's ``centering="sinkhorn_knopp"``) and DINOv2's KoLeo regulariser.

The [CLS] loss of both methods is DINO's (``jssl.losses.dino_teacher_crop_losses``); with
Sinkhorn targets it takes them through :func:`as_teacher_logits`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jssl.losses._util import _psum, l2_normalize
from jssl.losses.swav import sinkhorn_knopp


def masked_patch_losses(
    student_logits: jax.Array,
    teacher_probs: jax.Array,
    mask: jax.Array,
    student_temp: float | jax.Array,
) -> jax.Array:
    """iBOT's masked-patch loss per crop and image, ``(T, n)``.

    ``student_logits`` (T, n, K, D): the student head's output for K patch places of each of
    T crops of n images; ``teacher_probs`` (T, n, K, D): the teacher's target distribution at
    the same places of the same crop (centred and sharpened, or Sinkhorn's; no gradient);
    ``mask`` (T, n, K): 1 where a place is a masked patch, 0 elsewhere. Each place's loss is
    ``H(P_t, P_s) = -sum_d P_t log softmax(s / student_temp)``; an image's loss is the mean over
    its masked places, 0 for an image with none (iBOT main_ibot.py ``iBOTLoss``: ``sum(loss *
    mask) / mask.sum().clamp(min=1)``; DINOv2 ibot_patch_loss.py ``forward_masked``), so the
    mean over images counts the unmasked ones too, as both references do."""
    student_log_probs = jax.nn.log_softmax(
        jnp.asarray(student_logits, jnp.float32) / student_temp, axis=-1
    )
    targets = jax.lax.stop_gradient(jnp.asarray(teacher_probs, jnp.float32))
    cross = -jnp.sum(targets * student_log_probs, axis=-1)  # (T, n, K)
    mask = jnp.asarray(mask, jnp.float32)
    return jnp.sum(cross * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)


def centred_probs(
    teacher_logits: jax.Array, center: jax.Array, teacher_temp: float | jax.Array
) -> jax.Array:
    """DINO's centred, sharpened teacher: ``softmax((t - center) / teacher_temp)``, no
    gradient (iBOT's ``center2`` on patch tokens, DINOv2 ``softmax_center_teacher``)."""
    logits = jnp.asarray(teacher_logits, jnp.float32)
    return jax.lax.stop_gradient(jax.nn.softmax((logits - center) / teacher_temp, axis=-1))


def masked_batch_center(
    teacher_logits: jax.Array, mask: jax.Array, axis_name: str | None = None
) -> jax.Array:
    """The mean teacher output over the masked places of the GLOBAL batch, (D,):
    ``teacher_logits`` (..., D) weighted by ``mask`` (...) (DINOv2's patch centre, over the
    masked patches only)."""
    logits = jnp.asarray(teacher_logits, jnp.float32)
    weights = jnp.asarray(mask, jnp.float32)[..., None]
    flat = logits.shape[-1]
    total = _psum(jnp.sum((logits * weights).reshape(-1, flat), axis=0), axis_name)
    count = _psum(jnp.sum(weights), axis_name)
    return total / jnp.maximum(count, 1.0)


def sinkhorn_centering(
    teacher_logits: jax.Array,
    teacher_temp: float | jax.Array,
    valid: jax.Array | None = None,
    num_iters: int = 3,
    axis_name: str | None = None,
) -> jax.Array:
    """DINOv2's Sinkhorn-Knopp centring (dino_clstoken_loss.py / ibot_patch_loss.py
    ``sinkhorn_knopp_teacher``): the teacher's targets, ``(..., D)`` rows summing to 1, from
    ``exp(t / teacher_temp)`` made equipartitioned over the D prototypes across the rows of
    the GLOBAL batch (``num_iters`` iterations, sums over ``axis_name``); this is SwAV's
    ``jssl.losses.sinkhorn_knopp`` with epsilon = ``teacher_temp``.

    ``valid`` (...): rows that take part (DINOv2's patch targets: the masked patches only, the
    number of samples B being their global count); the others come back as zeros."""
    logits = jnp.asarray(teacher_logits, jnp.float32)
    flat = logits.reshape(-1, logits.shape[-1])
    rows = None if valid is None else jnp.asarray(valid).reshape(-1).astype(bool)
    q = sinkhorn_knopp(
        flat, epsilon=teacher_temp, num_iters=num_iters, axis_name=axis_name, sample_mask=rows
    )
    if rows is not None:
        # No valid row anywhere leaves 0 / 0 in every row: zeros, as for any invalid row.
        q = jnp.where(rows[:, None] & jnp.isfinite(q), q, 0.0)
    return jax.lax.stop_gradient(q.reshape(logits.shape))


def as_teacher_logits(teacher_probs: jax.Array) -> jax.Array:
    """Targets made logits for DINO's loss at centre 0 and teacher temperature 1:
    ``softmax(log q) = q`` to float rounding (a prototype of mass 0 gets log 1e-30)."""
    return jnp.log(jnp.maximum(jnp.asarray(teacher_probs, jnp.float32), 1e-30))


def koleo_losses(
    features: jax.Array,
    group_size: int = 0,
    axis_name: str | None = None,
    eps: float = 1e-8,
) -> jax.Array:
    """The Kozachenko-Leonenko entropy estimator as a loss (Sablayrolles et al. 2019,
    "Spreading vectors for similarity search"; DINOv2 koleo_loss.py), per example, ``(n,)``:
    ``-log(||x_i - x_nn(i)|| + eps)`` for the L2-normalised rows ``x`` and each row's nearest
    neighbour (largest inner product) among the other rows of its group. Its mean over the
    rows is DINOv2's loss of one group.

    Groups: ``group_size`` consecutive rows of the GLOBAL batch (rows of every replica in
    replica order, gathered over ``axis_name``; gradients reach the neighbour through the
    gather), 0 for the whole global batch. DINOv2 searches within each GPU's batch; a fixed
    group size (its per-GPU batch) keeps that statistic while making it independent of the
    device count. The distance is ``torch.nn.PairwiseDistance(eps=1e-8)``'s,
    ``||x - y + eps||``; the row itself is left out of the search (DINOv2 sets its inner
    product to -1)."""
    x = l2_normalize(jnp.asarray(features, jnp.float32), eps=eps)
    n = x.shape[0]
    if axis_name is None:
        everyone, first = x, 0
    else:
        everyone = jax.lax.all_gather(x, axis_name, tiled=True)
        first = jax.lax.axis_index(axis_name) * n
    total = everyone.shape[0]
    size = group_size or total
    row = first + jnp.arange(n)[:, None]
    col = jnp.arange(total)[None, :]
    candidate = (row // size == col // size) & (row != col)
    dots = jnp.einsum("nd,md->nm", x, everyone, precision=jax.lax.Precision.HIGHEST)
    nearest = jnp.argmax(jnp.where(candidate, dots, -jnp.inf), axis=1)
    distance = jnp.sqrt(jnp.sum(jnp.square(x - everyone[nearest] + eps), axis=-1))
    return -jnp.log(distance + eps)
