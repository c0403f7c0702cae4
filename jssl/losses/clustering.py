"""DeepCluster-v2's pieces (Caron et al. 2020, "Unsupervised Learning of Visual Features by
Contrasting Cluster Assignments", Sec. 4 and App. A): spherical k-means over a memory bank of
embeddings (:func:`kmeans`), and the cross-entropy of the embeddings' cluster scores against
the assignments (:func:`cluster_prediction_loss`).

Follows VISSL vissl/losses/deepclusterv2_loss.py (``cluster_memory``, ``forward``) and the SwAV
repository's main_deepclusterv2.py (``cluster_memory``, ``train``). The rows are scored in
blocks (a whole ImageNet bank's score matrix would not fit) and a cluster's sum is a one-hot
matrix product, deterministic where a GPU scatter-add is not. With ``shards`` a bank split over
the devices is clustered where it lies, XLA adding the parts' sums with one all-reduce per
iteration, as VISSL's processes do. The method: docs/methods.md#deepcluster-v2.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jssl.losses._util import l2_normalize

# Rows per block of the assignment step: a (block, K) float32 score matrix (49 MB at K=3000).
BLOCK_SIZE = 4096
_HIGHEST = jax.lax.Precision.HIGHEST  # the references' float32 products (no TF32 / bf16 passes)


def initial_centroids(
    key: jax.Array, embeddings: jax.Array, num_clusters: int, valid: jax.Array | None = None
) -> jax.Array:
    """``num_clusters`` distinct rows of ``embeddings`` (N, d), drawn uniformly with ``key``
    among the ``valid`` ones (VISSL: ``randperm(len(memory))[:K]``). The caller ensures there
    are at least ``num_clusters`` valid rows (else invalid rows fill the rest)."""
    num_rows = embeddings.shape[0]
    if num_clusters > num_rows:
        raise ValueError(
            f"k-means with {num_clusters} clusters needs at least as many rows; the bank has "
            f"{num_rows}."
        )
    order = jax.random.uniform(key, (num_rows,))
    if valid is not None:
        order = jnp.where(valid, order, -1.0)
    _, rows = jax.lax.top_k(order, num_clusters)
    return embeddings[rows]


def _blocks(x: jax.Array, block_size: int, fill) -> jax.Array:
    """(N, ...) as (blocks, block, ...), the last block padded with ``fill``."""
    block = min(block_size, x.shape[0])
    pad = -x.shape[0] % block
    if pad:
        x = jnp.concatenate([x, jnp.full((pad, *x.shape[1:]), fill, x.dtype)])
    return x.reshape(-1, block, *x.shape[1:])


def _assign_and_sum(
    embeddings: jax.Array,
    valid: jax.Array,
    centroids: jax.Array,
    block_size: int,
    shards: int = 1,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One assignment step: (the assignments (N,), the valid rows' sums per cluster (K, d) and
    their counts (K,)); ``shards`` contiguous parts of the rows summed apart, then added."""
    if shards > 1:
        parts = jax.vmap(lambda x, ok: _assign_and_sum(x, ok, centroids, block_size))(
            embeddings.reshape(shards, -1, embeddings.shape[-1]), valid.reshape(shards, -1)
        )
        assigned, sums, counts = parts
        return assigned.reshape(-1), jnp.sum(sums, axis=0), jnp.sum(counts, axis=0)
    num_rows, num_clusters = embeddings.shape[0], centroids.shape[0]
    clusters = jnp.arange(num_clusters)

    def block(carry, rows):
        sums, counts = carry
        x, ok = rows
        scores = jnp.dot(x, centroids.T, precision=_HIGHEST)
        assigned = jnp.argmax(scores, axis=1).astype(jnp.int32)
        one_hot = ((assigned[:, None] == clusters) & ok[:, None]).astype(x.dtype)
        sums = sums + jnp.dot(one_hot.T, x, precision=_HIGHEST)
        return (sums, counts + jnp.sum(one_hot, axis=0)), assigned

    start = (jnp.zeros_like(centroids), jnp.zeros((num_clusters,), embeddings.dtype))
    xs = (_blocks(embeddings, block_size, 0.0), _blocks(valid, block_size, False))
    (sums, counts), assigned = jax.lax.scan(block, start, xs)
    return assigned.reshape(-1)[:num_rows], sums, counts


