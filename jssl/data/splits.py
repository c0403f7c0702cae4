"""The sizes every pipeline shares: a training epoch's batches on this process, the examples
of a split, the steps of an epoch, and which training order a source gives."""

from __future__ import annotations

from typing import NamedTuple

from jssl.data import order, sources


class TrainEpoch(NamedTuple):
    """What both pipelines' build_train_dataset start from."""

    local_batch: int  # this process's rows of each global batch
    source: sources.SplitSource  # the train split, after data.train_subset
    steps: int  # global batches in the epoch (the remainder is dropped)
    start_step: int  # the first batch to make, at most ``steps``


def train_epoch(data_config, *, start_step: int, process_count: int) -> TrainEpoch:
    """The sizes of one training epoch on this process; raises where the train split holds
    less than one global batch."""
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
    limit = data_config.train_subset if split == data_config.train_split else -1
    return sources.resolve_split(data_config, split, limit).num_examples


def steps_per_epoch(data_config, process_count: int = 1) -> int:
    """Batches per training epoch, the same on every process (the global batch count)."""
    order.local_batch(data_config.batch_size, process_count)
    return num_examples(data_config, data_config.train_split) // data_config.batch_size


def train_order(data_config) -> str:
    """A line for the log: which training order this source gives (see jssl.data.order)."""
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
