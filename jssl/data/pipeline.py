"""Host-local tf.data pipelines for SSL training and for evaluation / feature extraction.

jssl.data.loader calls this module for every source where TensorFlow is installed (and for
data.loader="tf"); the demo data has a numpy twin, jssl.data.numpy_pipeline, with the same
batch layout and, where this order is exact (data.cache=True, as the demo presets set), the same
order. Determinism is the design constraint: the views of an example are a function of (seed,
epoch, index) alone, and an epoch's batches of (seed, epoch, process index and count,
start_step), so a resumed run replays exactly the remaining batches. Randomness never comes from
stateful TF ops: orders are numpy permutations (jssl.data.order, which also says what holds for
each source and what replaces an unreadable example), augmentations stateless ops seeded per
example (clu.deterministic_data's per-example rng, keyed on the dataset index instead of the
stream position), and tf.data runs with deterministic=True. With data.skip_corrupt=False an
unreadable image fails naming the file (folders), the example (ArrayRecord TFDS) or the indices
(cached TFDS); streamed TFRecord TFDS raises the decoder's error.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import tensorflow as tf
from absl import logging

from jssl.data import crops, decoding, order, sources, splits, transforms

AUTOTUNE = tf.data.AUTOTUNE
_DECODED: dict[tuple, decoding.DecodedSplit] = {}  # data.cache: decoded splits, once per process


def _options(ds: tf.data.Dataset) -> tf.data.Dataset:
    """Deterministic order, and no autotuning model thread.

    Every epoch and every test phase builds its own pipeline and drops it at the end, and
    deleting an iterator waits for its autotuning thread, which sleeps between optimisations
    for periods that grow to 60 s: epoch ends stalled up to a minute with the CPU idle.
    Without the model thread each AUTOTUNE parallelism is the runner's thread count (the
    host's cores), at the same images/s within the noise (benchmarks/input_pipeline.py).
    """
    options = tf.data.Options()
    options.deterministic = True
    options.autotune.enabled = False
    return ds.with_options(options)


def _checked_images(
    source: sources.SplitSource,
    stream: np.ndarray,
    positions: tf.data.Dataset,
    first_position: int,
    skip_corrupt: bool,
    decode=decoding.decode_image,
) -> tf.data.Dataset:
    """Decode (with `decode`) the examples at `positions` of `stream` (wrapping) of a
    random-access source (image folder or ArrayRecord TFDS), naming any unreadable one.

    Decoding errors are dropped with ignore_errors, then order.with_gaps notices the hole in the
    positions. No example is read twice.
    """
    indices = tf.constant(stream.astype(np.int64))
    size = len(stream)
    if source.kind == "folder":
        paths = tf.constant(np.asarray(source.paths, dtype=object)[stream])
        labels = tf.constant(source.labels[stream])

        def lookup(position):
            i = position % size
            path, label = paths[i], labels[i]
            return {"position": position, "image": path, "label": label, "index": indices[i]}

        ds = positions.map(lookup)

        def describe(position):
            return paths[position % size]

    else:
        # The positions' examples, read by index; each record gets its position back.
        ds = positions.map(lambda position: indices[position % size])
        records = source.fetch_records(ds)
        ds = tf.data.Dataset.zip(positions, records).map(
            lambda position, record: {**record, "position": position}
        )

        def describe(position):
            return tf.strings.format(
                "example {} of split {}", (indices[position % size], source.split)
            )

    def decoded(record):
        image = decode(record["image"], is_path=source.kind == "folder")
        return {**record, "image": image}

    ds = ds.map(decoded, num_parallel_calls=AUTOTUNE, deterministic=True)
    return order.with_gaps(ds.ignore_errors(), first_position, skip_corrupt, describe)


def _crops_fn(data_config, seed: int, epoch: int):
    views = _views_fn(data_config)

    def make_crops(example):
        index = tf.cast(example["index"], tf.int64)
        key = tf.stack([tf.constant(seed, tf.int64), tf.constant(epoch, tf.int64), index])
        row = {"label": example["label"], "index": example["index"]}
        row.update(views(example["image"], key))
        return {**row, "replaced": example["replaced"]}

    return make_crops


# Traced view functions by crop groups and augmentation settings. Dataset.map traces its
# function again for every epoch's dataset; a tf.function called inside it is traced once per
# process (SwAV's multi-crop views take seconds to trace) and the epochs call that graph.
_VIEWS: dict[str, Any] = {}


def _views_fn(data_config):
    """``(uint8 image, int64 (seed, epoch, index)) -> {"crops"[, "aug_seeds"]}``, one traced
    graph per process for each crop-group and augmentation setting."""
    groups = crops.crop_groups(data_config)
    augment = data_config.augment
    on_device = augment.get("on_device", False)
    key = repr((groups, sorted(augment.to_dict().items(), key=lambda kv: kv[0])))
    if key not in _VIEWS:

        def views(image, key):
            if on_device:  # crop + flip in uint8; colour, blur, ... in the step (device_augment)
                crops_, seeds = transforms.host_crops(image, key, groups, augment)
                return {"crops": crops_, "aug_seeds": seeds}
            example_seed = transforms.example_seed(key[0], key[1], key[2])
            image = tf.image.convert_image_dtype(image, tf.float32)
            return {"crops": transforms.make_crops(image, example_seed, groups, augment)}

        _VIEWS[key] = tf.function(
            views,
            input_signature=(
                tf.TensorSpec([None, None, 3], tf.uint8),
                tf.TensorSpec([3], tf.int64),
            ),
            autograph=False,
        )
    return _VIEWS[key]


def _decode_record(record):
    return {**record, "image": decoding.decode_image(record["image"], is_path=False)}


def _decoded_split(data_config, source: sources.SplitSource) -> decoding.DecodedSplit:
    """The whole split decoded in memory, once per process and reused by every epoch."""
    key = (
        data_config.source,
        data_config.name,
        str(data_config.data_dir),
        source.split,
        source.offset,
        source.num_examples,
    )
    if key not in _DECODED:
        store = decoding.decode_split(source, f"split {source.split!r}")
        missing = np.flatnonzero(~store.readable)
        if len(missing) and not data_config.skip_corrupt:
            raise ValueError(
                f"{len(missing)} unreadable or corrupt example(s) in split {source.split!r} "
                f"(dataset indices {missing[:10].tolist()}{'...' if len(missing) > 10 else ''}): "
                "rebuild the dataset, or set data.skip_corrupt=True to replace them."
            )
        if len(missing):
            logging.warning(
                "%d unreadable example(s) in split %r (indices %s): each is replaced by the next "
                "readable example of the epoch (data.skip_corrupt=True).",
                len(missing),
                source.split,
                missing[:10].tolist(),
            )
        _DECODED[key] = store
    return _DECODED[key]


def _cached_rows(data_config, source, stream: np.ndarray, first: int, end: int):
    """Rows gathered from the in-memory split: exact order, unreadable ones replaced up front."""
    store = _decoded_split(data_config, source)
    stream, replaced = order.replace_unreadable_indices(stream, store.readable[stream])
    positions = {"index": stream[first:end].astype(np.int64), "replaced": replaced[first:end]}
    return tf.data.Dataset.from_tensor_slices(positions).map(
        lambda p: {**store.lookup(p["index"]), "replaced": p["replaced"]},
        num_parallel_calls=AUTOTUNE,
        deterministic=True,
    )


def _streamed_records(data_config, parts, stream_size: int, seed: int, epoch: int):
    """This process's undecoded stream (TFDS without cache), "position" numbered from 0."""
    # Round-robin over the blocks so every stretch of the stream mixes all of them.
    ds = tf.data.Dataset.choose_from_datasets(
        parts, tf.data.Dataset.range(len(parts)).repeat(), stop_on_empty_dataset=False
    )
    buffer = max(1, min(data_config.shuffle_buffer, stream_size))
    ds = ds.shuffle(buffer, seed=order.epoch_seed(seed, epoch), reshuffle_each_iteration=False)
    return ds.enumerate().map(lambda position, record: {**record, "position": position})