def kmeans(
    embeddings: jax.Array,
    centroids: jax.Array,
    num_iters: int,
    valid: jax.Array | None = None,
    block_size: int = BLOCK_SIZE,
    shards: int = 1,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Spherical k-means from ``centroids`` (VISSL ``cluster_memory``): each iteration assigns
    every row to the centroid of largest dot product (unit vectors: cosine), replaces each
    non-empty cluster's centroid by its rows' mean (an empty one keeps its centroid) and
    L2-normalises; a last assignment step after ``num_iters`` gives the assignments.

    Args:
      embeddings: (N, d) unit rows.
      centroids: (K, d) unit initial centroids (:func:`initial_centroids`).
      num_iters: update iterations (VISSL ``kmeans_iters``: 10); 0 keeps the initial ones.
      valid: optional (N,) booleans; rows that are False take no part and get assignment -1.
      block_size: rows per block of the assignment step.
      shards: the rows as this many contiguous parts (N divisible by it), each summed apart:
        the parts a bank split over the devices holds, so that XLA clusters it in place.

    Returns:
      (centroids (K, d) unit rows; assignments (N,) int32, -1 where not valid; cluster sizes
      (K,) int32 of the final assignments).
    """
    embeddings = jax.lax.stop_gradient(embeddings).astype(jnp.float32)
    centroids = jax.lax.stop_gradient(centroids).astype(jnp.float32)
    if valid is None:
        valid = jnp.ones(embeddings.shape[:1], bool)
    if embeddings.shape[0] % shards:
        raise ValueError(f"{embeddings.shape[0]} rows do not split into {shards} shards.")

    def iteration(_, centroids):
        _, sums, counts = _assign_and_sum(embeddings, valid, centroids, block_size, shards)
        means = sums / jnp.maximum(counts, 1.0)[:, None]
        # An empty cluster keeps its centroid (VISSL: ``centroids[mask] = ...``).
        return l2_normalize(jnp.where(counts[:, None] > 0, means, centroids))

    centroids = jax.lax.fori_loop(0, num_iters, iteration, centroids)
    assigned, _, counts = _assign_and_sum(embeddings, valid, centroids, block_size, shards)
    return centroids, jnp.where(valid, assigned, -1), counts.astype(jnp.int32)


def cluster_prediction_loss(
    embeddings: jax.Array,
    centroids: Sequence[jax.Array],
    targets: jax.Array,
    temperature: float = 0.1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DeepCluster-v2's loss per example (VISSL ``DeepClusterV2Loss.forward``; SwAV repository
    main_deepclusterv2.py ``train``): for each head h, the cross-entropy of every crop's scores
    ``z @ centroids[h].T / temperature`` against the example's assignment ``targets[h]``,
    averaged over the crops, then over the heads.

    Args:
      embeddings: (C, n, d) L2-normalised embeddings of every crop.
      centroids: one (K_h, d) array per head (no gradient reaches them).
      targets: (H, n) int cluster of each example per head; -1: none (the term is 0 there,
        VISSL's ``ignore_index=-100``).
      temperature: the scores' temperature (0.1).

    Returns:
      ((n,) float32 loss per example, {"prediction_accuracy": % of the crops' argmax equal to
      their target, "targets_valid": fraction of (head, example) pairs with a target}).
    """
    if len(centroids) != targets.shape[0]:
        raise ValueError(
            f"{len(centroids)} heads of centroids but targets for {targets.shape[0]} heads."
        )
    z = embeddings.astype(jnp.float32)
    per_example, hits = 0.0, 0.0
    for head, head_centroids in enumerate(centroids):
        c = jax.lax.stop_gradient(head_centroids).astype(jnp.float32)
        logits = jnp.einsum("cnd,kd->cnk", z, c) / temperature
        target = targets[head]
        has_target = target >= 0
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(log_probs, jnp.maximum(target, 0)[None, :, None], axis=-1)
        per_example = per_example + jnp.where(has_target, -jnp.mean(picked[..., 0], axis=0), 0.0)
        correct = (jnp.argmax(logits, axis=-1) == target[None]) & has_target[None]
        hits = hits + jnp.mean(correct.astype(jnp.float32))
    num_heads = len(centroids)
    metrics = {
        "prediction_accuracy": 100.0 * hits / num_heads,
        "targets_valid": jnp.mean((targets >= 0).astype(jnp.float32)),
    }
    return per_example / num_heads, metrics
