"""Where examples come from: TFDS builders (including the demo set) and image folders.

A split is resolved once into a `SplitSource` that knows its size and can read any contiguous
range [start, end) of it in a stable order, as raw records {"image": encoded bytes or a file path,
"label", "index"}. Decoding is left to the pipeline so that skipping and shuffling happen on cheap
undecoded records. Dataset indices are positions in the stored split order (TFDS with
shuffle_files=False; folders sorted by class then file name), so they are stable across runs.

Some sources can also read any single example (`random_access`): image folders, and TFDS datasets
prepared in ArrayRecord files (`tfds build NAME --file_format=array_record`), read through TFDS's
random-access data source. The training pipeline then reads exactly the examples of the global
order (jssl.data.order); TFRecord files can only be streamed.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from absl import logging
from tensorflow_datasets.core import file_adapters

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
DEMO_NAME = "jssl_demo"
_FETCH_CHUNK = 64  # ArrayRecord: examples read per data-source call


@dataclasses.dataclass(frozen=True)
class SplitSource:
    """A resolved split: its size and how to read ranges of it."""

    kind: str  # "tfds" | "folder"
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
        return self.kind == "folder" or self.array_record

    @functools.cached_property
    def _data_source(self):
        # TFDS's random-access reader over the ArrayRecord files (one per process, opened once);
        # SkipDecoding keeps the image encoded, as read() does.
        return self.builder.as_data_source(
            split=self.base_split, decoders={"image": tfds.decode.SkipDecoding()}
        )

    def fetch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Encoded images (bytes objects) and int32 labels of examples `indices` (ArrayRecord)."""
        if not self.array_record:
            raise ValueError(f"Split {self.split!r} is not stored in ArrayRecord files.")
        records = self._data_source.__getitems__([self.offset + int(i) for i in indices])
        images = np.asarray([r["image"] for r in records], dtype=object)
        return images, np.asarray([r["label"] for r in records], np.int32)

    def fetch_records(self, indices: tf.data.Dataset) -> tf.data.Dataset:
        """Raw records {"image", "label", "index"} of a dataset of int64 indices (ArrayRecord),
        read in chunks (one data-source call each), in parallel and in order."""

        def chunk_records(chunk):
            images, labels = tf.numpy_function(self.fetch, [chunk], [tf.string, tf.int32])
            images.set_shape([None])
            labels.set_shape([None])
            return {"image": images, "label": labels, "index": chunk}

        ds = indices.batch(_FETCH_CHUNK)
        ds = ds.map(chunk_records, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return ds.unbatch()

    def read(self, start: int, end: int) -> tf.data.Dataset:
        """Raw records of examples [start, end) of this split, in index order."""
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
                "label": tf.cast(ex["label"], tf.int32),
                "index": tf.cast(i, tf.int64),
            }
        )


def _tfds_builder(data_config) -> tfds.core.DatasetBuilder:
    data_dir = data_config.data_dir
    if data_config.source == "demo":
        from jssl.data import demo  # noqa: F401  (registers the "jssl_demo" builder)

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
    builder = _tfds_builder(data_config)
    split_infos = builder.info.splits
    if split_infos:
        if "+" in split:
            raise ValueError(
                f"Split {split!r}: use a single (optionally sliced) split such as 'train' or "
                "'train[:10%]', not a sum of splits."
            )
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
    if data_config.source in ("demo", "tfds"):
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
        source = dataclasses.replace(source, num_examples=limit)
    return source


@dataclasses.dataclass(frozen=True)
class DecodedSplit:
    """Every example of a split decoded to uint8 and held in memory, for random access by index.

    Images may differ in size, so their pixels are stored back to back in one flat tensor with
    per-example offsets and shapes; a lookup is one slice. Unreadable examples keep an empty
    placeholder and readable[i] = False.
    """

    pixels: tf.Tensor  # uint8 [total pixels * 3]
    offsets: tf.Tensor  # int64 [N]
    shapes: tf.Tensor  # int64 [N, 3]
    labels: tf.Tensor  # int32 [N]
    readable: np.ndarray  # bool [N]

    def lookup(self, index: tf.Tensor) -> dict[str, tf.Tensor]:
        """{"image" uint8 HxWx3, "label", "index"} of example `index` (a scalar int64 tensor)."""
        shape = self.shapes[index]
        flat = tf.slice(self.pixels, [self.offsets[index]], [tf.reduce_prod(shape)])
        image = tf.ensure_shape(tf.reshape(flat, shape), [None, None, 3])
        return {"image": image, "label": self.labels[index], "index": index}


def decode_split(source: SplitSource, describe: str) -> DecodedSplit:
    """Reads and decodes all of `source` once (`describe` names it in the log)."""
    size = source.num_examples
    ds = source.read(0, size).map(
        lambda r: {**r, "image": decode_image_uint8(r["image"], is_path=source.kind == "folder")},
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    images = [np.zeros((0, 0, 3), np.uint8)] * size
    labels = np.zeros(size, np.int32)
    readable = np.zeros(size, bool)
    # Errors are dropped here and found as the indices that never arrive, so that the caller
    # decides what an unreadable example means (data.skip_corrupt).
    for record in ds.ignore_errors().as_numpy_iterator():
        i = int(record["index"])
        images[i], labels[i], readable[i] = record["image"], record["label"], True
    shapes = np.array([image.shape for image in images], np.int64).reshape(size, 3)
    counts = shapes.prod(axis=1)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    pixels = np.concatenate([image.reshape(-1) for image in images])
    logging.info(
        "Cached %s in memory: %d examples, %.1f MB of decoded pixels.",
        describe,
        size,
        pixels.nbytes / 2**20,
    )
    return DecodedSplit(
        pixels=tf.constant(pixels),
        offsets=tf.constant(offsets),
        shapes=tf.constant(shapes),
        labels=tf.constant(labels),
        readable=readable,
    )


def decode_image_uint8(image: tf.Tensor, is_path: bool) -> tf.Tensor:
    """Encoded bytes (or a file path) -> uint8 RGB HxWx3; grey and RGBA become RGB."""
    data = tf.io.read_file(image) if is_path else image
    decoded = tf.io.decode_image(data, channels=3, expand_animations=False)
    return tf.ensure_shape(decoded, [None, None, 3])


def decode_image(image: tf.Tensor, is_path: bool) -> tf.Tensor:
    """Encoded bytes (or a file path) -> float32 RGB in [0, 1]; grey and RGBA become RGB."""
    return tf.image.convert_image_dtype(decode_image_uint8(image, is_path), tf.float32)
