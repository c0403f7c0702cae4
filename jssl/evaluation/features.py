"""Collect the features of named layers over one dataset split.

The JAX counterpart of VISSL's feature extraction (``vissl/trainer/trainer_main.py``,
``extract_features`` and ``_get_train_features``, with
``vissl/utils/extract_features_utils.py`` writing ``<layer>_{features,targets,inds}.npy``):
run the frozen model over the split's evaluation batches (``evaluation.batches``: every example
once, padding rows masked), keep the requested taps, and return them with their labels and
dataset indices. Every process ends up with the full split, rows sorted by dataset index, so
kNN and linear evaluation can run anywhere and the result does not depend on the device or
process count.

``collect_features`` therefore costs the whole split's features in every host's RAM: use it
for splits that fit (tests, small evaluation sets). The kNN memory bank of the train engine
and of the kNN engine stays on the devices instead (``evaluation.knn_sharded``), and
extraction to disk streams batch by batch (``iterate_features``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jssl import parallel
from jssl.evaluation.batches import EvalBatch


@dataclasses.dataclass
class Features:
    """Features of one split; row i of every array belongs to dataset example indices[i]."""

    features: dict[str, np.ndarray]  # layer -> (n, ...) float32
    labels: np.ndarray  # (n,) int
    indices: np.ndarray  # (n,) int64, sorted ascending

    def __len__(self) -> int:
        return len(self.indices)


def _post_fn(pool: Callable[[jax.Array], jax.Array] | None) -> Callable[[jax.Array], jax.Array]:
    def post(x: jax.Array) -> jax.Array:
        return (pool(x) if pool is not None else x).astype(jnp.float32)

    return jax.jit(post)


def collect_features(
    forward: Callable[[jax.Array], Mapping[str, jax.Array]],
    batches: Iterable[EvalBatch],
    layers: Sequence[str],
    *,
    pool: Mapping[str, Callable[[jax.Array], jax.Array]] | None = None,
    log_every: int = 0,
) -> Features:
    """Runs ``forward`` over ``batches`` and gathers the taps named in ``layers``.

    Args:
      forward: maps a global, data-sharded image batch to a dict of taps (e.g. ``"res5"``
        NHWC, ``"avgpool"`` (N, C)); the caller jits it.
      batches: the split's ``EvalBatch``es (``evaluation.batches.eval_batches``, or
        ``from_host_batches`` of the caller's padded host batches): each example exactly once
        over all processes, padding rows masked.
      layers: taps to keep.
      pool: optional per-layer function applied on device before the fetch (e.g. VISSL's
        average pooling of res5); entries for layers not requested are ignored.
      log_every: log progress every this many batches (0: never).

    Returns:
      Features with every layer as float32, feature maps keeping their (n, h, w, c) shape,
      all rows sorted by dataset index, identical on every process.
    """
    pool = dict(pool or {})
    layers = list(layers)
    # One jitted post-processing per layer: pooling and the cast run fused on device, so
    # only the pooled float32 result crosses to the host.
    post = {layer: _post_fn(pool.get(layer)) for layer in layers}
    chunks: dict[str, list[np.ndarray]] = {layer: [] for layer in layers}
    labels: list[np.ndarray] = []
    indices: list[np.ndarray] = []
    num_batches = num_examples = 0

    for batch, meta in batches:
        taps = forward(batch["image"])
        missing = [layer for layer in layers if layer not in taps]
        if missing:
            raise KeyError(f"unknown layer(s) {missing}; the forward function taps {sorted(taps)}")
        feats = parallel.global_to_host({layer: post[layer](taps[layer]) for layer in layers})
        keep = meta["mask"]
        for layer in layers:
            chunks[layer].append(np.asarray(feats[layer])[keep])
        labels.append(meta["label"][keep])
        indices.append(meta["index"][keep].astype(np.int64))
        num_batches += 1
        num_examples += int(keep.sum())
        if log_every and num_batches % log_every == 0:
            logging.info("features: %d batches, %d examples", num_batches, num_examples)

    if num_batches == 0:
        logging.warning("features: the split yielded no batches")
        empty = np.zeros((0,), np.float32)
        return Features(
            {layer: empty for layer in layers}, np.zeros((0,), np.int32), np.zeros((0,), np.int64)
        )

    all_indices = np.concatenate(indices)
    order = np.argsort(all_indices, kind="stable")
    all_indices = all_indices[order]
    repeated = all_indices[1:][all_indices[1:] == all_indices[:-1]]
    if repeated.size:
        raise ValueError(
            f"{repeated.size} dataset indices appear more than once (e.g. "
            f"{np.unique(repeated)[:10].tolist()}); the data pipeline must yield each example "
            "exactly once over all processes, with padding rows masked out"
        )
    logging.info("features: %d examples from %d batches", len(all_indices), num_batches)
    return Features(
        features={layer: np.concatenate(chunks[layer])[order] for layer in layers},
        labels=np.concatenate(labels)[order],
        indices=all_indices,
    )


def iterate_features(
    forward: Callable[[jax.Array], Mapping[str, jax.Array]], batches: Iterable[EvalBatch]
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]]:
    """Streams ``(features, labels, indices)`` of the real rows of each batch, on every process.

    The streaming sibling of ``collect_features`` for splits larger than host memory: each
    global ``EvalBatch``'s outputs are gathered, its padding rows dropped, and handed over
    before the next batch is read. ``forward`` maps a data-sharded image batch to the arrays
    to keep (already pooled; the caller jits it). Rows come in data order, not sorted by index.
    """
    for batch, meta in batches:
        feats = parallel.global_to_host(dict(forward(batch["image"])))
        keep = meta["mask"]
        yield (
            {name: np.asarray(value)[keep] for name, value in feats.items()},
            meta["label"][keep],
            meta["index"][keep].astype(np.int64),
        )
