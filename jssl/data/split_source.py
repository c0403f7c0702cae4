"""A resolved split, `SplitSource`: its size, and how to read ranges or single examples of it.

jssl.data.sources resolves a split of the configured source into one of these, once. It reads
any contiguous range [start, end) of the split in a stable order, as raw records {"image":
encoded bytes or a file path, "label", "index"}; "label" is a class id, or for TFDS data with
VOC's per-image labels VISSL's multi-label (C,) target (jssl.data.transfer). Decoding is left to
the pipeline (jssl.data.decoding) so that skipping and shuffling happen on cheap undecoded
records.

Some sources can also read any single example (`random_access`): image folders, and TFDS datasets
prepared in ArrayRecord files (`tfds build NAME --file_format=array_record`), read through TFDS's
random-access data source. The training pipeline then reads exactly the examples of the global
order (jssl.data.order); TFRecord files can only be streamed. TensorFlow and TFDS are imported
only by the methods that read TFDS data or build tf.data ops.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import numpy as np

from jssl.data import demo, transfer

if TYPE_CHECKING:
    import tensorflow as tf
    import tensorflow_datasets as tfds

_FETCH_CHUNK = 64  # ArrayRecord: examples read per data-source call


@dataclasses.dataclass(frozen=True)
class SplitSource:
    """A resolved split: its size and how to read ranges of it."""

    kind: str  # "tfds" | "folder" | "demo" (generated in memory, the numpy pipeline)
    split: str  # the split name as given (for messages)
    num_examples: int
    offset: int = 0  # absolute index (within the base split) of example 0
    builder: tfds.core.DatasetBuilder | None = None
    base_split: str = ""  # tfds: the split name without slicing
    sliceable: bool = True  # tfds: split info known, so ranges are read with split slicing
    paths: tuple[str, ...] = ()  # folder: files in index order
    labels: np.ndarray | None = None  # folder: int32 labels in index order
    class_names: tuple[str, ...] = ()  # folder: label i is class_names[i] (train's class folders)
    array_record: bool = False  # tfds: prepared in ArrayRecord files, readable by index

    @property
    def random_access(self) -> bool:
        """Whether any example can be read on its own, in any order."""
        return self.kind in ("folder", "demo") or self.array_record

    @property
    def num_classes(self) -> int | None:
        """Classes of the labels: TFDS metadata, the training split's class folders for an image
        folder, or the demo's classes; None when the data does not say."""
        if self.kind == "folder":
            return len(self.class_names)
        if self.kind == "demo":
            return len(demo.CLASS_NAMES)
        if self.multi_label_classes:
            return self.multi_label_classes
        label = self.builder.info.features["label"] if self.builder is not None else None
        return getattr(label, "num_classes", None)

    @functools.cached_property
    def multi_label_classes(self) -> int:
        """C for TFDS data with VOC's per-image labels (jssl.data.transfer): each example's
        label is then VISSL's (C,) target of 1 / 0 / -1; 0 for one class id per example."""
        if self.kind != "tfds" or self.builder is None:
            return 0
        return transfer.multi_label_classes(self.builder.info.features)

    @property
    def label_shape(self) -> tuple[int, ...]:
        """() for a class id per example, (C,) for multi-label targets."""
        return (self.multi_label_classes,) if self.multi_label_classes else ()

    @property
    def base_num_examples(self) -> int:
        """Examples of the whole split this one slices (``base_split``)."""
        if self.kind == "folder":
            return self.num_examples
        if self.kind == "demo":
            return demo.SPLIT_SIZES[self.base_split]
        return self.builder.info.splits[self.base_split].num_examples

    @functools.cached_property
    def _data_source(self):
        import tensorflow_datasets as tfds

        # TFDS's random-access reader over the ArrayRecord files (one per process, opened once);
        # SkipDecoding keeps the image encoded, as read() does.
        return self.builder.as_data_source(
            split=self.base_split, decoders={"image": tfds.decode.SkipDecoding()}
        )

    def fetch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Encoded images (bytes objects) and int32 labels (class ids or multi-label targets) of
        examples `indices` (ArrayRecord)."""
        if not self.array_record:
            raise ValueError(f"Split {self.split!r} is not stored in ArrayRecord files.")
        records = self._data_source.__getitems__([self.offset + int(i) for i in indices])
        images = np.asarray([r["image"] for r in records], dtype=object)
        labels = [transfer.example_label_np(r, self.multi_label_classes) for r in records]
        return images, np.asarray(labels, np.int32).reshape(len(records), *self.label_shape)

    def fetch_records(self, indices: tf.data.Dataset) -> tf.data.Dataset:
        """Raw records {"image", "label", "index"} of a dataset of int64 indices (ArrayRecord),
        read in chunks (one data-source call each), in parallel and in order."""
        import tensorflow as tf

        def chunk_records(chunk):
            images, labels = tf.numpy_function(self.fetch, [chunk], [tf.string, tf.int32])
            images.set_shape([None])
            labels.set_shape([None, *self.label_shape])
            return {"image": images, "label": labels, "index": chunk}

        ds = indices.batch(_FETCH_CHUNK)
        ds = ds.map(chunk_records, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return ds.unbatch()

    def read(self, start: int, end: int) -> tf.data.Dataset:
        """Raw records of examples [start, end) of this split, in index order."""
        import tensorflow as tf
        import tensorflow_datasets as tfds

        if self.kind == "demo":
            raise ValueError("The in-memory demo split is read by jssl.data.numpy_pipeline.")
        if self.kind == "folder":
            records = {
                "image": np.asarray(self.paths[start:end], dtype=object),
                "label": self.labels[start:end],
                "index": np.arange(start, end, dtype=np.int64),
            }
            return tf.data.Dataset.from_tensor_slices(records)
        if self.array_record:  # TFDS reads ArrayRecord files only through its data source
            return self.fetch_records(tf.data.Dataset.range(start, end))
        # SkipDecoding: shuffle and skip encoded bytes, decode only what is used.
        kwargs = dict(shuffle_files=False, decoders={"image": tfds.decode.SkipDecoding()})
        if self.sliceable:
            lo, hi = self.offset + start, self.offset + end
            ds = self.builder.as_dataset(split=f"{self.base_split}[{lo}:{hi}]", **kwargs)
        else:
            # No split metadata (e.g. tfds.testing.mock_data): read all, keep the range.
            ds = self.builder.as_dataset(split=self.split, **kwargs).skip(start).take(end - start)
        return ds.enumerate(start).map(
            lambda i, ex: {
                "image": ex["image"],
                "label": transfer.example_label(ex, self.multi_label_classes),
                "index": tf.cast(i, tf.int64),
            }
        )


def unknown_split_error(data_config, split: str, available) -> ValueError:
    """The error for a split the source does not have, naming the config field to change."""
    field = {data_config.train_split: "data.train_split", data_config.test_split: "data.test_split"}
    where = field.get(split, "the config field that names it (knn.train_split, extract.splits...)")
    return ValueError(
        f"Unknown split {split!r} of data.source={data_config.source!r}; available: "
        f"{sorted(available)}. Set {where} to one of them."
    )
