"""The epoch and step loop that the training engines share (train, linear_eval).

The loop goes through epochs and their batches, starting at a resume position
(``checkpoint.DataPosition``). It runs the engine's step on each batch and does the periodic
work through clu periodic actions. The progress report (steps/s, ETA) and the mean metrics
of each window run every ``log_every_steps``. A checkpoint is saved every
``checkpoint_every_steps`` and at the end of every epoch. The test phase runs every
``test_every_epochs``. The engine supplies what each of these does (``Hooks``); the loop
decides when they happen.

With ``agreed_stop`` the loop also reads the SIGTERM flag that the step agreed on across
processes (``metrics["stop"]``, see jssl.engines.preemption). It then stops after a step that
every process stops after, and saves that step's checkpoint first.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import ml_collections
from clu import metric_writers, periodic_actions

from jssl import checkpoint, summaries

State = Any
Metrics = dict[str, Any]


def position_after(epoch: int, step_in_epoch: int, steps_per_epoch: int) -> checkpoint.DataPosition:
    """The position of the batch that follows batch ``step_in_epoch`` of ``epoch``."""
    if step_in_epoch + 1 >= steps_per_epoch:
        return checkpoint.DataPosition(epoch + 1, 0)
    return checkpoint.DataPosition(epoch, step_in_epoch + 1)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How long a run is and how often each piece of periodic work happens."""

    steps_per_epoch: int
    num_epochs: int
    max_steps: int  # debug.max_steps, or the total when that is not set
    log_every_steps: int
    checkpoint_every_steps: int = 0  # 0: only at the end of an epoch (and on SIGTERM)
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


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where the loop is after a step."""

    step: int  # the steps trained so far, including those before a resume
    epoch: int  # the epoch of the batch just trained
    epochs: float  # the epochs trained so far, as a fraction
    next: checkpoint.DataPosition  # the batch after this one, where a resume would start


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


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What the engine does at each point of the loop."""

    # (epoch, index of the first batch) -> the host batches from there to the end of the epoch
    batches: Callable[[int, int], Iterable[dict]]
    # (state, host batch, steps trained before it) -> (state, metrics)
    step: Callable[[State, dict, int], tuple[State, Metrics]]
    # (state, progress, window): writes the window's metrics; the loop then starts a new window
    write_metrics: Callable[[State, Progress, Window], None]
    # (state, position of the next batch, force)
    save: Callable[[State, checkpoint.DataPosition, bool], None]
    # (state, step, epochs completed): the test phase
    test: Callable[[State, int, int], None] | None = None
    # (epoch, step): runs after the last step of an epoch and before its checkpoint
    end_of_epoch: Callable[[int, int], None] | None = None
    # More clu actions to call with the step after every step, e.g. periodic_actions.Profile
    actions: Sequence[periodic_actions.PeriodicAction] = ()


class Loop:
    """Runs the epochs of a run. ``stopped`` says whether it ended on the agreed SIGTERM stop.

    ``write_window_at_epoch_end``: also write the metrics of the steps at the end of an epoch
    that did not fill a window. Without it, those metrics are not written.
    """

    def __init__(
        self,
        plan: Plan,
        hooks: Hooks,
        writer: metric_writers.MetricWriter,
        *,
        agreed_stop: bool = False,
        write_window_at_epoch_end: bool = False,
    ):
        self.plan = plan
        self.hooks = hooks
        self.agreed_stop = agreed_stop
        self.write_window_at_epoch_end = write_window_at_epoch_end
        self.stopped = False
        self.window = Window()
        report = periodic_actions.ReportProgress(
            num_train_steps=plan.total_steps, writer=writer, every_steps=plan.log_every_steps
        )
        self._actions = [report, *hooks.actions]
        self._log = periodic_actions.PeriodicCallback(
            every_steps=plan.log_every_steps,
            on_steps=[plan.max_steps],
            callback_fn=self._write_metrics,
        )
        self._checkpoint = periodic_actions.PeriodicCallback(
            every_steps=plan.checkpoint_every_steps or None, callback_fn=self._save_in_epoch
        )
        # The test phase counts completed epochs, not steps.
        every = plan.test_every_epochs if hooks.test is not None else 0
        self._test = periodic_actions.PeriodicCallback(
            on_steps=range(every, plan.num_epochs + 1, every) if every > 0 else (),
            callback_fn=self._run_test,
        )

    def run(self, state: State, position: checkpoint.DataPosition, step: int) -> tuple[State, int]:
        """Trains from ``position`` (``step`` steps done) to the end; returns (state, step)."""
        plan = self.plan
        for epoch in range(position.epoch, plan.num_epochs):
            if step >= plan.max_steps:  # a rerun of a run that already reached debug.max_steps
                break
            start = position.step_in_epoch if epoch == position.epoch else 0
            state, step, last = self._train_epoch(state, epoch, start, step)
            next_position = position_after(epoch, last, plan.steps_per_epoch)
            self.hooks.save(state, next_position, True)
            # The test phase follows every completed epoch, the last one included
            # (max_steps defaults to the total, so reaching it is not in itself an early
            # stop); a preempted run leaves as fast as it can.
            if next_position.epoch == epoch + 1 and not self.stopped:
                self._test(epoch + 1, state=state, at_step=step)
            if self.stopped or step >= plan.max_steps:
                break
        return state, step

    def _train_epoch(self, state: State, epoch: int, start: int, step: int):
        """Trains from batch ``start`` of ``epoch``; returns (state, step, last batch index)."""
        plan = self.plan
        batches = self.hooks.batches(epoch, start)
        self.window = Window()
        metrics = None
        progress = None
        last = start - 1  # the index of the last batch trained
        for last, host_batch in enumerate(batches, start):
            previous = metrics  # the metrics of the step before, whose stop flag is read
            state, metrics = self.hooks.step(state, host_batch, step)
            step += 1
            self.window.metrics.append(metrics)
            progress = Progress(
                step=step,
                epoch=epoch,
                epochs=epoch + (last + 1) / plan.steps_per_epoch,
                next=position_after(epoch, last, plan.steps_per_epoch),
            )
            for action in self._actions:
                action(step)
            self._log(step, state=state, progress=progress)
            self._checkpoint(step, state=state, progress=progress)
            # Every process reads the same agreed flag of the same step, so all of them stop
            # after the same step (this one); reading the step before keeps one in flight.
            self.stopped = self.stopped or self._stop_agreed(previous)
            if self.stopped or step >= plan.max_steps:
                break
        self.stopped = self.stopped or self._stop_agreed(metrics)
        if self.write_window_at_epoch_end and self.window:
            self._write_metrics(step, None, state=state, progress=progress)
        if self.hooks.end_of_epoch is not None:
            self.hooks.end_of_epoch(epoch, step)
        return state, step, last

    def _stop_agreed(self, metrics: Metrics | None) -> bool:
        return self.agreed_stop and metrics is not None and bool(int(metrics["stop"]))

    def _write_metrics(self, step: int, t: float | None, *, state: State, progress: Progress):
        del step, t  # the progress has the step
        self.hooks.write_metrics(state, progress, self.window)
        self.window = Window()

    def _save_in_epoch(self, step: int, t: float, *, state: State, progress: Progress):
        del step, t
        if progress.next.step_in_epoch != 0:  # the end of the epoch saves anyway (forced)
            self.hooks.save(state, progress.next, False)

    def _run_test(self, step: int, t: float, *, state: State, at_step: int):
        del t  # here ``step`` counts completed epochs
        self.hooks.test(state, at_step, step)
