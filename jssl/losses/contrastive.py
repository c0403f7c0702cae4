"""Contrastive losses: MoCo's InfoNCE against a queue and SimCLR's NT-Xent (two crops and
VISSL's multi-crop form), negatives from the global batch."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jssl.losses._util import (
    _stack_crops,
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
