"""Host-local tf.data pipelines for SSL training and for evaluation / feature extraction.

Determinism is the design constraint: training batches are a function of (seed, epoch, process
shard, start_step) and the views of an example of (seed, epoch, index) alone. So resuming mid-epoch
replays exactly the remaining batches, and changing the number of processes changes which process
sees an example but not what its views look like. Randomness therefore never comes from stateful
TF ops: the shuffle has a fixed seed per epoch, augmentations use stateless ops seeded per example
(the per-example-rng idea of clu.deterministic_data, keyed on the dataset index instead of the
position in the stream), and tf.data runs with deterministic=True.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf
from absl import logging

from jssl.data import sources, transforms

AUTOTUNE = tf.data.AUTOTUNE
_CACHED_RAW: dict[tuple, tf.data.Dataset] = {}  # in-memory caches must outlive one epoch's pipeline


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


def _local_batch(batch_size: int, process_count: int) -> int:
    if batch_size % process_count:
        raise ValueError(
            f"data.batch_size={batch_size} (global) is not divisible by the {process_count} "
            "processes: pick a multiple of the process count."
        )
    return batch_size // process_count


def num_examples(data_config, split: str) -> int:
    """Examples in `split`, after data.train_subset when `split` is the train split."""
    limit = data_config.train_subset if split == data_config.train_split else -1
    return sources.resolve_split(data_config, split, limit).num_examples


def steps_per_epoch(data_config, process_count: int = 1) -> int:
    """Batches per training epoch, the same on every process (the global batch count)."""
    _local_batch(data_config.batch_size, process_count)
    return num_examples(data_config, data_config.train_split) // data_config.batch_size


def _options(ds: tf.data.Dataset) -> tf.data.Dataset:
    options = tf.data.Options()
    options.deterministic = True
    return ds.with_options(options)


def _checked_folder_images(
    source: sources.SplitSource,
    order: np.ndarray,
    positions: tf.data.Dataset,
    first_position: int,
    skip_corrupt: bool,
) -> tf.data.Dataset:
    """Decode folder images at `positions` of `order` (wrapping), naming any unreadable file.

    Decoding errors are dropped with ignore_errors, then a sequential scan notices the hole in the
    positions: it fails naming the file (skip_corrupt=False) or logs it with the running count
    (True). The happy path pays only a cheap scan; no file is opened twice.
    """
    paths = tf.constant(np.asarray(source.paths, dtype=object)[order])
    labels = tf.constant(source.labels[order])
    indices = tf.constant(order.astype(np.int64))
    size = len(order)

    def lookup(position):
        i = position % size
        return {"position": position, "path": paths[i], "label": labels[i], "index": indices[i]}

    def decode(record):
        return {**record, "image": sources.decode_image(record["path"], is_path=True)}

    ds = positions.map(lookup).map(decode, num_parallel_calls=AUTOTUNE, deterministic=True)
    ds = ds.ignore_errors()

    def check(state, record):
        expected, skipped = state
        gap = record["position"] - expected
        first_missing = paths[expected % size]
        if skip_corrupt:
            skipped = skipped + gap
            report = tf.cond(
                gap > 0,
                lambda: tf.print(
                    "WARNING jssl.data: skipped unreadable image",
                    first_missing,
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
                    first_missing,
                    "Fix or remove it, or set data.skip_corrupt=True to skip such files.",
                ],
                summarize=1,
            )
        with tf.control_dependencies([report]):
            record = {k: tf.identity(v) for k, v in record.items()}
        return (record["position"] + 1, skipped), record

    initial = (tf.constant(first_position, tf.int64), tf.constant(0, tf.int64))
    return ds.scan(initial, check)


def _views_fn(data_config, seed: int, epoch: int):
    augment = data_config.augment
    size = data_config.image_size

    def make_views(example):
        image = tf.image.convert_image_dtype(example["image"], tf.float32)
        view_seeds = tf.random.experimental.stateless_split(
            transforms.example_seed(seed, epoch, example["index"]), augment.num_views
        )
        views = tuple(
            transforms.ssl_view(image, view_seeds[v], size, augment)
            for v in range(augment.num_views)
        )
        return {"views": views, "label": example["label"], "index": example["index"]}

    return make_views


def _decode_record(record):
    return {**record, "image": sources.decode_image(record["image"], is_path=False)}


def _decode_uint8(record):
    image = tf.io.decode_image(record["image"], channels=3, expand_animations=False)
    return {**record, "image": tf.ensure_shape(image, [None, None, 3])}


def _cached_raw(data_config, source: sources.SplitSource, start: int, end: int) -> tf.data.Dataset:
    """Decoded uint8 records, cached in memory once per process and reused by every epoch."""
    key = (
        data_config.source,
        data_config.name,
        str(data_config.data_dir),
        source.split,
        start,
        end,
    )
    if key not in _CACHED_RAW:
        raw = source.read(start, end).map(_decode_uint8, num_parallel_calls=AUTOTUNE)
        if data_config.skip_corrupt:
            raw = raw.ignore_errors(log_warning=True)
        _CACHED_RAW[key] = raw.cache()
    return _CACHED_RAW[key]


def build_train_dataset(
    data_config,
    *,
    seed: int,
    epoch: int,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
) -> tf.data.Dataset:
    """This process's batches of one training epoch: {"views", "label", "index"}.

    See jssl/data/__init__.py for the contract. Batches are exactly steps_per_epoch long in count
    on every process; start_step > 0 drops that many batches before anything is decoded.
    """
    local_batch = _local_batch(data_config.batch_size, process_count)
    source = sources.resolve_split(data_config, data_config.train_split, data_config.train_subset)
    steps = source.num_examples // data_config.batch_size
    if steps == 0:
        raise ValueError(
            f"The train split has {source.num_examples} examples, fewer than one global batch of "
            f"{data_config.batch_size}: lower data.batch_size or data.train_subset."
        )
    start, end = shard_bounds(source.num_examples, process_count, process_index)
    shard_size = end - start  # >= steps * local_batch, since shard sizes differ by at most one
    skipped_examples = min(start_step, steps) * local_batch
    # One shuffle seed per (seed, epoch); SeedSequence mixes the two into a well-spread integer.
    shuffle_seed = int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])

    if source.kind == "folder":
        if data_config.cache:
            logging.info("data.cache is not used for image folders; the OS page cache serves.")
        # File lists are cheap to permute fully, which beats any shuffle buffer.
        order = np.arange(start, end)[np.random.default_rng(shuffle_seed).permutation(shard_size)]
        # skip_corrupt may drop files: read on into a second pass so the epoch stays full-length.
        # Without it, one position past the end lets the scan see a hole at the very end.
        stop = 2 * shard_size if data_config.skip_corrupt else shard_size + 1
        positions = tf.data.Dataset.range(skipped_examples, max(stop, skipped_examples + 1))
        ds = _checked_folder_images(
            source, order, positions, skipped_examples, data_config.skip_corrupt
        )
    else:
        if data_config.cache:
            ds = _cached_raw(data_config, source, start, end)
        else:
            ds = source.read(start, end)
        buffer = max(1, min(data_config.shuffle_buffer, shard_size))
        ds = ds.shuffle(buffer, seed=shuffle_seed, reshuffle_each_iteration=False)
        ds = ds.skip(skipped_examples)  # before decoding: resuming costs no image work
        if not data_config.cache:
            ds = ds.map(_decode_record, num_parallel_calls=AUTOTUNE, deterministic=True)
            if data_config.skip_corrupt:
                ds = ds.ignore_errors(log_warning=True)

    ds = ds.map(
        _views_fn(data_config, seed, epoch), num_parallel_calls=AUTOTUNE, deterministic=True
    )
    ds = ds.batch(local_batch, drop_remainder=True).take(steps - min(start_step, steps))
    return _options(ds.prefetch(AUTOTUNE))


def build_eval_dataset(
    data_config,
    split: str,
    *,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
) -> tf.data.Dataset:
    """This process's batches over the whole `split`: {"image", "label", "index", "mask"}.

    Padding rows (mask=False, index=-1) fill the last batch and, where a shard is shorter, whole
    batches, so every process runs the same number of steps with static shapes.
    """
    local_batch = _local_batch(batch_size, process_count)
    source = sources.resolve_split(data_config, split)
    start, end = shard_bounds(source.num_examples, process_count, process_index)
    num_batches = math.ceil(math.ceil(source.num_examples / process_count) / local_batch)
    size = data_config.image_size
    augment = data_config.augment

    if end == start:  # more processes than examples: this one only pads
        ds = None
    elif source.kind == "folder":
        order = np.arange(start, end)
        # One position past the end (wrapping to the first file) lets the scan see a final hole;
        # that extra record is then dropped.
        positions = tf.data.Dataset.range(0, end - start + 1)
        ds = _checked_folder_images(source, order, positions, 0, data_config.skip_corrupt)
        ds = ds.filter(lambda r: r["position"] < end - start)
    else:
        ds = source.read(start, end).map(_decode_record, num_parallel_calls=AUTOTUNE)
        if data_config.skip_corrupt:
            ds = ds.ignore_errors(log_warning=True)

    def preprocess(example):
        return {
            "image": transforms.eval_image(example["image"], size, augment.mean, augment.std),
            "label": tf.cast(example["label"], tf.int32),
            "index": tf.cast(example["index"], tf.int64),
            "mask": tf.constant(True),
        }

    padding = tf.data.Dataset.from_tensors(
        {
            "image": tf.zeros([size, size, 3], tf.float32),
            "label": tf.constant(0, tf.int32),
            "index": tf.constant(-1, tf.int64),
            "mask": tf.constant(False),
        }
    ).repeat()
    if ds is not None:
        ds = ds.map(preprocess, num_parallel_calls=AUTOTUNE, deterministic=True)
        padding = ds.concatenate(padding)
    ds = padding.take(num_batches * local_batch)
    ds = ds.batch(local_batch, drop_remainder=True)
    return _options(ds.prefetch(AUTOTUNE))