def build_train_dataset(
    data_config,
    *,
    seed: int,
    epoch: int,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
) -> tf.data.Dataset:
    """This process's batches of one training epoch: {"crops", "label", "index", "replaced"}.

    "crops" holds one array per crop group (jssl.data.crops), (local batch, num_crops, S, S, 3):
    the normalised float32 views, or with data.augment.on_device the uint8 crops (crop + flip
    only) and an "aug_seeds" array per group, (local batch, num_crops, 3, 2) uint32, from which
    the train step makes the views (jssl.data.device_augment).

    Exactly steps_per_epoch - start_step batches on every process, whatever is unreadable;
    start_step > 0 drops that many batches before anything is decoded. "replaced" (bool per row)
    is True where the row stands in for an unreadable example (data.skip_corrupt=True). See the
    jssl.data.order docstring for which order each source gives.
    """
    local_batch, source, steps, start_step = splits.train_epoch(
        data_config, start_step=start_step, process_count=process_count
    )
    # Positions in this process's stream of the epoch: row r of its batch t is position
    # t * local_batch + r.
    first, end = start_step * local_batch, steps * local_batch
    epoch_rows = _EpochRows(data_config, source, seed, epoch, process_index, process_count)
    cached = data_config.cache and source.kind == "tfds"
    if source.kind == "folder" and data_config.cache:
        logging.info("data.cache is not used for image folders; the OS page cache serves.")
    if cached:
        ds = _cached_rows(data_config, source, epoch_rows.stream(), first, end)
    elif source.random_access:
        ds = epoch_rows.random_access(first, end)
    else:
        ds = epoch_rows.streamed(first, end)
    ds = ds.map(
        _crops_fn(data_config, seed, epoch), num_parallel_calls=AUTOTUNE, deterministic=True
    )
    ds = ds.batch(local_batch, drop_remainder=True).take(steps - start_step)
    return _options(ds.prefetch(AUTOTUNE))


