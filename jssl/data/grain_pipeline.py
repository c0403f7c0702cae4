"""The grain input pipeline (``data.loader="grain"``): image folders, TFDS datasets stored as
ArrayRecord and the demo data, without TensorFlow.

grain (google/grain) runs it in ``data.workers`` processes, each making whole batches by index
(decode with Pillow, crop, resize and flip in uint8: jssl.data.pil_images) in jssl.data.order's
order, so it keeps tf.data's promises: a global batch holds the same examples on any number of
processes or devices, a resumed run starts at the batch after its checkpoint, and an unreadable
image fails naming it or (data.skip_corrupt=True) is replaced as on tf.data. A crop is a
function of (seed, epoch, dataset index, crop number) alone (jssl.data.keyed_crops), so the
views are those of the numpy pipeline and of tf.data with data.augment.on_device, up to the
resize's rounding; the train step makes the rest of each view (jssl.data.device_augment) unless
no group needs more than crop and flip. The train engine reads one iterator for the whole run
(``run_batches``), so the workers start once; evaluation splits are read in threads, each
example once, padded with the mask. More: docs/operations.md, "Data".
"""

from __future__ import annotations

import functools
import math
import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
from absl import flags, logging

from jssl.data import backend, crops, demo, keyed_crops, order, pil_images, sources, splits

_MAX_WORKERS = 32
# A worker's life after a SIGTERM sent to the whole process group (SLURM's scancel, a
# preemption): the training process stops after a step or two and closes its workers, and
# needs their batches until then.
_SIGTERM_GRACE_S = 20.0


