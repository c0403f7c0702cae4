"""Where examples come from: TFDS builders (including the demo set) and image folders.

A split is resolved once into a `SplitSource` that knows its size and can read any contiguous
range [start, end) of it in a stable order, as raw records {"image": encoded bytes or a file path,
"label", "index"}. Decoding is left to the pipeline so that skipping and shuffling happen on cheap
undecoded records. Dataset indices are positions in the stored split order (TFDS with
shuffle_files=False; folders sorted by class then file name), so they are stable across runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from absl import logging

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
DEMO_NAME = "jssl_demo"


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

    def read(self, start: int, end: int) -> tf.data.Dataset:
        """Raw records of examples [start, end) of this split, in index order."""
        if self.kind == "folder":
            records = {
                "image": np.asarray(self.paths[start:end], dtype=object),
                "label": self.labels[start:end],
                "index": np.arange(start, end, dtype=np.int64),
            }
            return tf.data.Dataset.from_tensor_slices(records)
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


def _resolve_tfds(data_config, split: str) -> SplitSource:
    builder = _tfds_builder(data_config)
    split_infos = builder.info.splits
    if split_infos:
        try:
            (absolute,) = tfds.core.ReadInstruction.from_spec(split).to_absolute(split_infos)
        except ValueError as e:  # a "+" of splits gives several instructions
            raise ValueError(f"Split {split!r}: use a single (optionally sliced) split.") from e
        except KeyError as e:
            raise ValueError(
                f"Split {split!r} not found in {builder.name}; "
                f"available: {sorted(split_infos.keys())}."
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
        paths, labels, _ = list_image_folder(os.fspath(data_config.data_dir), split)
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


def decode_image(image: tf.Tensor, is_path: bool) -> tf.Tensor:
    """Encoded bytes (or a file path) -> float32 RGB in [0, 1]; grey and RGBA become RGB."""
    data = tf.io.read_file(image) if is_path else image
    decoded = tf.io.decode_image(data, channels=3, expand_animations=False)
    decoded = tf.ensure_shape(decoded, [None, None, 3])
    return tf.image.convert_image_dtype(decoded, tf.float32)
