"""Weighted k-nearest-neighbour classification of frozen features.

The non-parametric evaluation of Wu et al. 2018, "Unsupervised Feature Learning via
Non-Parametric Instance Discrimination" (Sec. 3.4), as VISSL runs it
(``vissl/utils/knn_utils.py``) and DINO (``eval_knn.py``): the train split's features are the
memory bank, both sides L2-normalised, and each test image's ``k`` most cosine-similar bank
entries vote for their classes with weight ``exp(similarity / temperature)``. VISSL's setting
is ``k=200, temperature=0.1`` (the defaults here), DINO's ``temperature=0.07`` (20-NN in its
paper). ``knn_scores`` / ``knn_accuracy`` take host (possibly memory-mapped) features and
stream the bank in chunks with a running top-k, so an ImageNet-sized bank never makes an
``(n_test, n_train)`` matrix; ``jssl.evaluation.knn_sharded`` searches a bank kept on the
devices, and ``vote_accuracy`` here turns its neighbours into accuracies. More:
docs/evaluation.md, "kNN".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

# F.normalize's default epsilon, which VISSL and DINO use: a zero vector stays zero.
_NORM_EPS = 1e-12


def l2_normalize(x: jax.Array) -> jax.Array:
    """``x / max(||x||, eps)`` along the last axis, as F.normalize does."""
    norm = jnp.linalg.norm(x, axis=-1, keepdims=True)
    return x / jnp.maximum(norm, _NORM_EPS)


@functools.partial(jax.jit, static_argnames=("k",), donate_argnums=(0, 1))
def _merge_bank_chunk(
    top_sims: jax.Array,  # (num_query_chunks, query_chunk, k) running best similarities
    top_labels: jax.Array,  # (num_query_chunks, query_chunk, k) their bank labels
    queries: jax.Array,  # (num_query_chunks, query_chunk, d), already normalised
    bank: jax.Array,  # (bank_chunk, d), raw features; the tail may be padding
    bank_labels: jax.Array,  # (bank_chunk,)
    num_valid: jax.Array,  # scalar: how many rows of ``bank`` are real
    *,
    k: int,
) -> tuple[jax.Array, jax.Array]:
    """Folds one bank chunk into every query's running top-k."""
    bank = l2_normalize(bank.astype(jnp.float32))
    # Padded bank rows must never be picked: -inf loses to any real similarity.
    valid = jnp.arange(bank.shape[0]) < num_valid

    def one_query_chunk(carry: None, xs: tuple[jax.Array, ...]) -> tuple[None, tuple]:
        sims, labels, q = xs
        # HIGHEST: the default f32 matmul on GPUs may run in TF32, whose ~1e-3 error
        # reorders near-tied neighbours; PyTorch's torch.mm in VISSL/DINO does not.
        s = jnp.matmul(q, bank.T, precision=jax.lax.Precision.HIGHEST)
        s = jnp.where(valid[None, :], s, -jnp.inf)
        # Top-k of the chunk first, then of (running, chunk): the second top_k is over 2k
        # columns instead of k + bank_chunk, and the chunk's top-k is needed anyway.
        kc = min(k, s.shape[1])
        chunk_sims, chunk_idx = jax.lax.top_k(s, kc)
        cand_sims = jnp.concatenate([sims, chunk_sims], axis=1)
        cand_labels = jnp.concatenate([labels, bank_labels[chunk_idx]], axis=1)
        new_sims, pick = jax.lax.top_k(cand_sims, k)
        new_labels = jnp.take_along_axis(cand_labels, pick, axis=1)
        return carry, (new_sims, new_labels)

    # lax.map-style scan over query chunks: one dispatch per bank chunk, one
    # (query_chunk x bank_chunk) similarity block alive at a time.
    _, (top_sims, top_labels) = jax.lax.scan(one_query_chunk, None, (top_sims, top_labels, queries))
    return top_sims, top_labels