def num_workers(data_config) -> int:
    """data.workers, or for -1 (auto) the cores this process may use less one for the train
    loop, at least 1 and at most 32."""
    workers = data_config.get("workers", -1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < -1:
        raise ValueError(
            f"data.workers={workers!r}: give the number of input worker processes (0: read in "
            "this process's threads) or -1 for one per core less one."
        )
    if workers >= 0:
        return workers
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 2
    return max(1, min(_MAX_WORKERS, cores - 1))


class Examples:
    """A split's images and labels by dataset index, picklable: each worker process resolves
    the split itself on first use (listing the folder or opening the ArrayRecord files) rather
    than receiving it."""

    def __init__(self, data_config, split: str, limit: int = -1):
        self._config, self._split, self._limit = data_config, split, limit
        self._source = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_source": None}

    @property
    def source(self) -> sources.SplitSource:
        if self._source is None:
            self._source = sources.resolve_split(self._config, self._split, self._limit)
            _check_readable(self._source)
        return self._source

    def describe(self, index: int) -> str:
        if self.source.kind == "folder":
            return self.source.paths[index]
        return f"example {index} of split {self._split!r}"

    def read(self, indices) -> list:
        """(Pillow RGB image or UnreadableImage, label) of each of ``indices``."""
        source = self.source
        if source.kind == "demo":
            images, labels = _demo_arrays(source.base_split, source.offset + source.num_examples)
            encoded = [images[source.offset + i] for i in indices]
            labels = labels[source.offset + np.asarray(indices, np.int64)]
        elif source.kind == "folder":
            encoded = [source.paths[i] for i in indices]
            labels = source.labels[np.asarray(indices, np.int64)]
        else:
            encoded, labels = source.fetch(np.asarray(indices, np.int64))
        out = []
        for index, data, label in zip(indices, encoded, labels, strict=True):
            try:
                out.append((pil_images.open_rgb(data, self.describe(int(index))), label))
            except pil_images.UnreadableImage as e:
                out.append((e, label))
        return out


@functools.lru_cache(maxsize=4)
def _demo_arrays(split: str, count: int):
    return demo.split_images(split, count)


def _check_readable(source: sources.SplitSource) -> None:
    if source.kind == "tfds" and not source.array_record:
        raise ValueError(
            f"data.loader='grain' reads TFDS datasets by index from ArrayRecord files, and split "
            f"{source.split!r} is stored as TFRecord: rebuild it with `tfds build <name> "
            "--file_format=array_record`, or read it with data.loader='tf' (needs TensorFlow)."
        )


class TrainBatches:
    """grain's source of a run's training batches: batch b is global batch ``start_step + b``
    counted over the epochs from ``first_epoch``, this process's rows of it, with its epoch and
    index in the epoch."""

    def __init__(self, data_config, *, seed, first_epoch, start_step, num_epochs, process):
        local, source, steps, start_step = splits.train_epoch(
            data_config, start_step=start_step, process_count=process[1]
        )
        self._config, self._seed, self._process = data_config, seed, process
        self._local, self._num, self._steps = local, source.num_examples, steps
        self._first_epoch, self._start = first_epoch, start_step
        self._length = max(0, (num_epochs - first_epoch) * steps - start_step)
        self._examples = Examples(data_config, data_config.train_split, data_config.train_subset)
        self._streams: dict[int, np.ndarray] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_streams": {}}

    def __len__(self) -> int:
        return self._length

    def stream(self, epoch: int) -> np.ndarray:
        """This process's dataset indices of ``epoch`` in order (jssl.data.order)."""
        if epoch not in self._streams:
            batches = order.epoch_order(
                self._num, self._config.batch_size, seed=self._seed, epoch=epoch
            )
            self._streams = {epoch: order.process_order(batches, *self._process)}
        return self._streams[epoch]

    def __getitem__(self, b: int) -> dict:
        epoch, index = divmod(self._start + int(b), self._steps)
        epoch += self._first_epoch
        stream = self.stream(epoch)
        positions = range(index * self._local, (index + 1) * self._local)
        rows = _readable_rows(self._examples, stream, positions, self._config.skip_corrupt)
        batch = train_batch(self._config, rows, seed=self._seed, epoch=epoch)
        return {**batch, "epoch": np.int64(epoch), "step_in_epoch": np.int64(index)}


def _readable_rows(examples: Examples, stream, positions, skip_corrupt: bool) -> list:
    """(index, image, label, replaced) per stream position: an unreadable example fails, or
    with ``skip_corrupt`` takes the next readable one of the stream (wrapping)."""
    read = examples.read([int(stream[p]) for p in positions])
    rows = []
    for position, (image, label) in zip(positions, read, strict=True):
        index, replaced = int(stream[position]), False
        if isinstance(image, pil_images.UnreadableImage):
            if not skip_corrupt:
                raise ValueError(
                    f"Unreadable or corrupt image file: {image.what}. Fix or remove it, or set "
                    "data.skip_corrupt=True to skip such files."
                ) from image
            index, image, label = _next_readable(examples, stream, position)
            replaced = True
        rows.append((index, image, label, replaced))
    return rows


def _next_readable(examples: Examples, stream, position: int):
    """The first readable example after ``position`` in the stream, wrapping at its end."""
    logging.warning(
        "jssl.data: skipped unreadable image %s; the next readable example of this process's "
        "stream stands in for it (data.skip_corrupt=True).",
        examples.describe(int(stream[position])),
    )
    for step in range(1, len(stream)):
        index = int(stream[(position + step) % len(stream)])
        ((image, label),) = examples.read([index])
        if not isinstance(image, pil_images.UnreadableImage):
            return index, image, label
    raise ValueError("No readable image in this epoch's stream of the train split: check the data.")


def train_batch(data_config, rows: list, *, seed: int, epoch: int) -> dict:
    """The training batch of ``rows`` ((index, Pillow image, label, replaced)): jssl.data's
    layout ("crops" per group, "label", "index", "replaced", and "aug_seeds" where the step
    makes the views)."""
    augment = data_config.augment
    on_device = backend.views_on_device(data_config)
    images = {index: image for index, image, _, _ in rows}

    def view(index, words, group):
        return host_view(images[index], words, group, augment, finish=not on_device)

    indices = [row[0] for row in rows]
    groups = crops.crop_groups(data_config)
    batch = keyed_crops.keyed_views(indices, groups, view, seed=seed, epoch=epoch)
    if not on_device:
        del batch["aug_seeds"]
    batch.update(
        label=np.asarray([row[2] for row in rows], np.int32),
        index=np.asarray(indices, np.int64),
        replaced=np.asarray([row[3] for row in rows], bool),
    )
    return batch


def host_view(image, words: np.ndarray, group: crops.CropGroup, augment, finish: bool):
    """One crop of a Pillow image and its (3, 2) uint32 step seeds, drawn from ``words`` by
    jssl.data.keyed_crops: uint8, or with ``finish`` the float32 normalised view."""
    width, height = image.size
    draw = keyed_crops.crop_draw(words, height, width, group, augment.crop_ratio)
    crop = pil_images.crop_resize(image, draw.box, group.size)
    if draw.flip:
        crop = crop[:, ::-1]
    if finish:
        crop = crop.astype(np.float32) / np.float32(255.0)
        crop = (crop - np.asarray(augment.mean, np.float32)) / np.asarray(augment.std, np.float32)
    return crop, draw.seeds


class EvalBatches:
    """grain's source of an evaluation split's batches on this process: its contiguous shard,
    then padding rows (mask False, index -1) up to the same batch count on every process."""

    def __init__(self, data_config, split: str, *, batch_size: int, process):
        self._config, self._local = data_config, order.local_batch(batch_size, process[1])
        self._examples = Examples(data_config, split)
        total = self._examples.source.num_examples
        self._start, self._end = order.shard_bounds(total, process[1], process[0])
        self._length = math.ceil(math.ceil(total / process[1]) / self._local)
        self.label_shape = self._examples.source.label_shape

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, b: int) -> dict:
        first = self._start + int(b) * self._local
        indices = list(range(first, min(first + self._local, self._end)))
        size, augment = self._config.image_size, self._config.augment
        image = np.zeros((self._local, size, size, 3), np.float32)
        label = np.zeros((self._local, *self.label_shape), np.int32)
        index = np.full(self._local, -1, np.int64)
        for row, (i, (decoded, y)) in enumerate(
            zip(indices, self._examples.read(indices), strict=True)
        ):
            if isinstance(decoded, pil_images.UnreadableImage):
                if not self._config.skip_corrupt:
                    raise ValueError(
                        f"Unreadable or corrupt image file: {decoded.what}. Fix or remove it, or "
                        "set data.skip_corrupt=True to leave it out (masked)."
                    ) from decoded
                logging.warning(
                    "jssl.data: skipped unreadable image %s (masked out of the split; "
                    "data.skip_corrupt=True).",
                    decoded.what,
                )
                continue
            image[row] = pil_images.eval_view(decoded, size, augment.mean, augment.std)
            label[row], index[row] = y, i
        return {"image": image, "label": label, "index": index, "mask": index >= 0}


