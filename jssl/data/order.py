"""The training order of jssl.data: which example goes in which row, and what replaces one
that cannot be read.

jssl.data.pipeline reads and decodes the examples; this module decides which ones, from (seed,
epoch, process index and count) alone, so a resumed run replays exactly the remaining batches.
Each epoch is a seeded permutation of the train split (after data.train_subset) cut into global
batches (``epoch_order``); process p of P reads its rows [p*B/P, (p+1)*B/P) of each
(``process_order``), so global batch t holds the same examples on any number of processes or
devices. That is exact where examples are read by index (image folders, TFDS in ArrayRecord
files, TFDS with data.cache=True); TFDS in TFRecord files without the cache is read in seeded
blocks instead, with weaker promises (``stream_block_ranges``). With data.skip_corrupt=True an
unreadable example is replaced by the next readable one of this process's stream and flagged
"replaced", so the number of batches never changes (``replace_unreadable``); the tf.data helpers
keep stream positions in their rows for that. More: docs/operations.md, "Data".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the tf.data helpers import it when they run: the order itself needs none
    import tensorflow as tf

_BLOCKS_PER_PROCESS = 16  # TFRecord TFDS without cache: contiguous blocks per process per epoch


def shard_bounds(num: int, process_count: int, process_index: int) -> tuple[int, int]:
    """[start, end) of this process's contiguous shard; sizes differ by at most one.

    Same arithmetic as clu.deterministic_data's BALANCE_ON_PROCESSES remainder option, written out
    because that helper is deprecated, logs a warning per call and needs TFDS split infos, which
    image folders do not have.
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, {process_count}).")
    per, rest = divmod(num, process_count)
    start = process_index * per + min(process_index, rest)
    return start, start + per + (1 if process_index < rest else 0)


def local_batch(batch_size: int, process_count: int) -> int:
    """This process's rows of a global batch of `batch_size`, which must split evenly."""
    if batch_size % process_count:
        raise ValueError(
            f"data.batch_size={batch_size} (global) is not divisible by the {process_count} "
            "processes: pick a multiple of the process count."
        )
    return batch_size // process_count


def epoch_seed(seed: int, epoch: int, stream: int = 0) -> int:
    """A well-spread integer seed for one use (`stream`) of one epoch of the run seeded `seed`."""
    # SeedSequence mixes the integers into a well-spread seed; `stream` keeps uses independent.
    return int(np.random.SeedSequence([seed, epoch, stream]).generate_state(1)[0])


def epoch_order(num: int, batch_size: int, *, seed: int, epoch: int) -> np.ndarray:
    """Dataset indices of the global batches of one epoch, shape [num // batch_size, batch_size].

    A seeded permutation of the whole split per (seed, epoch), cut into global batches; the
    remainder is left out of this epoch. Row t is global batch t whatever the process count.
    """
    steps = num // batch_size
    permutation = np.random.default_rng(epoch_seed(seed, epoch)).permutation(num)
    return permutation[: steps * batch_size].reshape(steps, batch_size)


def process_order(order: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    """This process's stream of indices: its rows [p*B/P, (p+1)*B/P) of every global batch.

    jssl.parallel.host_batch_to_global concatenates the processes' rows in process order, so
    the global batch assembled on the devices is exactly the row of `order`.
    """
    steps, batch_size = order.shape
    local = local_batch(batch_size, process_count)
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, {process_count}).")
    return order.reshape(steps, process_count, local)[:, process_index].reshape(-1)


def stream_block_ranges(
    num: int, stream_size: int, *, seed: int, epoch: int, process_index: int, process_count: int
) -> list[tuple[int, int]]:
    """[start, end) ranges of the split in this process's stream (TFRecord TFDS, uncached).

    The split is cut into _BLOCKS_PER_PROCESS * process_count contiguous blocks, the blocks are
    put in a seeded order per (seed, epoch) and concatenated, and process p reads positions
    [p * stream_size, (p + 1) * stream_size) of that concatenation: a fresh draw of blocks from
    all over the split every epoch, each example at most once per epoch.

    TFRecord files are read sequentially, and the exact global order would make every host read
    the whole split every epoch. This keeps exact resume and equal step counts, but global batch
    t depends on the process count, and examples mix within a process's blocks and the shuffle
    buffer, not in a full permutation: prepare the dataset as ArrayRecord, set data.cache=True or
    use an image folder where that matters (the trainer logs which order a run gets). Each
    range is read as a TFDS split slice, so whole record files before it are skipped.
    """
    num_blocks = max(1, min(num, _BLOCKS_PER_PROCESS * process_count))
    blocks = [shard_bounds(num, num_blocks, b) for b in range(num_blocks)]
    order = np.random.default_rng(epoch_seed(seed, epoch, 1)).permutation(num_blocks)
    lo, hi = process_index * stream_size, (process_index + 1) * stream_size
    ranges, position = [], 0
    for block in order:
        start, end = blocks[block]
        first, last = max(lo, position), min(hi, position + end - start)
        if first < last:
            ranges.append((start + first - position, start + last - position))
        position += end - start
    return ranges


