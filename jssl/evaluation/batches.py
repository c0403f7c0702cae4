"""The evaluation passes' batches: every example of a split once, as global sharded arrays.

Every pass over a whole split (the kNN bank and queries, the test phase, feature extraction
and collection) reads it through ``eval_batches``: the evaluation pipeline
(``data.build_eval_dataset``: centre crop, each example exactly once over all processes, the
last batch padded with ``mask`` False rows) turned into global batches sharded on the mesh's
``data`` axis. Each batch comes with a small host copy of its metadata (label, index, mask of
every row of the global batch, in its row order) on every process, so callers can drop
padding rows of what they fetch without another gather of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jssl import data, parallel

# Indices travel through the device (so multi-process gathers keep rows aligned), and JAX
# without x64 holds integers as int32.
MAX_INDEX = np.iinfo(np.int32).max


class EvalBatch(NamedTuple):
    """One global evaluation batch.

    ``batch``: the host batch's arrays as global arrays sharded on ``data`` (``"image"``, or
    whatever else the host batch holds), with ``"label"`` int32, ``"index"`` int32 (0 on
    padding rows) and ``"mask"`` bool. ``meta``: numpy copies of the global ``"label"``,
    ``"index"`` and ``"mask"``, identical on every process.
    """

    batch: dict[str, Any]
    meta: dict[str, np.ndarray]


def from_host_batches(
    host_batches: Iterable[Mapping[str, Any]], mesh: jax.sharding.Mesh
) -> Iterator[EvalBatch]:
    """Turns this process's padded host batches into ``EvalBatch``es.

    Each host batch holds ``"mask"`` (False on padding rows), ``"label"``, optionally
    ``"index"`` (dataset indices; padding rows may carry any placeholder, e.g. -1), and any
    other arrays or pytrees (``"image"``, cached ``"inputs"``), which are sharded as they are.
    Every process must yield the same number of batches of the same shapes.
    """
    for host_batch in host_batches:
        mask = np.asarray(host_batch["mask"], bool)
        meta = {"label": np.asarray(host_batch["label"], np.int32), "mask": mask}
        if "index" in host_batch:
            index = np.asarray(host_batch["index"])
            real = index[mask]
            if real.size and (real.min() < 0 or real.max() > MAX_INDEX):
                raise ValueError(
                    f"dataset indices must lie in [0, {MAX_INDEX}] (got {int(real.min())}.."
                    f"{int(real.max())} on rows with mask True); number the split's examples "
                    "0..n-1 and mark padding rows with mask False"
                )
            meta["index"] = np.where(mask, index, 0).astype(np.int32)
        batch = parallel.host_batch_to_global(dict(host_batch, **meta), mesh)
        if jax.process_count() == 1:  # the global batch is this host's batch, row for row
            meta_host = meta
        else:
            meta_host = parallel.global_to_host({name: batch[name] for name in meta})
        yield EvalBatch(batch, {name: np.asarray(v) for name, v in meta_host.items()})


def eval_batches(
    data_config: Any, split: str, batch_size: int, mesh: jax.sharding.Mesh
) -> Iterator[EvalBatch]:
    """``EvalBatch``es of ``split`` read by the evaluation pipeline, global batches of
    ``batch_size`` rows (each process reads its own shard)."""
    host_batches = data.build_eval_dataset(
        data_config,
        split,
        batch_size=batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    return from_host_batches(host_batches.as_numpy_iterator(), mesh)
