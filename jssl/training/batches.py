"""The host batches of a training run as (epoch, index in the epoch, batch), from the
position a run starts or resumes at: jssl's pipeline, or the caller's own batches
(``jssl.train(..., batches=...)``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

import jax
import numpy as np

from jssl import data
from jssl.training.progress import Plan


def positioned(
    epoch_batches: Callable[[int, int], Iterable[dict]], position, plan: Plan
) -> Iterator[tuple[int, int, dict]]:
    """(epoch, index in the epoch, host batch) from ``position`` to the end of the last epoch,
    where ``epoch_batches(epoch, start)`` gives the batches of ``epoch`` from index ``start``;
    each epoch's are asked for when its first batch is."""
    for epoch in range(position.epoch, plan.num_epochs):
        start = position.step_in_epoch if epoch == position.epoch else 0
        for index, host_batch in enumerate(epoch_batches(epoch, start), start):
            yield epoch, index, host_batch


def pipeline_batches(config, position, plan: Plan) -> Iterator[tuple[int, int, dict]]:
    """``positioned`` batches of jssl's deterministic training pipeline; grain's come from one
    iterator for the whole run, so that its worker processes start once."""
    if data.backend.resolve(config.data) == "grain":
        from jssl.data import grain_pipeline

        return grain_pipeline.run_batches(
            config.data,
            seed=config.seed,
            first_epoch=position.epoch,
            start_step=position.step_in_epoch,
            num_epochs=plan.num_epochs,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )

    def epoch_batches(epoch: int, start: int) -> Iterable[dict]:
        dataset = data.build_train_dataset(
            config.data,
            seed=config.seed,
            epoch=epoch,
            start_step=start,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        return dataset.as_numpy_iterator()

    return positioned(epoch_batches, position, plan)


def user_steps_per_epoch(batches, steps_per_epoch: int | None) -> int:
    if steps_per_epoch is None:
        if callable(batches) or not hasattr(batches, "__len__"):
            raise ValueError(
                "batches= has no len(): pass steps_per_epoch=<batches in one epoch> as well."
            )
        steps_per_epoch = len(batches)
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch={steps_per_epoch} must be at least 1.")
    return steps_per_epoch


def user_batches(batches, position, plan: Plan) -> Iterator[tuple[int, int, dict]]:
    """The caller's batches as (epoch, index in the epoch, host batch); a resumed epoch skips
    the batches its checkpoint had trained on, so a loader that repeats each epoch's batches
    resumes where it stopped."""
    for epoch in range(position.epoch, plan.num_epochs):
        source = batches(epoch) if callable(batches) else batches
        start = position.step_in_epoch if epoch == position.epoch else 0
        index = start - 1
        window = itertools.islice(source, start, plan.steps_per_epoch)
        for index, host_batch in enumerate(window, start):
            yield epoch, index, {k: np.asarray(v) for k, v in dict(host_batch).items()}
        if index + 1 < plan.steps_per_epoch:
            raise ValueError(
                f"batches= gave {index + 1} batches in epoch {epoch}, fewer than "
                f"steps_per_epoch={plan.steps_per_epoch}."
            )
