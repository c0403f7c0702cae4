"""Collect the features of named layers over one dataset split.

The JAX counterpart of VISSL's feature extraction (``vissl/trainer/trainer_main.py``,
``extract_features`` and ``_get_train_features``, with
``vissl/utils/extract_features_utils.py`` writing ``<layer>_{features,targets,inds}.npy``):
run the frozen model over the split, keep the requested taps, and return them with their
labels and dataset indices. Every process ends up with the full split, rows sorted by
dataset index, so kNN and linear evaluation can run anywhere and the result does not depend
on the device or process count.

``collect_features`` therefore costs the whole split's features in every host's RAM: use it
for splits that fit (tests, small evaluation sets). The kNN memory bank of the train engine
and of the kNN engine stays on the devices instead (``evaluation.knn_sharded.BankBuilder``), and
extraction to disk streams batch by batch (``iterate_features``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jssl import parallel

# Indices travel through the device (so multi-process gathers keep rows aligned), and JAX
# without x64 holds integers as int32.
_MAX_INDEX = np.iinfo(np.int32).max


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
    batches: Iterable[Mapping[str, np.ndarray]],
    layers: Sequence[str],
    mesh: jax.sharding.Mesh,
    *,
    pool: Mapping[str, Callable[[jax.Array], jax.Array]] | None = None,
    log_every: int = 0,
) -> Features:
    """Runs ``forward`` over ``batches`` and gathers the taps named in ``layers``.

    Args:
      forward: maps a global, data-sharded image batch to a dict of taps (e.g. ``"res5"``
        NHWC, ``"avgpool"`` (N, C)); the caller jits it.
      batches: host-local dicts ``{"image", "label", "index", "mask"}``; rows with mask
        False are padding. Every process must yield the same number of batches and each
        example must appear exactly once over all processes (the data pipeline's contract).
      layers: taps to keep.
      mesh: the device mesh; batches are sharded on its ``data`` axis.
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

    for batch in batches:
        index = np.asarray(batch["index"])
        mask = np.asarray(batch["mask"], bool)
        real = index[mask]  # padding rows carry placeholder indices (the pipeline uses -1)
        if real.size and (real.min() < 0 or real.max() > _MAX_INDEX):
            raise ValueError(f"dataset indices must lie in [0, {_MAX_INDEX}]")
        meta = {
            "label": np.asarray(batch["label"], np.int32),
            "index": np.where(mask, index, 0).astype(np.int32),
            "mask": mask,
        }
        image, meta = parallel.host_batch_to_global((batch["image"], meta), mesh)
        taps = forward(image)
        missing = [layer for layer in layers if layer not in taps]
        if missing:
            raise KeyError(f"unknown layer(s) {missing}; the forward function taps {sorted(taps)}")
        # The same gather for features and metadata, so rows stay aligned across processes.
        device_feats = {layer: post[layer](taps[layer]) for layer in layers}
        feats, meta = parallel.global_to_host((device_feats, meta))
        keep = np.asarray(meta["mask"], bool)
        for layer in layers:
            chunks[layer].append(np.asarray(feats[layer])[keep])
        labels.append(np.asarray(meta["label"])[keep])
        indices.append(np.asarray(meta["index"], np.int64)[keep])
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
    forward: Callable[[jax.Array], Mapping[str, jax.Array]],
    batches: Iterable[Mapping[str, np.ndarray]],
    mesh: jax.sharding.Mesh,
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]]:
    """Streams ``(features, labels, indices)`` of the real rows of each batch, on every process.

    The streaming sibling of ``collect_features`` for splits larger than host memory: each
    global batch is gathered (features and metadata together, so rows stay aligned across
    processes), its padding rows dropped, and handed over before the next batch is read.
    ``forward`` maps a data-sharded image batch to the arrays to keep (already pooled; the
    caller jits it). Rows come in data order per process, not globally sorted by index.
    """
    for batch in batches:
        index = np.asarray(batch["index"])
        if index.size and index.max() > _MAX_INDEX:
            raise ValueError(f"dataset indices must lie in [0, {_MAX_INDEX}]")
        meta = {
            "label": np.asarray(batch["label"], np.int32),
            "index": index.astype(np.int32),
            "mask": np.asarray(batch["mask"], bool),
        }
        image, meta = parallel.host_batch_to_global((batch["image"], meta), mesh)
        feats, meta = parallel.global_to_host((dict(forward(image)), meta))
        keep = np.asarray(meta["mask"], bool)
        yield (
            {name: np.asarray(value)[keep] for name, value in feats.items()},
            np.asarray(meta["label"])[keep],
            np.asarray(meta["index"], np.int64)[keep],
        )