class Batches:
    """A grain pipeline's batches with tf.data.Dataset's ``as_numpy_iterator()`` (each call
    starts a fresh pass) and ``len()``, as the engines read every pipeline."""

    def __init__(self, batches, workers: int, threads: int):
        self._batches, self._workers, self._threads = batches, workers, threads

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[dict]:
        return iterate(self._batches, self._workers, self._threads)

    def as_numpy_iterator(self) -> Iterator[dict]:
        return iter(self)


def _worker_init(worker_index: int, worker_count: int) -> None:
    """Signals in a worker process: Ctrl-C and a group's SIGTERM are the training process's to
    act on (it saves, stops and closes its workers), so a worker keeps serving until then,
    and ends by itself _SIGTERM_GRACE_S after a SIGTERM or as soon as its parent is gone."""
    del worker_index, worker_count
    parent = os.getppid()

    def exit_later(signum, frame):
        del signum, frame
        timer = threading.Timer(_SIGTERM_GRACE_S, os._exit, (0,))
        timer.daemon = True
        timer.start()

    def exit_with_parent():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, exit_later)
    threading.Thread(target=exit_with_parent, daemon=True).start()


def iterate(batches, workers: int, threads: int) -> Iterator[dict]:
    """The elements of ``batches`` in order: made in ``workers`` grain processes (one batch at
    a time each), or for 0 in ``threads`` threads of this one. Closes the workers at the end,
    on an error and when the consumer stops early."""
    import grain

    if not flags.FLAGS.is_parsed():  # grain reads absl flags; a library caller parsed none
        flags.FLAGS.mark_as_parsed()
    dataset = grain.MapDataset.source(batches)
    threads = 1 if workers else threads
    read = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=max(2, threads))
    dataset = dataset.to_iter_dataset(read)
    if workers:
        options = grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=2)
        dataset = dataset.mp_prefetch(options, worker_init_fn=_worker_init)
    iterator = iter(dataset)
    try:
        yield from iterator
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def _workers_for(data_config, length: int) -> int:
    """Worker processes for a pipeline of ``length`` batches: never more than the batches."""
    return min(num_workers(data_config), length)


def build_train_dataset(
    data_config, *, seed, epoch, start_step=0, process_index=0, process_count=1
) -> Batches:
    """This process's batches of one training epoch (jssl.data.pipeline's layout and order)."""
    batches = TrainBatches(
        data_config,
        seed=seed,
        first_epoch=epoch,
        start_step=start_step,
        num_epochs=epoch + 1,
        process=(process_index, process_count),
    )
    return Batches(_Strip(batches), _workers_for(data_config, len(batches)), threads=2)


class _Strip:
    """A TrainBatches source without the epoch and index fields (one epoch's batches)."""

    def __init__(self, batches: TrainBatches):
        self._batches = batches

    def __len__(self) -> int:
        return len(self._batches)

    def __getitem__(self, b: int) -> dict:
        batch = dict(self._batches[b])
        del batch["epoch"], batch["step_in_epoch"]
        return batch


def run_batches(
    data_config, *, seed, first_epoch, start_step, num_epochs, process_index, process_count
) -> Iterator[tuple[int, int, dict]]:
    """(epoch, index in the epoch, host batch) from (first_epoch, start_step) to the end of
    epoch num_epochs - 1, from one set of worker processes for the whole run."""
    batches = TrainBatches(
        data_config,
        seed=seed,
        first_epoch=first_epoch,
        start_step=start_step,
        num_epochs=num_epochs,
        process=(process_index, process_count),
    )
    for batch in iterate(batches, _workers_for(data_config, len(batches)), threads=2):
        epoch, index = int(batch.pop("epoch")), int(batch.pop("step_in_epoch"))
        yield epoch, index, batch


def build_eval_dataset(
    data_config, split: str, *, batch_size: int, process_index=0, process_count=1
) -> Batches:
    """This process's batches over the whole ``split``: {"image", "label", "index", "mask"},
    read in threads of this process (an evaluation pass is too short to start workers for)."""
    batches = EvalBatches(
        data_config, split, batch_size=batch_size, process=(process_index, process_count)
    )
    threads = max(1, num_workers(data_config))
    return Batches(batches, workers=0, threads=threads)
