"""The sharded kNN memory bank: bank rows stay on the devices that computed them.

For a bank computed on the fly (the train engine's kNN monitor, the kNN engine without a
features directory), which both run this one search: ``build_bank`` stacks the data-sharded
features of evaluation batches into a ``ShardedBank``, and ``search`` finds each real query's
``k`` most cosine-similar rows. Each device compares the all-gathered query batch with its own
rows and keeps a local top-k; the ``k`` candidates of every device are all-gathered and reduced
to the global top-k (``jax.shard_map`` over ``data``), so no process ever holds the whole bank.
``Neighbours.accuracy`` turns them into the weighted-kNN accuracies of ``jssl.evaluation.knn``
(Wu et al. 2018); one search of the largest k serves every smaller k. What each process holds
(about ``4 d N / P`` bytes of bank on ``P`` processes): docs/evaluation.md, "kNN".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jssl.evaluation import knn
from jssl.evaluation.batches import EvalBatch
from jssl.parallel import DATA_AXIS


def _replicated_value(x: jax.Array) -> np.ndarray:
    """A fully replicated global array on the host, read from a local device (multi-host safe:
    ``np.asarray`` refuses arrays that span other processes' devices)."""
    return np.asarray(x.addressable_data(0))


@dataclasses.dataclass
class ShardedBank:
    """A kNN memory bank held on the devices.

    ``blocks`` are ``(features, labels, valid)`` global arrays of shapes ``(G, B, d)``,
    ``(G, B)``, ``(G, B)``: ``G`` eval batches of ``B`` rows stacked, sharded
    ``P(None, "data")``, so each device holds the rows its batches put there. Rows with
    ``valid`` False (the pipeline's padding, unused slots of the last block) never vote.
    """

    blocks: list[tuple[jax.Array, jax.Array, jax.Array]]
    mesh: Mesh
    num_examples: int
    max_label: int  # -1 when empty

    @property
    def dim(self) -> int:
        return int(self.blocks[0][0].shape[-1]) if self.blocks else 0


@functools.lru_cache(maxsize=8)
def _stack_fn(mesh: Mesh):
    sharding = NamedSharding(mesh, P(None, DATA_AXIS))

    def stack(features, labels, valid):
        feats = [f.reshape(f.shape[0], -1).astype(jnp.float32) for f in features]
        return jnp.stack(feats), jnp.stack(labels), jnp.stack(valid)

    # Stacking along a new leading axis with rows still on `data` moves nothing between devices.
    return jax.jit(stack, out_shardings=(sharding, sharding, sharding))


class BankBuilder:
    """Assembles a ``ShardedBank`` from data-sharded batches, ``block_rows`` rows at a time.

    ``add`` takes the global (data-sharded) outputs of one eval batch; nothing is fetched to
    the host. Every process must call ``add`` with the same number of batches (the eval
    pipeline's contract).
    """

    def __init__(self, mesh: Mesh, block_rows: int = 8192):
        if block_rows < 1:
            raise ValueError(f"block_rows={block_rows} must be >= 1")
        self.mesh, self.block_rows = mesh, block_rows
        self.blocks: list[tuple[jax.Array, jax.Array, jax.Array]] = []
        self._pending: list[tuple[jax.Array, jax.Array, jax.Array]] = []
        self._group = 0
        self._counts: list[jax.Array] = []
        self._max_labels: list[jax.Array] = []

    def add(self, features: jax.Array, labels: jax.Array, mask: jax.Array) -> None:
        """Appends one batch: ``features`` (B, ...), ``labels`` (B,), ``mask`` (B,) bool."""
        if not self._group:  # the block size is fixed by the first batch
            self._group = max(1, self.block_rows // features.shape[0])
        self._pending.append((features, labels.astype(jnp.int32), mask.astype(bool)))
        if len(self._pending) == self._group:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        first = self._pending[0]
        # Unused slots of the last block are invalid copies of its first batch: same shapes,
        # so the top-k step compiles once.
        while len(self._pending) < self._group:
            self._pending.append((first[0], first[1], jnp.zeros_like(first[2])))
        feats, labels, valid = (list(x) for x in zip(*self._pending, strict=True))
        block = _stack_fn(self.mesh)(feats, labels, valid)
        self.blocks.append(block)
        self._counts.append(jnp.sum(block[2]))
        self._max_labels.append(jnp.max(jnp.where(block[2], block[1], -1)))
        self._pending = []

    def finish(self) -> ShardedBank:
        self._flush()
        count = sum(int(_replicated_value(c)) for c in self._counts)
        max_label = max((int(_replicated_value(m)) for m in self._max_labels), default=-1)
        return ShardedBank(self.blocks, self.mesh, count, max_label)


@functools.lru_cache(maxsize=16)
def _sharded_merge_fn(mesh: Mesh, k: int):
    def per_device(top_sims, top_labels, queries, bank, bank_labels, valid):
        # The whole query batch meets this device's bank rows.
        queries = jax.lax.all_gather(queries, DATA_AXIS, tiled=True)
        q = knn.l2_normalize(queries.reshape(queries.shape[0], -1).astype(jnp.float32))
        bank = knn.l2_normalize(bank.reshape(-1, bank.shape[-1]))
        bank_labels, valid = bank_labels.reshape(-1), valid.reshape(-1)
        # HIGHEST, as in jssl.evaluation.knn._merge_bank_chunk (no TF32).
        s = jnp.matmul(q, bank.T, precision=jax.lax.Precision.HIGHEST)
        s = jnp.where(valid[None, :], s, -jnp.inf)
        kc = min(k, s.shape[1])
        local_sims, local_idx = jax.lax.top_k(s, kc)
        local_labels = bank_labels[local_idx]
        if kc < k:  # a device shard smaller than k: pad with candidates that never win
            pad = ((0, 0), (0, k - kc))
            local_sims = jnp.pad(local_sims, pad, constant_values=-jnp.inf)
            local_labels = jnp.pad(local_labels, pad)
        # k candidates per device are enough: the global top-k is among their union.
        cand_sims = jax.lax.all_gather(local_sims, DATA_AXIS, axis=1, tiled=True)
        cand_labels = jax.lax.all_gather(local_labels, DATA_AXIS, axis=1, tiled=True)
        cand_sims = jnp.concatenate([top_sims, cand_sims], axis=1)
        cand_labels = jnp.concatenate([top_labels, cand_labels], axis=1)
        new_sims, pick = jax.lax.top_k(cand_sims, k)
        return new_sims, jnp.take_along_axis(cand_labels, pick, axis=1)

    sharded = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(
            P(),
            P(),
            P(DATA_AXIS),
            P(None, DATA_AXIS),
            P(None, DATA_AXIS),
            P(None, DATA_AXIS),
        ),
        out_specs=(P(), P()),
        # Every device ends with the same top-k (same gathered inputs, same ops).
        check_vma=False,
    )
    return jax.jit(sharded, donate_argnums=(0, 1))


def sharded_top_k(bank: ShardedBank, queries: jax.Array, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most cosine-similar bank rows of each query, reduced across devices.

    Args:
      bank: the sharded memory bank.
      queries: (n, ...) global query features sharded on ``data`` (an eval batch's output;
        n divisible by the device count), flattened to (n, d).
      k: neighbours per query; rows beyond the bank's size come back as (-inf, 0).

    Returns:
      Host arrays (n, k): similarities in descending order, and the neighbours' labels.
    """
    if not bank.blocks:
        raise ValueError("the kNN bank is empty: the bank split yielded no batches")
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    n = queries.shape[0]
    dim = int(np.prod(queries.shape[1:]))
    if dim != bank.dim:
        raise ValueError(f"feature dims differ: bank {bank.dim}, queries {dim}")
    replicated = NamedSharding(bank.mesh, P())
    top_sims = jax.device_put(jnp.full((n, k), -jnp.inf, jnp.float32), replicated)
    top_labels = jax.device_put(jnp.zeros((n, k), jnp.int32), replicated)
    merge = _sharded_merge_fn(bank.mesh, k)
    for features, labels, valid in bank.blocks:
        top_sims, top_labels = merge(top_sims, top_labels, queries, features, labels, valid)
    return _replicated_value(top_sims), _replicated_value(top_labels)


def build_bank(
    batches: Iterable[tuple[jax.Array, EvalBatch]], mesh: Mesh, *, block_rows: int = 8192
) -> ShardedBank:
    """The bank of ``(features, eval batch)`` pairs: each batch's data-sharded features (B, ...)
    with its global ``"label"`` and ``"mask"``; nothing is fetched to the host."""
    builder = BankBuilder(mesh, block_rows)
    for features, batch in batches:
        builder.add(features, batch.batch["label"], batch.batch["mask"])
    return builder.finish()


@dataclasses.dataclass
class Neighbours:
    """The top neighbours of every real query (padding rows dropped), in query order."""

    sims: np.ndarray  # (n, k) float32, descending
    labels: np.ndarray  # (n, k) int32: the neighbours' labels
    query_labels: np.ndarray  # (n,) int32
    bank_size: int
    num_classes: int  # the largest label of bank and queries, plus one

    def accuracy(self, k: int, temperature: float, **vote_kwargs) -> dict[str, float]:
        """Weighted-kNN accuracies (%) of the ``k`` nearest; k beyond the bank is clamped to it,
        with a warning, as ``knn.knn_scores`` does."""
        if k > self.bank_size:
            logging.warning("kNN: k=%d exceeds the bank size %d.", k, self.bank_size)
        k = min(k, self.bank_size)
        if k > self.sims.shape[1]:
            raise ValueError(f"k={k}: the search kept only the top {self.sims.shape[1]}")
        return knn.vote_accuracy(
            self.sims,
            self.labels,
            self.query_labels,
            num_classes=self.num_classes,
            k=k,
            temperature=temperature,
            **vote_kwargs,
        )


class QueryTopK:
    """Collects the top-``k`` neighbours (``k`` clamped to the bank size) of the real rows of
    streamed query batches; for passes that do more with each batch than the search."""

    def __init__(self, bank: ShardedBank, k: int):
        self.bank = bank
        self.k = max(1, min(k, bank.num_examples))
        self._sims: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._query_labels: list[np.ndarray] = []

    def add(self, queries: jax.Array, meta: Mapping[str, np.ndarray]) -> None:
        """One batch: ``queries`` (B, ...) data-sharded, ``meta`` its host ``"label"``/``"mask"``
        (an ``EvalBatch.meta``)."""
        keep = np.asarray(meta["mask"], bool)
        sims, labels = sharded_top_k(self.bank, queries, self.k)
        self._sims.append(sims[keep])
        self._labels.append(labels[keep])
        self._query_labels.append(np.asarray(meta["label"], np.int32)[keep])

    def finish(self) -> Neighbours:
        def rows(chunks: list[np.ndarray], shape: tuple[int, ...], dtype) -> np.ndarray:
            return np.concatenate(chunks) if chunks else np.zeros(shape, dtype)

        query_labels = rows(self._query_labels, (0,), np.int32)
        return Neighbours(
            sims=rows(self._sims, (0, self.k), np.float32),
            labels=rows(self._labels, (0, self.k), np.int32),
            query_labels=query_labels,
            bank_size=self.bank.num_examples,
            num_classes=int(max(self.bank.max_label, query_labels.max(initial=-1))) + 1,
        )


def search(bank: ShardedBank, queries: Iterable[tuple[jax.Array, EvalBatch]], k: int) -> Neighbours:
    """The top-``k`` neighbours of every real query of ``(features, eval batch)`` pairs."""
    top = QueryTopK(bank, k)
    for features, batch in queries:
        top.add(features, batch.meta)
    return top.finish()
