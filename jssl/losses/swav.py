"""SwAV's swapped prediction with codes from Sinkhorn-Knopp over the global batch."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jssl import parallel
from jssl.losses._util import (
    _global_logsumexp,
    _precision,
    _psum,
    _stack_crops,
)


def sinkhorn_knopp(
    scores: jax.Array,
    epsilon: float = 0.05,
    num_iters: int = 3,
    axis_name: str | None = None,
    sample_mask: jax.Array | None = None,
    hard_assignment: bool | jax.Array = False,
    use_double_precision: bool = False,
) -> jax.Array:
    """SwAV's codes: equipartitioned soft assignments of samples to prototypes.

    Follows Caron et al. 2020, Sec. 3.1 and Alg. 1 (``distributed_sinkhorn``) and VISSL
    vissl/losses/distibuted_sinkhornknopp.py: ``Q = exp(scores / epsilon)`` divided by its
    global sum, then ``num_iters`` times: each prototype's total mass (summed over ALL devices)
    is scaled to 1/K, then each sample's mass to 1/N, N the global number of samples; finally
    each sample's assignment is scaled to sum to 1 (``Q *= B`` in the paper). Every sum that
    spans samples runs over ``axis_name``, so a sample's codes do not depend on the device count.

    Deliberate difference: the iteration runs on ``log Q`` (each scaling is a subtraction of a
    log-sum-exp; the sums over samples combine a ``pmax`` and a ``psum``). In exact arithmetic it
    is VISSL's multiplicative iteration, but no sample's or prototype's mass can underflow to
    0 in float32, since each is normalised relative to its own maximum. VISSL's float32 path
    (swav_loss.py) subtracts the global maximum before ``exp``, so a sample whose scores all
    lie more than ~87 * epsilon below it gets an all-zero column (then the 1e-12 guard and
    the inf replacements of distibuted_sinkhornknopp.py), which is what its float64 option,
    ``use_double_precision``, is there to avoid. Here float64 is still offered.

    Args:
      scores: (B, K) similarities of this replica's samples to the K prototypes. The result
        carries no gradient (the codes are targets).
      epsilon: the entropy regularisation; scores are divided by it (SwAV: 0.05).
      num_iters: Sinkhorn iterations (SwAV: 3).
      axis_name: the mesh axis for per-replica use inside ``jax.shard_map``, or None.
      sample_mask: optional (B,) booleans; samples that are False take no part (their codes
        are 0 and they do not count in N). Lets a jitted step switch SwAV's queue rows on and
        off without a change of shapes.
      hard_assignment: one-hot codes (the argmax) instead of soft ones; VISSL's
        ``temp_hard_assignment_iters``. May be a traced boolean.
      use_double_precision: compute in float64 (VISSL's ``use_double_precision``). JAX has
        float64 only with ``jax_enable_x64``; without it this raises a ValueError. Rarely
        needed: the log-domain iteration does not underflow in float32.

    Returns:
      (B, K) float32 codes; each valid row sums to 1.
    """
    dtype = _precision(use_double_precision)
    log_q = jax.lax.stop_gradient(scores).astype(dtype) / jnp.asarray(epsilon, dtype)
    num_samples, num_prototypes = log_q.shape
    if sample_mask is None:
        sample_mask = jnp.ones((num_samples,), bool)
    valid = sample_mask.astype(bool)[:, None]
    log_q = jnp.where(valid, log_q, -jnp.inf)
    # Scaling Q by 1 / sum(Q) is a shift of log Q: it only matters to the iterates, not to the
    # result, but keeps them the paper's (and VISSL's) transport plans.
    log_q = log_q - _global_logsumexp(log_q, None, axis_name)
    log_samples = jnp.log(_psum(jnp.sum(valid, dtype=dtype), axis_name))

    def iteration(_, log_q):
        # Each prototype's mass over the global batch -> 1 / K.
        log_q = log_q - _global_logsumexp(log_q, 0, axis_name) - jnp.log(num_prototypes)
        # Each sample's mass (local: no collective) -> 1 / N.
        return log_q - _sample_logsumexp(log_q, valid) - log_samples

    log_q = jax.lax.fori_loop(0, num_iters, iteration, log_q)
    q = jnp.exp(log_q - _sample_logsumexp(log_q, valid)).astype(jnp.float32)
    one_hot = jax.nn.one_hot(jnp.argmax(q, axis=1), num_prototypes, dtype=q.dtype)
    return jnp.where(jnp.asarray(hard_assignment) & valid, one_hot, q)


def swav_loss(
    scores: Sequence[jax.Array] | jax.Array,
    crops_for_assign: Sequence[int] = (0, 1),
    temperature: float = 0.1,
    epsilon: float = 0.05,
    num_iters: int = 3,
    queue_scores: jax.Array | None = None,
    use_queue: bool | jax.Array = True,
    axis_name: str | None = None,
    hard_assignment: bool | jax.Array = False,
    use_double_precision: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
    """SwAV's swapped-prediction loss for one prototype set (Caron et al. 2020, Eq. 1-3 and
    Alg. 1; VISSL vissl/losses/swav_loss.py ``SwAVCriterion.forward``): the mean over the
    assignment crops of :func:`swav_crop_losses` (VISSL: ``total_loss /= n_term_loss``), so the
    loss scale does not grow with the number of crops. With several prototype sets, VISSL's
    ``SwAVLoss.forward`` averages this over the sets; the method does that.

    Returns the mean loss over local images (the train step's pmean makes it the global mean;
    the codes, the only cross-device part, carry no gradient), the diagnostics of
    :func:`swav_crop_losses`, and the (B,) per-image losses whose mean is the loss. The
    arguments are :func:`swav_crop_losses`'.
    """
    per_crop, metrics = swav_crop_losses(
        scores,
        crops_for_assign,
        temperature,
        epsilon,
        num_iters,
        queue_scores,
        use_queue,
        axis_name,
        hard_assignment,
        use_double_precision,
    )
    per_example = (jnp.sum(per_crop, axis=0) / per_crop.shape[0]).astype(jnp.float32)
    return jnp.mean(per_example), metrics, per_example


def swav_crop_losses(
    scores: Sequence[jax.Array] | jax.Array,
    crops_for_assign: Sequence[int] = (0, 1),
    temperature: float = 0.1,
    epsilon: float = 0.05,
    num_iters: int = 3,
    queue_scores: jax.Array | None = None,
    use_queue: bool | jax.Array = True,
    axis_name: str | None = None,
    hard_assignment: bool | jax.Array = False,
    use_double_precision: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """SwAV's swapped-prediction loss of each assignment crop, for one prototype set (Caron et
    al. 2020, Eq. 1-3 and Alg. 1; VISSL vissl/losses/swav_loss.py ``SwAVCriterion.forward``,
    its ``loss`` of one ``crop_id`` before ``total_loss /= n_term_loss``).

    For each crop ``a`` in ``crops_for_assign`` the codes ``q_a = sinkhorn_knopp(scores_a)``
    (no gradient) are predicted from every other crop ``v`` by
    ``-sum_k q_a log softmax(scores_v / T)`` per image, averaged over the C - 1 predicting
    crops (VISSL: ``loss /= len(idx_crop_pred)``). :func:`swav_loss` is their mean over the
    assignment crops; the SwAV method weighs each as its own loss term.

    The queue (SwAV's small-batch option, VISSL ``local_queue*``): ``queue_scores[i]`` are the
    scores of this replica's queued embeddings of assignment crop ``crops_for_assign[i]``
    against the current prototypes. They are joined to the batch's scores before Sinkhorn, so
    the equipartition covers batch plus queue over all devices, and only the batch's codes are
    kept. VISSL appends the queue after the batch (the SwAV repository prepends it); Sinkhorn
    treats samples symmetrically, so the order does not matter.

    Args:
      scores: C arrays (B, K) (or one (C, B, K) array): prototype scores (cosine similarities of
        the normalised embeddings to the normalised prototypes) of each crop of this replica's
        B images, aligned across crops.
      crops_for_assign: the crops whose codes are targets (SwAV: the two large crops, [0, 1]).
      temperature: the predictions' softmax temperature (SwAV: 0.1).
      epsilon, num_iters, hard_assignment, use_double_precision: see :func:`sinkhorn_knopp`.
      queue_scores: optional (len(crops_for_assign), L, K) scores of the local queue; no
        gradient flows into them.
      use_queue: whether the queue rows take part; may be a traced boolean, so one jitted step
        serves before and after the epoch the queue starts (VISSL ``queue.start_iter``).
      axis_name: the mesh axis for per-replica use inside ``jax.shard_map``, or None.

    Returns:
      The (len(crops_for_assign), B) per-image losses of each assignment crop (float64 with
      ``use_double_precision``, else float32), and diagnostics (``code_entropy``: mean entropy
      of the codes, ``swapped_acc``: how often a crop's predicted prototype is the target's).
    """
    scores = _stack_crops(scores, "scores")
    num_crops, batch, _ = scores.shape
    crops_for_assign = tuple(int(c) for c in crops_for_assign)
    _check_inputs(scores.shape, crops_for_assign, queue_scores)
    dtype = _precision(use_double_precision)
    # VISSL computes the log-softmax in float64 too when use_double_precision is set.
    log_prob = jax.nn.log_softmax(scores.astype(dtype) / jnp.asarray(temperature, dtype), -1)
    sinkhorn = dict(
        epsilon=epsilon,
        num_iters=num_iters,
        axis_name=axis_name,
        hard_assignment=hard_assignment,
        use_double_precision=use_double_precision,
    )
    per_crop, entropy, agree = [], [], []
    for i, crop in enumerate(crops_for_assign):
        crop_scores = scores[crop]
        if per_crop:  # one Sinkhorn loop after the other (parallel.after)
            crop_scores = parallel.after(crop_scores, per_crop[-1])
        queued = None if queue_scores is None else queue_scores[i].astype(scores.dtype)
        codes = _codes(crop_scores, queued, use_queue, sinkhorn)
        others = jnp.array([v for v in range(num_crops) if v != crop])
        cross_entropy = -jnp.sum(codes.astype(dtype)[None] * log_prob[others], axis=-1)
        per_crop.append(jnp.mean(cross_entropy, axis=0))
        entropy.append(-jnp.sum(jnp.where(codes > 0, codes * jnp.log(codes), 0.0), axis=-1))
        target = jnp.argmax(codes, axis=-1)
        agree.append(jnp.argmax(scores[others], axis=-1) == target[None])
    metrics = {
        "code_entropy": jnp.mean(jnp.stack(entropy)),
        "swapped_acc": jnp.mean(jnp.stack(agree).astype(jnp.float32)),
    }
    return jnp.stack(per_crop), metrics


def _check_inputs(shape, crops_for_assign: tuple[int, ...], queue_scores) -> None:
    """swav_crop_losses's argument checks, each error saying what the shapes must be."""
    num_crops, _, num_prototypes = shape
    if num_crops < 2:
        raise ValueError(
            f"swav_loss got the scores of {num_crops} crop(s); swapped prediction needs at "
            "least 2 crops per image."
        )
    if not crops_for_assign or any(not 0 <= c < num_crops for c in crops_for_assign):
        raise ValueError(
            f"crops_for_assign={list(crops_for_assign)} must name at least one crop index in "
            f"[0, {num_crops}) (there are {num_crops} crops); SwAV assigns from the large "
            "crops, [0, 1]."
        )
    if queue_scores is not None and (
        queue_scores.ndim != 3
        or queue_scores.shape[0] != len(crops_for_assign)
        or queue_scores.shape[2] != num_prototypes
    ):
        raise ValueError(
            f"queue_scores has shape {tuple(queue_scores.shape)}; it must be "
            f"(len(crops_for_assign)={len(crops_for_assign)}, queue length, "
            f"num_prototypes={num_prototypes}): one queue per assignment crop."
        )


def _codes(crop_scores: jax.Array, queued, use_queue, sinkhorn: dict) -> jax.Array:
    """The batch's codes of one assignment crop (no gradient): Sinkhorn over the batch's scores
    and, where there is a queue, its rows too (masked out until ``use_queue``)."""
    batch, mask = len(crop_scores), None
    if queued is not None:
        crop_scores = jnp.concatenate([crop_scores, queued])
        in_use = jnp.broadcast_to(jnp.asarray(use_queue), (len(queued),))
        mask = jnp.concatenate([jnp.ones((batch,), bool), in_use])
    codes = sinkhorn_knopp(crop_scores, sample_mask=mask, **sinkhorn)[:batch]
    return jax.lax.stop_gradient(codes)


def _sample_logsumexp(log_q: jax.Array, valid: jax.Array) -> jax.Array:
    """Each sample's log-mass over prototypes; 0 for masked samples (all -inf), which stay so."""
    return jnp.where(valid, jax.nn.logsumexp(log_q, axis=1, keepdims=True), 0.0)
