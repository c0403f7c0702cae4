"""Which input pipeline serves a data config, and the sizes every pipeline shares.

Every source is read with tf.data (jssl.data.pipeline) where TensorFlow is installed. The
built-in demo data also has a numpy pipeline (jssl.data.numpy_pipeline) that needs no
TensorFlow, so that jssl trains out of the box on a host with only JAX: ``data.loader="auto"``
(the default) picks it for ``data.source="demo"`` where tensorflow or tensorflow_datasets is not
installed, ``"numpy"`` always, ``"tf"`` never.

The numpy pipeline crops and flips on the host and leaves the rest of each view (colour, blur,
solarisation) to the train step (jssl.data.device_augment) whatever data.augment.on_device
says; where the views need nothing more (the linear heads' images) it finishes them itself.
``views_on_device`` tells the step and the pipelines which half makes what.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import TYPE_CHECKING, NamedTuple

from absl import logging

from jssl.data import crops, order

if TYPE_CHECKING:  # jssl.data.sources imports this module
    from jssl.data.sources import SplitSource

LOADERS = ("auto", "tf", "numpy")
_TF_PACKAGES = ("tensorflow", "tensorflow_datasets")


@functools.cache
def tensorflow_available() -> bool:
    """Whether tensorflow and tensorflow_datasets are installed, found without importing them
    (deciding costs nothing; a broken install then fails loudly where tf.data is built)."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in _TF_PACKAGES)
    except (ImportError, ValueError):  # a finder refusing them; a None entry in sys.modules
        return False


def _wanted(data_config) -> str:
    wanted = data_config.get("loader", "auto")
    if wanted not in LOADERS:
        raise ValueError(f"data.loader={wanted!r}: use one of {LOADERS}.")
    if wanted == "numpy" and data_config.source != "demo":
        raise ValueError(
            f'data.loader="numpy" reads only the built-in demo data, not data.source='
            f'{data_config.source!r}: set data.loader="auto" (tf.data) for that source.'
        )
    return wanted


@functools.cache
def _announce() -> None:
    logging.info(
        "jssl.data: TensorFlow is not installed, so the demo data is read by the numpy pipeline "
        "(crop and flip on the host, colour, blur and solarisation in the train step)."
    )


def resolve(data_config) -> str:
    """The pipeline that reads ``data_config``: "tf" or "numpy"."""
    wanted = _wanted(data_config)
    if wanted == "numpy":
        return "numpy"
    if wanted == "auto" and data_config.source == "demo" and not tensorflow_available():
        _announce()
        return "numpy"
    return "tf"


def require_tensorflow(data_config) -> None:
    """Raises an ImportError saying what to do when ``data_config`` needs tf.data but
    TensorFlow or TFDS cannot be imported."""
    if tensorflow_available():
        return
    if data_config.source == "demo":
        fix = 'or set data.loader="numpy" (or "auto") to read the demo data without them.'
    else:
        fix = "or train on the built-in demo data (data.source='demo'), which needs neither."
    raise ImportError(
        f"data.source={data_config.source!r} with data.loader="
        f"{data_config.get('loader', 'auto')!r} is read with tf.data, and tensorflow or "
        f"tensorflow_datasets is not installed: pip install tensorflow-cpu tensorflow-datasets, "
        + fix
    )


def views_on_device(data_config) -> bool:
    """Whether the train step makes the photometric half of the views (colour, grey, blur,
    solarise) from the host's uint8 crops and seeds: with data.augment.on_device, and with the
    numpy pipeline whenever a crop group needs more than crop and flip. Never raises for a
    source that needs TensorFlow: the step of a benchmark on synthetic batches builds without."""
    if data_config.augment.get("on_device", False):
        return True
    wanted = data_config.get("loader", "auto")
    if data_config.source != "demo" or wanted == "tf":
        return False
    if resolve(data_config) != "numpy":
        return False
    return any(crops.photometric(group) for group in crops.crop_groups(data_config))


def _pipeline(data_config):
    if resolve(data_config) == "numpy":
        from jssl.data import numpy_pipeline

        return numpy_pipeline
    require_tensorflow(data_config)
    from jssl.data import pipeline

    return pipeline


def build_train_dataset(
    data_config,
    *,
    seed: int,
    epoch: int,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
):
    """This process's batches of one training epoch: {"crops", "label", "index", "replaced"}
    (and "aug_seeds" where the step makes the views); see jssl.data.pipeline's twin for the
    layout. A tf.data.Dataset, or the numpy pipeline's Batches; both have as_numpy_iterator()."""
    return _pipeline(data_config).build_train_dataset(
        data_config,
        seed=seed,
        epoch=epoch,
        start_step=start_step,
        process_index=process_index,
        process_count=process_count,
    )


def build_eval_dataset(
    data_config,
    split: str,
    *,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
):
    """This process's batches over the whole ``split``: {"image", "label", "index", "mask"},
    padded to static shapes (jssl.data.pipeline.build_eval_dataset)."""
    return _pipeline(data_config).build_eval_dataset(
        data_config,
        split,
        batch_size=batch_size,
        process_index=process_index,
        process_count=process_count,
    )


class TrainEpoch(NamedTuple):
    """What both pipelines' build_train_dataset start from."""

    local_batch: int  # this process's rows of each global batch
    source: SplitSource  # the train split, after data.train_subset
    steps: int  # global batches in the epoch (the remainder is dropped)
    start_step: int  # the first batch to make, at most ``steps``


def train_epoch(data_config, *, start_step: int, process_count: int) -> TrainEpoch:
    """The sizes of one training epoch on this process; raises where the train split holds
    less than one global batch."""
    from jssl.data import sources

    local_batch = order.local_batch(data_config.batch_size, process_count)
    source = sources.resolve_split(data_config, data_config.train_split, data_config.train_subset)
    steps = source.num_examples // data_config.batch_size
    if steps == 0:
        raise ValueError(
            f"The train split has {source.num_examples} examples, fewer than one global batch of "
            f"{data_config.batch_size}: lower data.batch_size or data.train_subset."
        )
    return TrainEpoch(local_batch, source, steps, min(start_step, steps))


def num_examples(data_config, split: str) -> int:
    """Examples in `split`, after data.train_subset when `split` is the train split."""
    from jssl.data import sources

    limit = data_config.train_subset if split == data_config.train_split else -1
    return sources.resolve_split(data_config, split, limit).num_examples


def steps_per_epoch(data_config, process_count: int = 1) -> int:
    """Batches per training epoch, the same on every process (the global batch count)."""
    order.local_batch(data_config.batch_size, process_count)
    return num_examples(data_config, data_config.train_split) // data_config.batch_size


def train_order(data_config) -> str:
    """A line for the log: which training order this source gives (see jssl.data.order)."""
    from jssl.data import sources

    source = sources.resolve_split(data_config, data_config.train_split, data_config.train_subset)
    if source.random_access or (data_config.cache and source.kind == "tfds"):
        return (
            "exact: each epoch is a seeded permutation of the whole train split, and global batch "
            "t holds the same examples on any number of processes"
        )
    return (
        "seeded blocks: TFDS TFRecord files are read sequentially, so global batch t depends on "
        "the process count; prepare the dataset with `tfds build --file_format=array_record` or "
        "set data.cache=True for the exact order"
    )
