"""The epoch and step loop of linear_eval (jssl.engines.linear_eval), driven by hooks.

The loop goes through epochs and their batches, starting at a resume position
(``checkpoint.DataPosition``). It runs the engine's step on each batch and does the periodic
work through clu periodic actions. The progress report (steps/s, ETA) and the mean metrics
of each window run every ``log_every_steps``. A checkpoint is saved every
``checkpoint_every_steps`` and at the end of every epoch. The test phase runs every
``test_every_epochs``. The engine supplies what each of these does (``Hooks``); the loop
decides when they happen.

With ``agreed_stop`` the loop also reads the stop flag that the step agreed on across
processes (``metrics["stop"]``, see jssl.training.preemption). It then stops after a step that
every process stops after, and saves that step's checkpoint first.

The train engine writes the same schedule out as one flat loop (jssl.engines.train); the plan,
the data positions and the metric windows of both are jssl.training.progress's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from clu import metric_writers, periodic_actions

from jssl.checkpoints import manager as checkpoint
from jssl.training.progress import Metrics, Plan, Progress, Window, position_after

State = Any
# linear_eval and the tests name these through this module.
__all__ = ["Hooks", "Loop", "Metrics", "Plan", "Progress", "Window", "position_after"]


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
        self._test = periodic_actions.PeriodicCallback(
            on_steps=plan.test_epochs if hooks.test is not None else (),
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