def with_gaps(
    records: tf.data.Dataset,
    first_position: int,
    skip_corrupt: bool,
    describe: Callable[[tf.Tensor], tf.Tensor],
) -> tf.data.Dataset:
    """Adds "gap" to each record: how many stream positions before it never arrived.

    `records` were decoded with errors dropped and carry their stream "position". A hole fails
    naming what is missing (describe(position) -> tf.string) when skip_corrupt=False, and is
    logged with the running count when True. The happy path pays only a cheap scan.
    """
    import tensorflow as tf

    def check(state, record):
        expected, skipped = state
        gap = record["position"] - expected
        if skip_corrupt:
            skipped = skipped + gap
            report = tf.cond(
                gap > 0,
                lambda: tf.print(
                    "WARNING jssl.data: skipped unreadable image",
                    describe(expected),
                    "(and",
                    gap - 1,
                    "more here);",
                    skipped,
                    "skipped so far in this pipeline (data.skip_corrupt=True).",
                ),
                tf.no_op,
            )
        else:
            report = tf.debugging.Assert(
                tf.equal(gap, 0),
                [
                    "Unreadable or corrupt image file:",
                    describe(expected),
                    "Fix or remove it, or set data.skip_corrupt=True to skip such files.",
                ],
                summarize=1,
            )
        with tf.control_dependencies([report]):
            record = {k: tf.identity(v) for k, v in record.items()}
        return (record["position"] + 1, skipped), {**record, "gap": gap}

    initial = (tf.constant(first_position, tf.int64), tf.constant(0, tf.int64))
    return records.scan(initial, check)


def train_row(record: dict, replaced: bool | tf.Tensor) -> dict[str, tf.Tensor]:
    """The training row of a decoded record, before its views are made."""
    import tensorflow as tf

    return {
        "image": record["image"],
        "label": tf.cast(record["label"], tf.int32),
        "index": tf.cast(record["index"], tf.int64),
        "replaced": replaced,
    }


def replace_unreadable(
    checked: tf.data.Dataset, restart: tf.data.Dataset, count: int
) -> tf.data.Dataset:
    """Exactly `count` rows, one per stream position, from records carrying "gap" (with_gaps).

    Each unreadable position becomes a copy of the next readable record of the stream (the one
    that arrives after the hole), flagged replaced=True; holes at the very end wrap around to the
    first readable record of the whole stream (`restart`: the stream from position 0, decoded,
    errors dropped), which is only read then. So the rows depend on the stream alone, not on
    where a resumed run starts; being per process, the replacement is the one part of the
    order that depends on the process count.
    """
    import tensorflow as tf

    def expand(record):
        gap = record["gap"]
        return tf.data.Dataset.range(gap + 1).map(lambda j: train_row(record, j < gap))

    def wrapped(record):
        tf.print(
            "WARNING jssl.data: unreadable images at the end of this epoch's stream are replaced "
            "by its first readable one (data.skip_corrupt=True)."
        )
        return train_row(record, tf.constant(True))

    # cache(): the first readable record is read once, however many rows it fills.
    tail = restart.take(1).map(wrapped).cache().repeat()

    def nothing_readable(_):
        check = tf.debugging.Assert(
            False, ["No readable image in this epoch's stream of the train split: check the data."]
        )
        with tf.control_dependencies([check]):
            image = tf.zeros([1, 1, 3], checked.element_spec["image"].dtype)
        return train_row({"image": image, "label": 0, "index": -1}, tf.constant(True))

    failure = tf.data.Dataset.from_tensors(0).map(nothing_readable)
    rows = checked.flat_map(expand).concatenate(tail).concatenate(failure)
    return rows.take(count)


def replace_unreadable_indices(
    stream: np.ndarray, readable: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """`stream` (dataset indices) with each unreadable one replaced, and the "replaced" flags.

    The index-level twin of replace_unreadable, for when readability is known up front (the
    decoded in-memory split, data.cache=True): each unreadable position takes the next readable
    index of the stream, wrapping to its first one. `readable` is per stream position.
    """
    replaced = ~readable
    if replaced.any():
        good = np.flatnonzero(readable)
        if not len(good):
            raise ValueError("No readable example in this epoch's stream of the train split.")
        # The next readable position of the stream, wrapping to its first one.
        following = np.searchsorted(good, np.arange(len(stream)))
        stream = stream[good[np.where(following == len(good), 0, following)]]
    return stream, replaced
