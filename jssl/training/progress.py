"""Where a training run is and how long it lasts: the plan of a run (epochs, steps, how often
periodic work happens), the data position after a step and the window of metrics between two
writes. Shared by the flat loops of the train engine (jssl.engines.train) and of
linear_eval (jssl.engines.linear_eval)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import ml_collections

from jssl import data
from jssl.checkpoints.manager import DataPosition
from jssl.training import summaries

Metrics = dict[str, Any]


def position_after(epoch: int, step_in_epoch: int, steps_per_epoch: int) -> DataPosition:
    """The position of the batch that follows batch ``step_in_epoch`` of ``epoch``."""
    if step_in_epoch + 1 >= steps_per_epoch:
        return DataPosition(epoch + 1, 0)
    return DataPosition(epoch, step_in_epoch + 1)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How long a run is and how often each piece of periodic work happens."""

    steps_per_epoch: int
    num_epochs: int
    max_steps: int  # debug.max_steps, or the total when that is not set
    log_every_steps: int
    checkpoint_every_steps: int = 0  # 0: only at the end of an epoch (and on a stop request)
    test_every_epochs: int = 0  # 0: no test phase in the loop

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, steps_per_epoch: int) -> Plan:
        total = steps_per_epoch * config.num_epochs
        return cls(
            steps_per_epoch=steps_per_epoch,
            num_epochs=config.num_epochs,
            max_steps=config.debug.max_steps if config.debug.max_steps > 0 else total,
            log_every_steps=config.log_every_steps,
            checkpoint_every_steps=config.checkpoint.every_steps,
            test_every_epochs=config.test_every_epochs,
        )

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.num_epochs

    @property
    def test_epochs(self) -> range:
        """The numbers of completed epochs after which a test phase runs."""
        every = self.test_every_epochs
        return range(every, self.num_epochs + 1, every) if every > 0 else range(0)


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where a loop is after a step."""

    step: int  # the steps trained so far, including those before a resume
    epoch: int  # the epoch of the batch just trained
    epochs: float  # the epochs trained so far, as a fraction
    next: DataPosition  # the batch after this one, where a resume would start

    @classmethod
    def after(cls, step: int, epoch: int, index: int, plan: Plan) -> Progress:
        """The progress once batch ``index`` of ``epoch`` is trained, ``step`` steps in all."""
        return cls(
            step=step,
            epoch=epoch,
            epochs=epoch + (index + 1) / plan.steps_per_epoch,
            next=position_after(epoch, index, plan.steps_per_epoch),
        )


@dataclasses.dataclass
class Window:
    """The steps since the metrics were last written: their metrics and wall-clock time."""

    metrics: list[Metrics] = dataclasses.field(default_factory=list)
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def __len__(self) -> int:
        return len(self.metrics)

    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def mean(self) -> dict[str, float]:
        """The mean of each metric over the window, without the loop's own stop flag."""
        scalars = summaries.mean_metrics(self.metrics)
        scalars.pop("stop", None)
        return scalars


def steps_per_epoch(config: ml_collections.ConfigDict) -> int:
    """Global batches per epoch of ``config.data``'s train split (the plan's and the
    method's schedules count in them); a split smaller than one batch is refused."""
    steps = data.steps_per_epoch(config.data, jax.process_count())
    if steps < 1:
        raise ValueError(
            f"The train split has {data.num_examples(config.data, config.data.train_split)} "
            f"examples, fewer than one global batch (data.batch_size={config.data.batch_size}); "
            "lower --config.data.batch_size or use more data (data.train_subset)."
        )
    return steps