@functools.partial(jax.jit, static_argnames=("num_classes",))
def _vote(
    top_sims: jax.Array, top_labels: jax.Array, temperature: jax.Array, *, num_classes: int
) -> jax.Array:
    """Each neighbour adds exp(sim / T) to its class (Wu et al. eq. 8)."""

    def one_query_chunk(carry: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        sims, labels = xs
        weights = jnp.exp(sims / temperature)  # exp(-inf) = 0 for never-filled slots
        rows = jnp.arange(sims.shape[0])[:, None]
        # A scatter-add instead of VISSL's (n, k, num_classes) one-hot: with 1000 classes and
        # k=200 that one-hot is 800 MB per 1024 queries.
        scores = jnp.zeros((sims.shape[0], num_classes), jnp.float32)
        return carry, scores.at[rows, labels].add(weights)

    _, scores = jax.lax.scan(one_query_chunk, None, (top_sims, top_labels))
    return scores.reshape(-1, num_classes)


def knn_scores(
    train_features: np.ndarray,
    train_labels: np.ndarray,
    test_features: np.ndarray,
    *,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.1,
    query_chunk: int = 1024,
    bank_chunk: int = 65536,
) -> np.ndarray:
    """Weighted-kNN class scores of every test feature against the training bank.

    Args:
      train_features: (n_train, d) bank features (any float dtype; compared in float32).
      train_labels: (n_train,) integer classes in [0, num_classes).
      test_features: (n_test, d) query features.
      num_classes: width of the returned score matrix.
      k: neighbours per query; clamped (with a warning) to the bank size.
      temperature: vote weight is exp(cosine_similarity / temperature).
      query_chunk: queries per similarity block.
      bank_chunk: bank rows transferred and compared at a time.

    Returns:
      (n_test, num_classes) float32 summed votes; argmax is the prediction.
    """
    train_labels = np.asarray(train_labels)
    n_train, n_test = len(train_features), len(test_features)
    if train_features.ndim != 2 or test_features.ndim != 2:
        raise ValueError(
            f"features must be 2-D (n, d); got bank {train_features.shape}, "
            f"queries {test_features.shape}"
        )
    if train_features.shape[1] != test_features.shape[1]:
        raise ValueError(
            f"feature dims differ: bank {train_features.shape[1]}, queries {test_features.shape[1]}"
        )
    if train_labels.shape != (n_train,):
        raise ValueError(f"train_labels {train_labels.shape} must be ({n_train},)")
    if n_train == 0:
        raise ValueError("the kNN bank (train_features) is empty")
    if train_labels.min() < 0 or train_labels.max() >= num_classes:
        raise ValueError(
            f"train_labels span [{train_labels.min()}, {train_labels.max()}], "
            f"outside [0, {num_classes})"
        )
    if k < 1 or query_chunk < 1 or bank_chunk < 1:
        raise ValueError(f"k={k}, query_chunk={query_chunk}, bank_chunk={bank_chunk} must be >= 1")
    if k > n_train:
        logging.warning("kNN: k=%d exceeds the bank size %d; using k=%d.", k, n_train, n_train)
        k = n_train
    if n_test == 0:
        return np.zeros((0, num_classes), np.float32)

    # Chunks never larger than the data: small evaluations should not pay for padding.
    query_chunk = min(query_chunk, n_test)
    bank_chunk = min(bank_chunk, n_train)
    num_query_chunks = -(-n_test // query_chunk)
    d = test_features.shape[1]

    # Queries are small next to the bank (50k x 2048 f32 = 400 MB): put them on device once.
    queries = np.zeros((num_query_chunks * query_chunk, d), np.float32)
    queries[:n_test] = test_features
    queries = l2_normalize(jnp.asarray(queries)).reshape(num_query_chunks, query_chunk, d)
    top_sims = jnp.full((num_query_chunks, query_chunk, k), -jnp.inf, jnp.float32)
    top_labels = jnp.zeros((num_query_chunks, query_chunk, k), jnp.int32)

    for start in range(0, n_train, bank_chunk):
        stop = min(start + bank_chunk, n_train)
        bank = np.asarray(train_features[start:stop], np.float32)
        labels = train_labels[start:stop].astype(np.int32)
        if stop - start < bank_chunk:  # pad the last chunk so the step compiles once
            bank = np.pad(bank, ((0, bank_chunk - len(bank)), (0, 0)))
            labels = np.pad(labels, (0, bank_chunk - len(labels)))
        top_sims, top_labels = _merge_bank_chunk(
            top_sims, top_labels, queries, bank, labels, np.int32(stop - start), k=k
        )

    scores = _vote(top_sims, top_labels, jnp.float32(temperature), num_classes=num_classes)
    return np.asarray(scores)[:n_test]


def topk_accuracy(
    scores: np.ndarray, labels: np.ndarray, topk: Sequence[int] = (1, 5)
) -> dict[str, float]:
    """Percent of rows whose label is among the ``t`` highest scores, for each t in topk."""
    labels = np.asarray(labels)
    if len(labels) == 0:
        return {f"top{t}": float("nan") for t in topk}
    # Stable sort of -scores: ties go to the lower class id, deterministically.
    ranked = np.argsort(-scores, axis=1, kind="stable")
    out = {}
    for t in topk:
        hit = (ranked[:, : min(t, scores.shape[1])] == labels[:, None]).any(axis=1)
        out[f"top{t}"] = 100.0 * float(hit.mean())
    return out


def knn_accuracy(
    train_features: np.ndarray,
    train_labels: np.ndarray,
    test_features: np.ndarray,
    test_labels: np.ndarray,
    *,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.1,
    topk: Sequence[int] = (1, 5),
    **chunk_kwargs: int,
) -> dict[str, float]:
    """Weighted-kNN top-k accuracies in percent, e.g. ``{"top1": 71.2, "top5": 88.0}``.

    ``chunk_kwargs`` (query_chunk, bank_chunk) pass through to ``knn_scores``.
    """
    scores = knn_scores(
        train_features,
        train_labels,
        test_features,
        num_classes=num_classes,
        k=k,
        temperature=temperature,
        **chunk_kwargs,
    )
    return topk_accuracy(scores, test_labels, topk)


def vote_accuracy(
    top_sims: np.ndarray,
    top_labels: np.ndarray,
    labels: np.ndarray,
    *,
    num_classes: int,
    k: int,
    temperature: float,
    topk: Sequence[int] = (1, 5),
    chunk: int = 4096,
) -> dict[str, float]:
    """Weighted-kNN accuracies (%) from the queries' sorted top neighbours.

    ``top_sims``/``top_labels`` (n, >= k) come from ``evaluation.knn_sharded.search``, best
    first, so the first ``k`` columns are the top-k for any smaller k: one search serves
    several k.
    """
    labels = np.asarray(labels)
    n = len(labels)
    if top_sims.shape != top_labels.shape or top_sims.shape[0] != n or top_sims.shape[1] < k:
        raise ValueError(
            f"top-k arrays {top_sims.shape}, {top_labels.shape} do not fit {n} queries at k={k}"
        )
    if n == 0:
        return topk_accuracy(np.zeros((0, num_classes)), labels, topk)
    hits = {t: 0.0 for t in topk}
    for start in range(0, n, chunk):
        sims = np.asarray(top_sims[start : start + chunk, :k], np.float32)
        neighbours = np.asarray(top_labels[start : start + chunk, :k], np.int32)
        rows = len(sims)
        pad = ((0, chunk - rows), (0, 0)) if n > chunk else ((0, 0), (0, 0))
        sims = np.pad(sims, pad, constant_values=-np.inf)  # fixed shapes: _vote compiles once
        neighbours = np.pad(neighbours, pad)
        scores = _vote(
            sims[None], neighbours[None], jnp.float32(temperature), num_classes=num_classes
        )
        acc = topk_accuracy(np.asarray(scores)[:rows], labels[start : start + rows], topk)
        for t in topk:
            hits[t] += acc[f"top{t}"] * rows
    return {f"top{t}": hits[t] / n for t in topk}
