"""Pure loss functions of the SSL methods. No model code: inputs are embeddings or scores.

The losses run per replica inside ``jax.shard_map`` over the ``data`` mesh axis; those whose
terms span the global batch (SimCLR's negatives, SwAV's Sinkhorn sums) take that axis as
``axis_name`` (None: a single device, no collectives). Each returns the mean over its LOCAL
examples: the train step's ``pmean`` of loss and gradients then yields the global mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def l2_normalize(x: jax.Array, axis: int = -1, eps: float = 1e-12) -> jax.Array:
    """x / max(||x||, eps), as torch.nn.functional.normalize (the references use it)."""
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True))
    return x / jnp.maximum(norm, eps)


def info_nce_with_queue(
    query: jax.Array, key: jax.Array, queue: jax.Array, temperature: float
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
    """MoCo's InfoNCE loss (He et al. 2020, Eq. 1; VISSL vissl/losses/moco_loss.py).

    Args:
      query: (n, d) online-encoder embeddings (normalised here).
      key: (n, d) momentum-encoder embeddings of the other view, the positives (normalised
        here; the caller stops their gradient).
      queue: (K, d) L2-normalised keys of earlier batches, the negatives.
      temperature: logits are divided by it.

    Returns:
      The mean cross-entropy of classifying the positive (index 0) among 1 + K logits,
      per-batch diagnostics (accuracy of that classification, mean positive/negative
      cosine similarity), and the (n,) per-example losses.
    """
    query = l2_normalize(query.astype(jnp.float32))
    key = l2_normalize(key.astype(jnp.float32))
    pos = jnp.sum(query * key, axis=-1, keepdims=True)  # (n, 1)
    neg = query @ queue.astype(jnp.float32).T  # (n, K)
    logits = jnp.concatenate([pos, neg], axis=1) / temperature
    per_example = jax.nn.logsumexp(logits, axis=1) - logits[:, 0]
    metrics = {
        "contrastive_acc": jnp.mean((jnp.argmax(logits, axis=1) == 0).astype(jnp.float32)),
        "pos_similarity": jnp.mean(pos),
        "neg_similarity": jnp.mean(neg),
    }
    return jnp.mean(per_example), metrics, per_example


# --------------------------------------------------------------------------------------------
# SimCLR: InfoNCE (NT-Xent) over the global batch, 2 views or multi-crop.
# --------------------------------------------------------------------------------------------


def simclr_info_nce(
    view1: jax.Array,
    view2: jax.Array,
    temperature: float = 0.1,
    axis_name: str | None = None,
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
    """SimCLR's NT-Xent loss (Chen et al. 2020, Eq. 1; VISSL vissl/losses/simclr_info_nce_loss.py).

    Each local example's two views are anchors; an anchor's positive is the other view of its
    image and its negatives are the 2N - 2 other embeddings of the GLOBAL batch of N images
    (its own similarity is left out of the denominator):
    ``-log(exp(s_ap / T) / sum_{k != a} exp(s_ak / T))`` with cosine similarities ``s``.

    With ``axis_name`` the embeddings of every replica are gathered with
    ``jax.lax.all_gather(tiled=True)``. Gradients flow back through the gathered copies (the
    transpose of all_gather is a psum_scatter), which is what VISSL's ``GatherLayer``
    (vissl/utils/distributed_gradients.py: all_reduce of the gradients, then this rank's slice)
    does by hand; an early VISSL version gathered with classy_vision's ``gather_from_all``,
    which cut those gradients.

    Normalisation as VISSL: the mean over this replica's 2n anchors (``torch.mean`` over the
    local rows). With equal local batches the train step's ``pmean`` of losses and gradients
    then gives the loss averaged over all 2N anchors and exactly its gradient, the same on any
    number of devices (VISSL: DDP averages the gradients; GatherLayer sums the cross-replica
    parts). This is :func:`multicrop_simclr_info_nce` with two crops.

    Args:
      view1: (n, d) embeddings of the first view of this replica's n images (normalised here).
      view2: (n, d) embeddings of the second view, aligned with ``view1``.
      temperature: similarities are divided by it (VISSL's SimCLR recipes: 0.1).
      axis_name: the mesh axis the batch is sharded on (``jssl.parallel.DATA_AXIS``) when called
        per replica inside ``jax.shard_map``; None on a single device (no collectives).

    Returns:
      The mean loss over local anchors; diagnostics (``contrastive_acc``: the positive beats
      every negative, ``pos_similarity``, ``neg_similarity``: mean cosines); and the (n,)
      per-image losses (mean over the image's two anchors), whose mean is the loss.
    """
    return multicrop_simclr_info_nce([view1, view2], temperature, axis_name)


def multicrop_simclr_info_nce(
    crops: Sequence[jax.Array] | jax.Array,
    temperature: float = 0.1,
    axis_name: str | None = None,
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
    """SimCLR's loss over C crops per image (VISSL vissl/losses/multicrop_simclr_info_nce_loss.py).

    Every crop is an anchor, and every OTHER crop of its image is one of its positives; each
    (anchor, positive) pair is one term ``-log(e_ap / (e_ap + sum_neg e_an))`` with
    ``e = exp(cos / T)``, whose negatives are all crops of all OTHER images of the global batch
    (neither the anchor itself nor the other crops of its image are negatives). The loss is the
    mean over this replica's ``n * C * (C - 1)`` (anchor, positive) pairs, VISSL's
    ``loss /= Z``; with C = 2 this is exactly :func:`simclr_info_nce`.

    Deliberate difference: VISSL's multi-crop criterion gathers the embeddings of every rank
    but its negative mask is zero outside the own rank's block (``neg = np.zeros`` for
    ``i != rank`` in ``precompute_pos_neg_mask``), so its negatives are the local batch only
    and the loss changes with the number of GPUs. Here the negatives come from the global
    batch, as in VISSL's two-view loss, so 1 and 4 devices give the same loss and gradients.

    Args:
      crops: C >= 2 arrays of shape (n, d) (or one (C, n, d) array): the embeddings of each crop
        of this replica's n images, aligned across crops. All crops, large and small, share
        the head, hence d.
      temperature: similarities are divided by it.
      axis_name: as in :func:`simclr_info_nce`.

    Returns:
      (loss, metrics, per_example) as :func:`simclr_info_nce`; per_example is the mean over
      the image's C * (C - 1) pairs.
    """
    z = l2_normalize(_stack_crops(crops, "crops").astype(jnp.float32))  # (C, n, d)
    num_crops, n, _ = z.shape
    if num_crops < 2:
        raise ValueError(
            f"multicrop_simclr_info_nce got {num_crops} crop(s); it needs at least 2 views of "
            "each image (the positives): pass every crop's embeddings."
        )
    if axis_name is None:
        everyone, first = z, 0
    else:
        # (C, R * n, d): global image index = replica * n + local index, the 1-device order.
        everyone = jax.lax.all_gather(z, axis_name, axis=1, tiled=True)
        first = jax.lax.axis_index(axis_name) * n
    cos = jnp.einsum("aid,bjd->aibj", z, everyone)  # (C, n, C, N): anchors x candidates
    own = jnp.arange(everyone.shape[1])[None, :] == (first + jnp.arange(n))[:, None]  # (n, N)
    negative = ~own[None, :, None, :]
    log_neg = jax.nn.logsumexp(jnp.where(negative, cos / temperature, -jnp.inf), axis=(2, 3))

    # Positives are the anchor's own image, always local: no need to read them from the gather.
    pos = jnp.einsum("aid,bid->aib", z, z)  # (C, n, C)
    pair = ~jnp.eye(num_crops, dtype=bool)[:, None, :]  # (C, 1, C): other crops only
    pos_logit = pos / temperature
    pair_loss = jnp.logaddexp(pos_logit, log_neg[:, :, None]) - pos_logit  # (C, n, C)
    num_pairs = num_crops * (num_crops - 1)
    per_example = jnp.sum(jnp.where(pair, pair_loss, 0.0), axis=(0, 2)) / num_pairs

    max_neg = jnp.max(jnp.where(negative, cos, -jnp.inf), axis=(2, 3))  # (C, n)
    num_neg = num_crops * (everyone.shape[1] - 1)
    metrics = {
        "contrastive_acc": jnp.sum(jnp.where(pair, pos > max_neg[:, :, None], False))
        / (n * num_pairs),
        "pos_similarity": jnp.sum(jnp.where(pair, pos, 0.0)) / (n * num_pairs),
        "neg_similarity": jnp.sum(jnp.where(negative, cos, 0.0)) / (num_crops * n * num_neg),
    }
    return jnp.mean(per_example), metrics, per_example


# --------------------------------------------------------------------------------------------
# SwAV: Sinkhorn-Knopp codes over the global batch, swapped prediction.
# --------------------------------------------------------------------------------------------


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
    Alg. 1; VISSL vissl/losses/swav_loss.py ``SwAVCriterion.forward``).

    For each crop ``a`` in ``crops_for_assign`` the codes ``q_a = sinkhorn_knopp(scores_a)``
    (no gradient) are predicted from every other crop ``v`` by
    ``-mean_b sum_k q_a log softmax(scores_v / T)``; the terms are averaged over the C - 1
    predicting crops and then over the assignment crops (VISSL: ``loss /= len(idx_crop_pred)``,
    ``total_loss /= n_term_loss``), so the loss scale does not grow with the number of crops.
    With several prototype sets, VISSL's ``SwAVLoss.forward`` averages this over the sets;
    the method does that.

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
      The mean loss over local images (the train step's pmean makes it the global mean; the
      codes, the only cross-device part, carry no gradient), diagnostics (``code_entropy``:
      mean entropy of the codes, ``swapped_acc``: how often a crop's predicted prototype is the
      target's), and the (B,) per-image losses whose mean is the loss.
    """
    scores = _stack_crops(scores, "scores")
    num_crops, batch, num_prototypes = scores.shape
    crops_for_assign = tuple(int(c) for c in crops_for_assign)
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

    dtype = _precision(use_double_precision)
    # VISSL computes the log-softmax in float64 too when use_double_precision is set.
    log_prob = jax.nn.log_softmax(scores.astype(dtype) / jnp.asarray(temperature, dtype), -1)
    per_example = jnp.zeros((batch,), dtype)
    entropy, agree = [], []
    for i, crop in enumerate(crops_for_assign):
        crop_scores, mask = scores[crop], None
        if queue_scores is not None:
            queued = queue_scores[i].astype(scores.dtype)
            crop_scores = jnp.concatenate([crop_scores, queued])
            mask = jnp.concatenate(
                [jnp.ones((batch,), bool), jnp.broadcast_to(jnp.asarray(use_queue), (len(queued),))]
            )
        codes = sinkhorn_knopp(
            crop_scores,
            epsilon,
            num_iters,
            axis_name,
            sample_mask=mask,
            hard_assignment=hard_assignment,
            use_double_precision=use_double_precision,
        )[:batch]
        codes = jax.lax.stop_gradient(codes)
        others = jnp.array([v for v in range(num_crops) if v != crop])
        cross_entropy = -jnp.sum(codes.astype(dtype)[None] * log_prob[others], axis=-1)
        per_example = per_example + jnp.mean(cross_entropy, axis=0)
        entropy.append(-jnp.sum(jnp.where(codes > 0, codes * jnp.log(codes), 0.0), axis=-1))
        target = jnp.argmax(codes, axis=-1)
        agree.append(jnp.argmax(scores[others], axis=-1) == target[None])
    per_example = (per_example / len(crops_for_assign)).astype(jnp.float32)
    metrics = {
        "code_entropy": jnp.mean(jnp.stack(entropy)),
        "swapped_acc": jnp.mean(jnp.stack(agree).astype(jnp.float32)),
    }
    return jnp.mean(per_example), metrics, per_example


def _stack_crops(crops: Sequence[jax.Array] | jax.Array, name: str) -> jax.Array:
    if isinstance(crops, (list, tuple)):
        shapes = {tuple(c.shape) for c in crops}
        if len(shapes) > 1:
            raise ValueError(
                f"The {name} of all crops must have one shape (images x dim), got "
                f"{sorted(shapes)}: every crop needs the same images, in the same order."
            )
        return jnp.stack(crops)
    if crops.ndim != 3:
        raise ValueError(f"{name} must be (crops, images, dim), got shape {crops.shape}.")
    return crops


def _precision(use_double_precision: bool) -> jnp.dtype:
    if not use_double_precision:
        return jnp.float32
    if not jax.config.read("jax_enable_x64"):
        raise ValueError(
            "use_double_precision=True needs float64 in JAX, which is off: enable it at start-up "
            "(jax.config.update('jax_enable_x64', True) or JAX_ENABLE_X64=1), or set "
            "use_double_precision=False (the Sinkhorn iteration runs in the log domain, so "
            "float32 neither overflows nor underflows there)."
        )
    return jnp.float64


def _psum(x: jax.Array, axis_name: str | None) -> jax.Array:
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def _pmax(x: jax.Array, axis_name: str | None) -> jax.Array:
    return x if axis_name is None else jax.lax.pmax(x, axis_name)


def _global_logsumexp(x: jax.Array, axis: int | None, axis_name: str | None) -> jax.Array:
    """log sum exp of x over ``axis`` (None: all) and over every replica, keeping dims."""
    top = _pmax(jnp.max(x, axis=axis, keepdims=True), axis_name)
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    total = _psum(jnp.sum(jnp.exp(x - top), axis=axis, keepdims=True), axis_name)
    return top + jnp.log(total)


def _sample_logsumexp(log_q: jax.Array, valid: jax.Array) -> jax.Array:
    """Each sample's log-mass over prototypes; 0 for masked samples (all -inf), which stay so."""
    return jnp.where(valid, jax.nn.logsumexp(log_q, axis=1, keepdims=True), 0.0)


# --------------------------------------------------------------------------------------------
# Supervised: cross-entropy with label smoothing, and top-k hits (VISSL's accuracy meter).
# --------------------------------------------------------------------------------------------


def cross_entropy(logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0) -> jax.Array:
    """Per-example cross-entropy of integer ``labels`` under ``logits`` (n, K), (n,).

    VISSL's ``cross_entropy_multiple_output_single_target`` (SmoothCrossEntropy) with one
    output: with ``label_smoothing`` s the target is ``(1 - s) * one_hot + s / K`` and the loss
    ``-sum(target * log_softmax(logits))``; s = 0 is the plain cross-entropy.
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    num_classes = logits.shape[-1]
    targets = (1.0 - label_smoothing) * jax.nn.one_hot(labels, num_classes) + (
        label_smoothing / num_classes
    )
    return -jnp.sum(targets * log_probs, axis=-1)


def top_k_hits(
    logits: jax.Array, labels: jax.Array, ks: Sequence[int] = (1, 5)
) -> dict[int, jax.Array]:
    """``{k: (n,) float 1.0 where the label is among the k highest logits, else 0.0}``.

    VISSL's ``accuracy_list_meter`` (topk_values [1, 5]) counts these hits over the test set;
    per example, so that padding rows can be left out exactly. k above the number of classes
    counts every example (as top-5 of a 3-class problem would).
    """
    k_max = min(max(ks), logits.shape[-1])
    _, top = jax.lax.top_k(logits.astype(jnp.float32), k_max)
    match = top == labels[:, None]
    return {k: jnp.any(match[:, : min(k, k_max)], axis=-1).astype(jnp.float32) for k in ks}


# Barlow Twins and VICReg: statistics of two views' embeddings over the global batch.
# --------------------------------------------------------------------------------------------


def barlow_twins_terms(
    view1: jax.Array,
    view2: jax.Array,
    *,
    normalize_jointly: bool = True,
    eps: float = 1e-5,
    axis_name: str | None = None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Barlow Twins' two terms (Zbontar et al. 2021, Eq. 1; VISSL
    vissl/losses/barlow_twins_loss.py ``BarlowTwinsCriterion``), unweighted.

    The embeddings are standardised per feature over the GLOBAL batch (mean and biased
    variance, ``(z - mean) / sqrt(var + eps)``, VISSL's ``SyncNormalizeFunction``), and the
    cross-correlation of the two views is ``C = sum_b a_b b_b^T / N`` over the N images of the
    global batch (VISSL: each rank's ``a^T b / n`` averaged over ranks). The terms are

      invariance            sum_i (1 - C_ii)^2           (on-diagonal)
      redundancy_reduction  sum_{i != j} C_ij^2          (off-diagonal)

    and VISSL's loss is ``scale_loss * (invariance + lambda_ * redundancy_reduction)``.

    Every sum over the batch is a ``psum`` over ``axis_name``, in two passes (the mean first,
    then centred squares; VISSL uses E[z^2] - E[z]^2 in one), so the value and its gradient
    are those of the global batch on any number of devices.

    Args:
      view1, view2: (n, d) embeddings of this replica's n images, aligned.
      normalize_jointly: True (VISSL): one mean and variance over the 2N rows of both views,
        as VISSL normalises the concatenated batch of both copies; False (the paper's
        code, ``BatchNorm1d(affine=False)`` on each view): separate statistics per view.
      eps: added to the variance (VISSL's criterion and BatchNorm1d: 1e-5).
      axis_name: the mesh axis the batch is sharded on, or None on one device.

    Returns:
      ``terms``: {"invariance", "redundancy_reduction"}, each the batch-level value broadcast
      to the (n,) local rows; ``metrics``: the mean diagonal and the root-mean-square
      off-diagonal entry of C.
    """
    a = view1.astype(jnp.float32)
    b = view2.astype(jnp.float32)
    n, d = a.shape
    if b.shape != a.shape:
        raise ValueError(f"barlow_twins_terms: view shapes differ, {a.shape} vs {b.shape}.")
    if normalize_jointly:
        both = _standardize(jnp.concatenate([a, b]), eps, axis_name)
        a, b = both[:n], both[n:]
    else:
        a, b = _standardize(a, eps, axis_name), _standardize(b, eps, axis_name)
    total = n * _num_replicas(axis_name)
    corr = _psum(a.T @ b, axis_name) / total  # (d, d)
    diagonal = jnp.diagonal(corr)
    off_diagonal = jnp.where(jnp.eye(d, dtype=bool), 0.0, corr)
    invariance = jnp.sum(jnp.square(1.0 - diagonal))
    redundancy = jnp.sum(jnp.square(off_diagonal))
    terms = {
        "invariance": jnp.broadcast_to(invariance, (n,)),
        "redundancy_reduction": jnp.broadcast_to(redundancy, (n,)),
    }
    metrics = {
        "cross_corr_diagonal": jnp.mean(diagonal),
        "cross_corr_off_diagonal_rms": jnp.sqrt(redundancy / max(d * (d - 1), 1)),
    }
    return terms, metrics


def vicreg_terms(
    view1: jax.Array,
    view2: jax.Array,
    *,
    std_target: float = 1.0,
    std_eps: float = 1e-4,
    axis_name: str | None = None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """VICReg's three terms (Bardes et al. 2022, Sec. 3.1-3.2, Eqs. 1-6), unweighted, as the
    authors' code computes them (facebookresearch/vicreg, main_vicreg.py ``VICReg.forward``).

      invariance  per image: mean over features of (z - z')^2 (the MSE, Eq. 5, is its mean)
      variance    (v(Z) + v(Z')) / 2, v(Z) = mean_j max(0, gamma - sqrt(Var(z^j) + eps)),
                  the unbiased variance over the global batch (Eq. 1)
      covariance  c(Z) + c(Z'), c(Z) = sum_{i != j} Cov(Z)_ij^2 / d, the covariance over the
                  global batch with N - 1 (Eqs. 3-4)

    The variance term halves the sum of both views as the authors' code does (the paper's
    Eq. 6 adds them; its weights 25/25/1 go with the code). Means and covariances are sums
    over every replica (``psum`` over ``axis_name``; the code gathers the embeddings), so the
    value and gradient are those of the global batch on any number of devices.

    Args:
      view1, view2: (n, d) expander outputs of this replica's n images, aligned.
      std_target: gamma, the standard deviation the hinge asks for (1).
      std_eps: added to the variance under the square root (1e-4).
      axis_name: the mesh axis the batch is sharded on, or None on one device.

    Returns:
      ``terms``: {"invariance": (n,) per image, "variance" and "covariance": batch-level
      values broadcast to the (n,) rows}; ``metrics``: ``embedding_std``, the mean standard
      deviation of a feature (both views), which collapse drives to 0.
    """
    x = view1.astype(jnp.float32)
    y = view2.astype(jnp.float32)
    n, d = x.shape
    if y.shape != x.shape:
        raise ValueError(f"vicreg_terms: view shapes differ, {x.shape} vs {y.shape}.")
    total = n * _num_replicas(axis_name)

    def variance_and_covariance(z):
        centred = z - _psum(jnp.sum(z, axis=0), axis_name) / total
        cov = _psum(centred.T @ centred, axis_name) / (total - 1)  # (d, d)
        var = jnp.diagonal(cov)
        variance = jnp.mean(jax.nn.relu(std_target - jnp.sqrt(var + std_eps)))
        covariance = jnp.sum(jnp.square(jnp.where(jnp.eye(d, dtype=bool), 0.0, cov))) / d
        return variance, covariance, jnp.mean(jnp.sqrt(jax.lax.stop_gradient(var)))

    var_x, cov_x, std_x = variance_and_covariance(x)
    var_y, cov_y, std_y = variance_and_covariance(y)
    terms = {
        "invariance": jnp.mean(jnp.square(x - y), axis=1),
        "variance": jnp.broadcast_to((var_x + var_y) / 2.0, (n,)),
        "covariance": jnp.broadcast_to(cov_x + cov_y, (n,)),
    }
    return terms, {"embedding_std": (std_x + std_y) / 2.0}


def _num_replicas(axis_name: str | None) -> int:
    return 1 if axis_name is None else jax.lax.psum(1, axis_name)


def _standardize(z: jax.Array, eps: float, axis_name: str | None) -> jax.Array:
    """Per feature, over the rows of every replica: (z - mean) / sqrt(biased var + eps)."""
    total = z.shape[0] * _num_replicas(axis_name)
    centred = z - _psum(jnp.sum(z, axis=0), axis_name) / total
    var = _psum(jnp.sum(jnp.square(centred), axis=0), axis_name) / total
    return centred * jax.lax.rsqrt(var + eps)


# BYOL and SimSiam: each view's prediction regressed onto the other view's (stop-gradient)
# target; no negatives.
# --------------------------------------------------------------------------------------------


def _cosine(a: jax.Array, b: jax.Array) -> jax.Array:
    """Row-wise cosine similarity of (..., d) arrays, in float32."""
    return jnp.sum(l2_normalize(a.astype(jnp.float32)) * l2_normalize(b.astype(jnp.float32)), -1)


def _two_views(x: Sequence[jax.Array] | jax.Array, name: str) -> jax.Array:
    x = _stack_crops(x, name)
    if x.shape[0] != 2:
        raise ValueError(
            f"{name} must hold exactly two views of each image, (2, n, d); got shape {x.shape}."
        )
    return x


def _embedding_std(targets: jax.Array, axis_name: str | None) -> jax.Array:
    """SimSiam's collapse monitor (Chen & He 2021, Sec. 4.1, Fig. 2): the per-channel standard
    deviation of the L2-normalised outputs over the global batch, averaged over channels. About
    1 / sqrt(d) for spread-out outputs, 0 when every image maps to one vector."""
    z = l2_normalize(targets.astype(jnp.float32)).reshape(-1, targets.shape[-1])
    count = _psum(jnp.asarray(z.shape[0], jnp.float32), axis_name)
    mean = _psum(jnp.sum(z, axis=0), axis_name) / count
    var = _psum(jnp.sum(jnp.square(z - mean), axis=0), axis_name) / count
    return jnp.mean(jnp.sqrt(var))


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


# DINO (Caron et al. 2021, "Emerging Properties in Self-Supervised Vision Transformers")


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
    # cross[t, v, i] = H(P_t of crop t, P_s of crop v) for image i.
    cross = -jnp.einsum(
        "tik,vik->tvi", teacher_probs, student_log_probs, precision=jax.lax.Precision.HIGHEST
    )
    different = np.arange(num_teacher)[:, None] != np.arange(num_student)[None, :]
    pairs = int(different.sum())  # T * (C - 1)
    per_example = jnp.sum(jnp.where(different[..., None], cross, 0.0), axis=(0, 1)) / pairs

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
    return jnp.mean(per_example), metrics, per_example


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
