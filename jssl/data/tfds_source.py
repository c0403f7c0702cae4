"""TFDS splits, the built-in demo set's included: the builder, and a split spec resolved to a
`SplitSource`.

A split is a TFDS split spec: a name, a slice of one ('train[:1000]', 'train[10%:20%]') or a sum
of them ('train+validation', VOC07's trainval in VISSL), resolved with TFDS's own
ReadInstruction. Indices are positions in the stored split order (shuffle_files=False), so they
are stable across runs. data.source="demo" reads the "jssl_demo" builder (jssl.data.demo_tfds),
prepared on first use. TensorFlow and TFDS are imported inside the functions, so importing this
module needs neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from absl import logging

from jssl.data import backend
from jssl.data.split_source import SplitSource, unknown_split_error

if TYPE_CHECKING:
    import tensorflow_datasets as tfds

DEMO_NAME = "jssl_demo"


def _tfds_builder(data_config) -> tfds.core.DatasetBuilder:
    if backend.resolve(data_config) == "grain":  # reads ArrayRecord files without TensorFlow
        backend.require_tfds(data_config)
    else:
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


def resolve_tfds(data_config, split: str) -> SplitSource:
    """``split`` of data.source "tfds", or of "demo" read by the tf.data pipeline."""
    import tensorflow_datasets as tfds
    from tensorflow_datasets.core import file_adapters

    builder = _tfds_builder(data_config)
    split_infos = builder.info.splits
    if split_infos and "+" in split:
        return _resolve_tfds_sum(data_config, builder, split)
    if split_infos:
        name = split.split("[", 1)[0].strip()
        if name not in split_infos:
            raise unknown_split_error(data_config, split, split_infos.keys())
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
            raise unknown_split_error(data_config, split, split_infos.keys())
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