class _EpochRows:
    """The decoded rows of this process's stream of one epoch, positions first .. end - 1, from
    a random-access source (by index, in jssl.data.order's order) or a streamed one (blocks of
    TFDS records shuffled in a buffer), unreadable images named or replaced (skip_corrupt)."""

    # Training decodes to uint8: the host path converts to float in _crops_fn, and
    # data.augment.on_device crops and resizes the uint8 image without converting it whole.
    decode = staticmethod(decoding.decode_image_uint8)

    def __init__(self, data_config, source, seed, epoch, process_index, process_count):
        self.config, self.source, self.seed, self.epoch = data_config, source, seed, epoch
        self.process = (process_index, process_count)

    def stream(self) -> np.ndarray:
        """The dataset indices of this process's stream, position by position."""
        global_order = order.epoch_order(
            self.source.num_examples, self.config.batch_size, seed=self.seed, epoch=self.epoch
        )
        return order.process_order(global_order, *self.process)

    def random_access(self, first: int, end: int) -> tf.data.Dataset:
        stream, source = self.stream(), self.source
        if self.config.skip_corrupt:
            positions = tf.data.Dataset.range(first, end)
            checked = _checked_images(source, stream, positions, first, True, self.decode)
            restart = _checked_images(
                source, stream, tf.data.Dataset.range(0, end), 0, True, self.decode
            )
            return order.replace_unreadable(checked, restart, end - first)
        # One position past the end (wrapping) lets the scan see a hole at the very end.
        positions = tf.data.Dataset.range(first, end + 1)
        ds = _checked_images(source, stream, positions, first, False, self.decode)
        # One lambda per line: autograph finds a lambda's source by its line, and warns on
        # every run when two share one.
        ds = ds.filter(lambda r: r["position"] < end)
        return ds.map(lambda r: order.train_row(r, False))

    def streamed(self, first: int, end: int) -> tf.data.Dataset:
        source, (process_index, process_count) = self.source, self.process
        ranges = order.stream_block_ranges(
            source.num_examples,
            end,
            seed=self.seed,
            epoch=self.epoch,
            process_index=process_index,
            process_count=process_count,
        )
        # Built once: each as_dataset call costs tens of ms, and the datasets are reusable.
        parts = [source.read(start, stop) for start, stop in ranges]

        def records(skip: int) -> tf.data.Dataset:
            ds = _streamed_records(self.config, parts, end, self.seed, self.epoch)
            ds = ds.skip(skip).take(end - skip)  # skip before decoding: resuming is cheap
            return ds.map(
                lambda r: {**r, "image": self.decode(r["image"], is_path=False)},
                num_parallel_calls=AUTOTUNE,
                deterministic=True,
            )

        if not self.config.skip_corrupt:  # a decoding error propagates as it is
            return records(first).map(lambda r: order.train_row(r, False))

        def describe(position):
            return tf.strings.format(
                "at position {} of this process's stream of split {}", (position, source.split)
            )

        checked = order.with_gaps(records(first).ignore_errors(), first, True, describe)
        restart = order.with_gaps(records(0).ignore_errors(), 0, True, describe)
        return order.replace_unreadable(checked, restart, end - first)


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
    local_batch = order.local_batch(batch_size, process_count)
    source = sources.resolve_split(data_config, split)
    start, end = order.shard_bounds(source.num_examples, process_count, process_index)
    num_batches = math.ceil(math.ceil(source.num_examples / process_count) / local_batch)
    size = data_config.image_size
    augment = data_config.augment

    if end == start:  # more processes than examples: this one only pads
        ds = None
    elif source.kind == "folder":
        shard = np.arange(start, end)
        # One position past the end (wrapping to the first file) lets the scan see a final hole;
        # that extra record is then dropped.
        positions = tf.data.Dataset.range(0, end - start + 1)
        ds = _checked_images(source, shard, positions, 0, data_config.skip_corrupt)
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
            "label": tf.zeros(source.label_shape, tf.int32),
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
