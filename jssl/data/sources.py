"""Where examples come from: TFDS builders (including the demo set) and image folders.

A split is resolved once into a `SplitSource` that knows its size and can read any contiguous
range [start, end) of it in a stable order, as raw records {"image": encoded bytes or a file path,
"label", "index"}; "label" is a class id, or for TFDS data with VOC's per-image labels VISSL's
multi-label (C,) target (jssl.data.transfer). Decoding is left to the pipeline
(jssl.data.decoding) so that skipping and shuffling happen on cheap undecoded records. Dataset
indices are positions in the stored split order (TFDS with shuffle_files=False; folders sorted by
class then file name), so they are stable across runs.

Some sources can also read any single example (`random_access`): image folders, and TFDS datasets
prepared in ArrayRecord files (`tfds build NAME --file_format=array_record`), read through TFDS's
random-access data source. The training pipeline then reads exactly the examples of the global
order (jssl.data.order); TFRecord files can only be streamed.

The demo data read by the numpy pipeline (jssl.data.backend picks it where TensorFlow is missing)
resolves to kind "demo": its images are generated in memory (jssl.data.demo), with TFDS's split
and slice syntax (`slice_bounds`). TensorFlow and TFDS are imported only by the functions that
read TFDS data or build tf.data ops, so resolving a folder or the numpy demo needs neither.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import TYPE_CHECKING

import numpy as np
from absl import logging

from jssl.data import backend, demo, transfer

if TYPE_CHECKING:
    import tensorflow as tf
    import tensorflow_datasets as tfds

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
DEMO_NAME = "jssl_demo"
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
    array_record: bool = False  # tfds: prepared in ArrayRecord files, readable by index

    @property
    def random_access(self) -> bool:
        """Whether any example can be read on its own, in any order."""
        return self.kind in ("folder", "demo") or self.array_record

    @property
    def num_classes(self) -> int | None:
        """Classes of the labels: TFDS metadata, an image folder's class folders or the demo's
        classes; None when the data does not say."""
        if self.kind == "folder":
            return int(self.labels.max()) + 1
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


def _tfds_builder(data_config) -> tfds.core.DatasetBuilder:
    backend.require_tensorflow(data_config)
    import tensorflow_datasets as tfds

    data_dir = data_config.data_dir
    if data_config.source == "demo":
        from jssl.data import demo_tfds  # noqa: F401  (registers the "jssl_demo" builder)

        builder = tfds.builder(DEMO_NAME, data_dir=data_dir)
        if not builder.is_prepared():
            # Offline and a few seconds; TFDS writes to a temporary dir and renames it at the end.
            logging.info("Generating the jssl demo dataset into %s", builder.data_dir)
            builder.download_and_prepare()
        return builder
    if not data_config.name:
        raise ValueError('data.source="tfds" needs a dataset name: set data.name (e.g. "cifar10").')
    try:
        return tfds.builder(data_config.name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError as e:
        raise ValueError(
            f"Unknown TFDS dataset data.name={data_config.name!r}: check the spelling, or use "
            'data.source="folder" for a folder of images.'
        ) from e


def _not_prepared_error(data_config, builder) -> FileNotFoundError:
    return FileNotFoundError(
        f"TFDS dataset {data_config.name!r} is not prepared in data_dir={builder.data_dir!r}. "
        f"Prepare it with `tfds build {data_config.name} --data_dir=<dir>` (ImageNet needs its "
        "archives placed in <dir>/downloads/manual first) and set data.data_dir to that dir."
    )


def _unknown_split_error(data_config, split: str, available) -> ValueError:
    field = {data_config.train_split: "data.train_split", data_config.test_split: "data.test_split"}
    where = field.get(split, "the config field that names it (knn.train_split, extract.splits...)")
    return ValueError(
        f"Unknown split {split!r} of data.source={data_config.source!r}; available: "
        f"{sorted(available)}. Set {where} to one of them."
    )


def _resolve_tfds(data_config, split: str) -> SplitSource:
    import tensorflow_datasets as tfds
    from tensorflow_datasets.core import file_adapters

    builder = _tfds_builder(data_config)
    split_infos = builder.info.splits
    if split_infos and "+" in split:
        return _resolve_tfds_sum(data_config, builder, split)
    if split_infos:
        name = split.split("[", 1)[0].strip()
        if name not in split_infos:
            raise _unknown_split_error(data_config, split, split_infos.keys())
        try:
            (absolute,) = tfds.core.ReadInstruction.from_spec(split).to_absolute(split_infos)
        except (ValueError, AssertionError) as e:
            raise ValueError(
                f"Split {split!r} of {builder.name} is not a valid TFDS slice ({e}); write it as "
                "'train', 'train[:1000]' or 'train[10%:20%]'."
            ) from e
        start = absolute.from_ or 0
        end = (
            absolute.to if absolute.to is not None else split_infos[absolute.splitname].num_examples
        )
        return SplitSource(
            kind="tfds",
            split=split,
            num_examples=end - start,
            offset=start,
            builder=builder,
            base_split=absolute.splitname,
            array_record=builder.info.file_format == file_adapters.FileFormat.ARRAY_RECORD,
        )
    # No split metadata: the data is mocked (tfds.testing.mock_data) or missing. Count by reading,
    # which only works in the first case.
    try:
        ds = builder.as_dataset(split=split, decoders={"image": tfds.decode.SkipDecoding()})
    except AssertionError as e:  # TFDS asserts that the data dir exists
        raise _not_prepared_error(data_config, builder) from e
    count = int(ds.reduce(np.int64(0), lambda n, _: n + 1))
    return SplitSource(
        kind="tfds", split=split, num_examples=count, builder=builder, sliceable=False
    )


def _resolve_tfds_sum(data_config, builder, split: str) -> SplitSource:
    """A sum of (optionally sliced) splits, e.g. VOC07's "train+validation" (VISSL's trainval):
    read in TFDS's order, ranges by skipping (no split slicing, no random access), indices
    0..n-1 over the whole sum."""
    split_infos = builder.info.splits
    for part in split.split("+"):
        if part.split("[", 1)[0].strip() not in split_infos:
            raise _unknown_split_error(data_config, split, split_infos.keys())
    try:
        size = split_infos[split].num_examples
    except (ValueError, AssertionError, KeyError) as e:
        raise ValueError(
            f"Split {split!r} of {builder.name} is not a valid TFDS split sum ({e}); write it as "
            "'train+validation' or 'train[:50%]+validation'."
        ) from e
    return SplitSource(
        kind="tfds", split=split, num_examples=size, builder=builder, sliceable=False
    )


# TFDS's split syntax (tensorflow_datasets/core/splits.py): name, then an optional [from:to].
_SPLIT_RE = re.compile(r"^(?P<name>[\w-]+)(\[(?P<selector>[\d\w%:.-]+)\])?$")
_BOUND_RE = re.compile(r"^((?P<value>-?[\d_.]+)(?P<unit>%)?)?$")


def slice_bounds(split: str, sizes: dict[str, int]) -> tuple[str, int, int]:
    """(base split, start, end) of a TFDS split spec such as 'train', 'train[:1000]' or
    'test[10%:-10%]' over splits of ``sizes``, as TFDS resolves it (percent boundaries rounded
    to the closest example), for sources read without TFDS."""
    invalid = ValueError(
        f"Split {split!r} is not a split name or one slice of one: write it as 'train', "
        "'train[:1000]' or 'train[10%:20%]'."
    )
    match = _SPLIT_RE.match(split.strip())
    bounds = (match["selector"] or ":").split(":") if match else []
    units = [_BOUND_RE.match(b) for b in bounds]
    if len(bounds) != 2 or not all(units):
        raise invalid
    name = match["name"]
    if name not in sizes:
        raise KeyError(name)
    size = sizes[name]
    percent = any(u["unit"] for u in units)

    def absolute(bound, default: int) -> int:
        if not bound["value"]:
            return default
        if percent:  # TFDS's "closest" rounding
            return int(round(float(bound["value"]) * size / 100.0))
        return int(bound["value"])

    try:
        start, end = absolute(units[0], 0), absolute(units[1], size)
    except ValueError:
        raise invalid from None
    if abs(start) > size or abs(end) > size:
        raise ValueError(f"Split {split!r}: the slice is outside the {size} examples of {name!r}.")
    start, end = (size + start if start < 0 else start), (size + end if end < 0 else end)
    return name, start, max(start, end)


def _resolve_demo(data_config, split: str) -> SplitSource:
    """The demo data generated in memory (the numpy pipeline): TFDS's split syntax, no files."""
    try:
        base, start, end = slice_bounds(split, demo.SPLIT_SIZES)
    except KeyError:
        raise _unknown_split_error(data_config, split, demo.SPLIT_SIZES) from None
    return SplitSource(
        kind="demo",
        split=split,
        num_examples=end - start,
        offset=start,
        base_split=base,
        labels=np.arange(start, end, dtype=np.int32) % len(demo.CLASS_NAMES),
    )


