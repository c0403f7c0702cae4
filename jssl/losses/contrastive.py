"""Contrastive losses: MoCo's InfoNCE against a queue, MoCo v3's symmetric InfoNCE against the
momentum keys of the global batch, and SimCLR's NT-Xent (two crops and VISSL's multi-crop form),
negatives from the global batch."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jssl.losses._util import (
    _stack_crops,
    _two_views,
    l2_normalize,
)


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


def mocov3_info_nce(
    queries: Sequence[jax.Array] | jax.Array,
    keys: Sequence[jax.Array] | jax.Array,
    temperature: float,
    axis_name: str | None = None,
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
    """MoCo v3's symmetrised contrastive loss (Chen, Xie, He 2021, Alg. 1; facebookresearch/moco-v3
    moco/builder.py ``MoCo.contrastive_loss`` and ``forward``): ``ctr(q1, k2) + ctr(q2, k1)``.

    ``ctr(q, k)`` is the cross-entropy of classifying, for each local query, the momentum key of
    the other view of its own image among the keys of the GLOBAL batch (no queue: the other
    images' keys are the negatives), with cosine logits divided by ``temperature``, times
    ``2 * temperature`` (the reference's scaling, which makes the gradient's size independent of
    T). Keys get no gradient (the momentum encoder's outputs are a stop-gradient) and are
    gathered from every replica; a query's positive sits at its global index
    ``replica * n + i``, the 1-device order.

    Args:
      queries: (2, n, d) predictor outputs of the online encoder for views 1 and 2 of this
        replica's n images (normalised here), or a pair of (n, d) arrays.
      keys: (2, n, d) momentum-encoder projections of the same views, aligned with ``queries``.
      temperature: logits are divided by it (the reference: 0.2 for ViT, 1.0 for ResNet).
      axis_name: the mesh axis the batch is sharded on when called per replica inside
        ``jax.shard_map``; None on a single device.

    Returns:
      The mean over local images of the per-image loss; diagnostics (``contrastive_acc``: the
      positive key has the largest logit, ``pos_similarity``, ``neg_similarity``: mean cosines
      of queries to positive and to negative keys); and the (n,) per-image losses,
      ``2T * (ce(q1_i, k2) + ce(q2_i, k1))``, whose local mean is the reference's ``l1 + l2``.
    """
    q = l2_normalize(_two_views(queries, "queries").astype(jnp.float32))  # (2, n, d)
    k = jax.lax.stop_gradient(l2_normalize(_two_views(keys, "keys").astype(jnp.float32)))
    n = q.shape[1]
    if axis_name is None:
        everyone, first = k, 0
    else:
        everyone = jax.lax.all_gather(k, axis_name, axis=1, tiled=True)  # (2, N, d)
        first = jax.lax.axis_index(axis_name) * n
    # View v's queries against the other view's keys: q1 with k2, q2 with k1.
    cos = jnp.einsum("vnd,vmd->vnm", q, everyone[::-1])  # (2, n, N)
    logits = cos / temperature
    positive = first + jnp.arange(n)  # (n,) global index of each query's own image
    pos_logit = jnp.take_along_axis(logits, positive[None, :, None], axis=2)[..., 0]  # (2, n)
    cross_entropy = jax.nn.logsumexp(logits, axis=2) - pos_logit
    per_example = 2.0 * temperature * jnp.sum(cross_entropy, axis=0)

    is_positive = jnp.arange(everyone.shape[1])[None, :] == positive[:, None]  # (n, N)
    num_neg = everyone.shape[1] - 1
    metrics = {
        "contrastive_acc": jnp.mean(
            (jnp.argmax(logits, axis=2) == positive[None, :]).astype(jnp.float32)
        ),
        "pos_similarity": jnp.mean(pos_logit) * temperature,
        "neg_similarity": jnp.sum(jnp.where(is_positive[None], 0.0, cos))
        / (2 * n * max(num_neg, 1)),
    }
    return jnp.mean(per_example), metrics, per_example


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
