"""Self-distillation losses without negatives: BYOL's regression, SimSiam's negative cosine
and DINO's cross-entropy against a centred, sharpened teacher."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jssl.losses._util import (
    _cosine,
    _embedding_std,
    _psum,
    _two_views,
)


def byol_loss(
    predictions: Sequence[jax.Array] | jax.Array,
    targets: Sequence[jax.Array] | jax.Array,
    axis_name: str | None = None,
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
    """BYOL's symmetric normalised regression (Grill et al. 2020, Eq. 2 and Sec. 3.1; VISSL
    vissl/losses/byol_loss.py ``regression_loss``).

    ``||q / |q| - z / |z|||^2 = 2 - 2 cos(q, z)`` between the online prediction of one view and
    the target projection of the other, summed over both directions (the paper's
    ``L + L~``, VISSL's ``loss1 + loss2``): each example's term lies in [0, 8].

    Args:
      predictions: (2, n, d): the online network's predictor output for view 1 and view 2.
      targets: (2, n, d): the target (EMA) network's projections of the same views; their
        gradient is stopped here (VISSL ``target_embs.detach()``).
      axis_name: only for the ``target_std`` diagnostic over the global batch.

    Returns:
      (mean over the local examples, metrics, (n,) per-example losses).
    """
    q = _two_views(predictions, "predictions")
    z = jax.lax.stop_gradient(_two_views(targets, "targets"))
    cosine = _cosine(q, z[::-1])  # (2, n): view 1's prediction against view 2's target
    per_example = jnp.sum(2.0 - 2.0 * cosine, axis=0)
    metrics = {"cosine": jnp.mean(cosine), "target_std": _embedding_std(z, axis_name)}
    return jnp.mean(per_example), metrics, per_example


def simsiam_loss(
    predictions: Sequence[jax.Array] | jax.Array,
    targets: Sequence[jax.Array] | jax.Array,
    axis_name: str | None = None,
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
    """SimSiam's symmetrised negative cosine with stop-gradient (Chen & He 2021, Eq. 1-4 and
    Alg. 1; facebookresearch/simsiam main_simsiam.py).

    ``D(p1, sg(z2)) / 2 + D(p2, sg(z1)) / 2`` with ``D(p, z) = -cos(p, z)``: each example's term
    lies in [-1, 1]. Without the stop-gradient the outputs collapse (the paper's Sec. 4.1).

    Args:
      predictions: (2, n, d): predictor outputs p1, p2.
      targets: (2, n, d): the projections z1, z2 of the same network; their gradient is
        stopped here.
      axis_name: only for the ``output_std`` diagnostic over the global batch.

    Returns:
      (mean over the local examples, metrics, (n,) per-example losses).
    """
    p = _two_views(predictions, "predictions")
    z = jax.lax.stop_gradient(_two_views(targets, "targets"))
    cosine = _cosine(p, z[::-1])  # (2, n)
    per_example = -jnp.mean(cosine, axis=0)
    metrics = {"cosine": jnp.mean(cosine), "output_std": _embedding_std(z, axis_name)}
    return jnp.mean(per_example), metrics, per_example


def dino_cross_entropy(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    center: jax.Array,
    student_temp: float | jax.Array,
    teacher_temp: float | jax.Array,
    axis_name: str | None = None,
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
    """DINO's loss: ``(loss, metrics, per_example)``.

    ``student_logits``: (C, n, K), the student head's output for every crop of n images;
    ``teacher_logits``: (T, n, K) for the teacher's crops, which are the student's crops
    0..T-1 (the global crops; VISSL ``crops_for_teacher: [0, 1]``). The teacher's
    distribution is centred and sharpened, ``P_t = softmax((t - center) / teacher_temp)``,
    without gradient; the student's is ``log_softmax(s / student_temp)``; the loss averages
    ``H(P_t, P_s) = -sum_k P_t log P_s`` over every (teacher crop t, student crop v) pair with
    v != t (Caron et al. 2021, Eq. 3 and Alg. 1; VISSL vissl/losses/dino_loss.py ``forward``):
    ``per_example[i]`` is that mean for image i, the loss its mean over the local images.

    Metrics (monitoring collapse, Caron et al. 2021 Sec. 5.3): ``teacher_entropy``, the mean
    entropy of the teacher's distributions (0 when one dimension dominates), and
    ``teacher_mean_entropy``, the entropy of their mean over the global batch (log K when the
    teacher is uniform, near 0 when every image goes to one dimension); ``student_entropy``.
    """
    cross, different, metrics = _dino_pairs(
        student_logits, teacher_logits, center, student_temp, teacher_temp, axis_name
    )
    pairs = int(different.sum())  # T * (C - 1)
    per_example = jnp.sum(jnp.where(different[..., None], cross, 0.0), axis=(0, 1)) / pairs
    return jnp.mean(per_example), metrics, per_example


def dino_teacher_crop_losses(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    center: jax.Array,
    student_temp: float | jax.Array,
    teacher_temp: float | jax.Array,
    axis_name: str | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DINO's loss per teacher crop: ``((T, n) losses, metrics)``.

    Row t is the cross-entropy ``H(P_t, P_s)`` of teacher crop t's distribution against the
    student's of every other crop, averaged over those C - 1 student crops (VISSL
    dino_loss.py's inner loop for one ``iq``); :func:`dino_cross_entropy` is the mean of the
    rows. Arguments and metrics are :func:`dino_cross_entropy`'s.
    """
    cross, different, metrics = _dino_pairs(
        student_logits, teacher_logits, center, student_temp, teacher_temp, axis_name
    )
    per_teacher = jnp.sum(jnp.where(different[..., None], cross, 0.0), axis=1)
    return per_teacher / different.sum(axis=1)[:, None], metrics


def _dino_pairs(student_logits, teacher_logits, center, student_temp, teacher_temp, axis_name):
    """``cross[t, v, i] = H(P_t, P_s)`` of teacher crop t and student crop v for image i, the
    (T, C) mask of the pairs of different crops, and the collapse metrics."""
    student_logits = jnp.asarray(student_logits, jnp.float32)
    teacher_logits = jnp.asarray(teacher_logits, jnp.float32)
    num_student, num_teacher = student_logits.shape[0], teacher_logits.shape[0]
    if teacher_logits.shape[1:] != student_logits.shape[1:] or num_teacher > num_student:
        raise ValueError(
            f"teacher logits {teacher_logits.shape} must be (T, n, K) for T <= C of the student "
            f"logits {student_logits.shape}: the teacher's crops are the student's first T."
        )
    if num_student < 2:
        raise ValueError("DINO compares different crops of an image: it needs at least two.")
    teacher_probs = jax.lax.stop_gradient(
        jax.nn.softmax((teacher_logits - center) / teacher_temp, axis=-1)
    )
    student_log_probs = jax.nn.log_softmax(student_logits / student_temp, axis=-1)
    cross = -jnp.einsum(
        "tik,vik->tvi", teacher_probs, student_log_probs, precision=jax.lax.Precision.HIGHEST
    )
    different = np.arange(num_teacher)[:, None] != np.arange(num_student)[None, :]

    def entropy(log_p):
        return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)

    teacher_log_probs = jnp.log(jnp.maximum(teacher_probs, 1e-30))
    n = teacher_probs.shape[1]
    mean_probs = _psum(jnp.sum(teacher_probs, axis=(0, 1)), axis_name) / _psum(
        jnp.asarray(num_teacher * n, jnp.float32), axis_name
    )
    metrics = {
        "teacher_entropy": jnp.mean(entropy(teacher_log_probs)),
        "teacher_mean_entropy": entropy(jnp.log(jnp.maximum(mean_probs, 1e-30))),
        "student_entropy": jnp.mean(entropy(student_log_probs)),
    }
    return cross, different, metrics


def dino_batch_center(teacher_logits: jax.Array, axis_name: str | None = None) -> jax.Array:
    """The mean teacher output over every teacher crop of the GLOBAL batch, (K,): the new
    term of DINO's centre (VISSL ``update_center``: sum, all-reduce, divide by the rows of
    every rank)."""
    logits = jnp.asarray(teacher_logits, jnp.float32).reshape(-1, teacher_logits.shape[-1])
    total = _psum(jnp.sum(logits, axis=0), axis_name)
    rows = _psum(jnp.asarray(logits.shape[0], jnp.float32), axis_name)
    return total / rows


def dino_update_center(
    center: jax.Array, batch_center: jax.Array, momentum: float | jax.Array
) -> jax.Array:
    """``momentum * center + (1 - momentum) * batch_center`` (Caron et al. 2021, Eq. 4)."""
    return center * momentum + batch_center * (1.0 - momentum)