def _check_folder_split(data_config, root: str, split: str) -> str:
    """root/split, refusing names that would read outside root and naming the available splits."""
    parts = split.replace("\\", "/").split("/")
    if not split or os.path.isabs(split) or ".." in parts:
        raise ValueError(
            f"Split {split!r} is not a sub-folder name: data.source='folder' reads only "
            f"data.data_dir/<split>/, so absolute paths and '..' are refused. Point data.data_dir "
            "at the root folder and set the split to the name of a folder inside it."
        )
    split_dir = os.path.join(root, split)
    if os.path.isdir(root) and not os.path.isdir(split_dir):
        available = [d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))]
        error = _unknown_split_error(data_config, split, available)
        if "[" in split:
            error = ValueError(
                f"{error} Image folders do not support TFDS slicing; use data.train_subset."
            )
        raise error
    return split_dir


@functools.lru_cache(maxsize=16)
def list_image_folder(root: str, split: str) -> tuple[tuple[str, ...], np.ndarray, tuple[str, ...]]:
    """(paths, labels, class_names) of root/split/<class>/<file>, sorted; listed once a process."""
    split_dir = os.path.join(root, split)
    if not os.path.isdir(split_dir):
        raise FileNotFoundError(
            f"Image folder {split_dir!r} does not exist. data.source='folder' expects "
            "data.data_dir/<split>/<class_name>/<image files>; set data.data_dir to the root and "
            "data.train_split/test_split to the sub-folder names."
        )
    class_names = tuple(
        sorted(d for d in os.listdir(split_dir) if os.path.isdir(os.path.join(split_dir, d)))
    )
    if not class_names:
        raise FileNotFoundError(
            f"No class sub-folders in {split_dir!r}: expected {split_dir}/<class_name>/<images>."
        )
    paths, labels = [], []
    for label, name in enumerate(class_names):
        class_dir = os.path.join(split_dir, name)
        files = sorted(f for f in os.listdir(class_dir) if f.lower().endswith(IMAGE_EXTENSIONS))
        paths.extend(os.path.join(class_dir, f) for f in files)
        labels.extend([label] * len(files))
    if not paths:
        raise FileNotFoundError(
            f"No image files ({', '.join(IMAGE_EXTENSIONS)}) under the class folders of "
            f"{split_dir!r}."
        )
    return tuple(paths), np.asarray(labels, np.int32), class_names


def resolve_split(data_config, split: str, limit: int = -1) -> SplitSource:
    """Resolve `split` of the configured source; `limit` > 0 keeps only its first `limit`."""
    if data_config.source == "demo" and backend.resolve(data_config) == "numpy":
        source = _resolve_demo(data_config, split)
    elif data_config.source in ("demo", "tfds"):
        source = _resolve_tfds(data_config, split)
    elif data_config.source == "folder":
        if not data_config.data_dir:
            raise ValueError('data.source="folder" needs data.data_dir (the root folder).')
        root = os.fspath(data_config.data_dir)
        _check_folder_split(data_config, root, split)
        paths, labels, _ = list_image_folder(root, split)
        source = SplitSource(
            kind="folder", split=split, num_examples=len(paths), paths=paths, labels=labels
        )
    else:
        raise ValueError(
            f"Unknown data.source={data_config.source!r}: use 'demo', 'tfds' or 'folder'."
        )
    if limit > 0 and limit < source.num_examples:
        labels = None if source.labels is None else source.labels[:limit]
        source = dataclasses.replace(source, num_examples=limit, labels=labels)
    return source
