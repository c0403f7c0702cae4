"""The train engine's loop: every step from the state's to max_steps, with the periodic work.

``train_steps`` runs the steps of a ``Job`` (the set-up jssl.engines.train makes) with clu
periodic actions after each (logs, in-epoch checkpoints, the profile) and the end of an epoch
after its last step (forced checkpoint, test phase, evaluators). The batches reach the devices
ahead of their step from a thread (jssl.training.prefetch); each log step writes how long the
loop waited for them (``perf/data_wait_fraction``). A stop request (SIGTERM, a first Ctrl-C) is
agreed by every process at the same step, which then saves and leaves.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from clu import periodic_actions
from jax.experimental import multihost_utils

from jssl import parallel
from jssl.checkpoints import manager as checkpoint
from jssl.engines import evaluate
from jssl.evaluation import monitor
from jssl.training import batches as batches_lib
from jssl.training import collapse, finite, prefetch, summaries
from jssl.training.progress import Plan, Progress, Window
from jssl.training.step import stop_flags


@dataclasses.dataclass
class Job:
    """What a training run holds from its set-up to its summary."""

    config: ml_collections.ConfigDict
    workdir: str
    mesh: Any
    plan: Plan
    manager: Any  # the checkpoint manager
    state: Any  # the state the run starts from
    position: Any  # the data position of that state
    resumed: bool
    writer: Any
    train_step: Callable
    eval_step: Callable  # the test phase's
    forward: Callable  # the trunk's, for the kNN monitor
    pictures: Any  # the method's own TensorBoard pictures, or None
    checks: finite.Guard


@dataclasses.dataclass
class End:
    """Where the loop stopped: the state, the steps done, the last step's metrics (None when no
    step ran), whether a stop request ended it, and the last test phase's (step, results)."""

    state: Any
    step: int
    metrics: dict | None
    stopped: bool
    tested: tuple[int, dict]


@dataclasses.dataclass
class _Actions:
    """The periodic work, each called with the steps done after every step (the test phase:
    with the epochs done, at the end of each epoch)."""

    report_progress: Any
    profile: Any
    write_metrics: Any
    save_in_epoch: Any
    test_phase: Any

    @classmethod
    def of(cls, job: Job) -> _Actions:
        config, plan, writer = job.config, job.plan, job.writer
        profile = None
        if config.debug.profile:
            profile = periodic_actions.Profile(logdir=job.workdir, num_profile_steps=5)
        log = functools.partial(
            _write_metrics,
            config,
            writer,
            job.manager,
            job.checks,
            collapse.Alarm.of(config),
            prefetch.DataWaitAlarm(),
            job.workdir,
        )
        test = functools.partial(
            _test_phase, config, job.eval_step, job.forward, job.mesh, job.workdir, writer
        )
        return cls(
            report_progress=periodic_actions.ReportProgress(
                num_train_steps=plan.total_steps, writer=writer, every_steps=plan.log_every_steps
            ),
            profile=profile,
            write_metrics=periodic_actions.PeriodicCallback(
                every_steps=plan.log_every_steps,
                on_steps=[plan.max_steps],
                callback_fn=log,
                pass_step_and_time=False,
            ),
            save_in_epoch=periodic_actions.PeriodicCallback(
                every_steps=plan.checkpoint_every_steps or None,
                callback_fn=functools.partial(_save_in_epoch, job.manager, job.checks),
                pass_step_and_time=False,
            ),
            test_phase=periodic_actions.PeriodicCallback(
                on_steps=plan.test_epochs, callback_fn=test, pass_step_and_time=False
            ),
        )


def train_steps(job: Job, batches, stop_request, cleanup) -> End:
    """Every step from the state's to max_steps or the end of the data; the periodic work after
    each, the end of the epoch (or of the run) after its last. ``batches``: the caller's, or
    None for jssl's pipeline; ``cleanup``: the run's ExitStack (it closes the prefetch)."""
    actions, plan, state = _Actions.of(job), job.plan, job.state
    first_step = step = int(jax.device_get(state.step))
    window, metrics, stopped = Window(), None, False
    replaced = 0  # rows of this epoch standing in for unreadable examples
    tested = (-1, {})  # (step, results) of the last test phase
    device_batches = cleanup.enter_context(
        _prefetch(job.config, batches, job.position, plan, job.mesh, first_step)
    )
    waited_before = 0.0  # the seconds waited for data before this window
    # ``step``: steps done once this batch is trained; the run ends at max_steps or the data.
    for step, (epoch, index, host_batch, batch) in zip(
        range(first_step + 1, plan.max_steps + 1), device_batches, strict=False
    ):
        replaced += _take_host_parts(job, step, host_batch)
        previous = metrics  # the metrics of the step before, whose stop flag is read
        state, metrics = job.train_step(state, batch, stop_flags(job.mesh, stop_request.requested))
        job.checks.keep(step, epoch, index, host_batch)
        if previous is not None and not np.isfinite(float(previous["loss"])):
            job.checks(state, step)  # one step late: that step's batch is still kept
        window.metrics.append(metrics)
        progress = Progress.after(step, epoch, index, plan)

        actions.report_progress(step)
        if actions.profile is not None:
            actions.profile(step)
        waited = device_batches.waited - waited_before
        if actions.write_metrics(
            step, state=state, progress=progress, window=window, waited=waited
        ):
            window, waited_before = Window(), device_batches.waited
        actions.save_in_epoch(step, state=state, progress=progress)
        # Every process reads the same agreed flag of the same step, so all of them stop
        # after the same step; reading the step before keeps one in flight. The last
        # step of an epoch (or of the run) reads its own flag too.
        stopped = _stop_agreed(previous)
        epoch_done = progress.next.epoch == epoch + 1
        if not (epoch_done or stopped or step >= plan.max_steps):
            continue
        stopped = stopped or _stop_agreed(metrics)
        ran = _end_epoch(job, actions, state, progress, epoch, replaced, epoch_done, stopped)
        tested = ran or tested
        if stopped or step >= plan.max_steps:
            break
        window, replaced, waited_before = Window(), 0, device_batches.waited
    return End(state, step, metrics, stopped, tested)


def _take_host_parts(job: Job, step: int, host_batch: dict) -> int:
    """The loop's share of a host batch: its count of replaced rows (taken out of it), the
    first step's views for TensorBoard, the rows the method's pictures keep."""
    replaced = 0
    if "replaced" in host_batch:  # data.skip_corrupt
        replaced = int(np.sum(host_batch.pop("replaced")))
    if step == 1:
        summaries.write_views(job.writer, host_batch["crops"], job.config.data.augment)
    if job.pictures is not None:
        job.pictures.keep(host_batch)
    return replaced


def _end_epoch(job: Job, actions, state, progress, epoch, replaced, epoch_done, stopped):
    """The end of an epoch, or of the run in the middle of one: the skipped examples, a
    forced checkpoint, the test phase after a completed epoch (the last one included:
    max_steps defaults to the total, so reaching it is not in itself an early stop), the
    method's pictures and the evaluators; a stopped run leaves as fast as it can. Returns
    the test phase's (step, results) where it ran, else None."""
    config, step = job.config, progress.step
    _report_replaced(config, job.writer, epoch, step, replaced)
    job.checks(state, step)
    checkpoint.save(job.manager, state, progress.next, force=True)
    tested = None
    if epoch_done and not stopped and actions.test_phase(epoch + 1, state=state, progress=progress):
        tested = (step, actions.test_phase.get_last_callback_result())
    last = step >= job.plan.max_steps
    if job.pictures is not None and (tested is not None or last):
        job.pictures.write(job.writer, state, step)
    if config.get("evals") and not stopped:
        checkpoint.finish(job.manager)  # the evaluators read the checkpoint just saved
        evaluate.after_epoch(config, job.workdir, step, epoch + 1, last, job.writer)
    return tested


def _stop_agreed(metrics: dict | None) -> bool:
    return metrics is not None and bool(int(metrics["stop"]))


def _prefetch(config, batches, position, plan: Plan, mesh, first_step: int):
    """The run's (epoch, index, host batch, device batch) from ``position`` on, each put on the
    devices ahead of its step in a thread (jssl.training.prefetch); none past max_steps."""
    if batches is None:
        host_batches = batches_lib.pipeline_batches(config, position, plan)
    else:
        host_batches = batches_lib.user_batches(batches, position, plan)
    host_batches = itertools.islice(host_batches, max(plan.max_steps - first_step, 0))
    return prefetch.DevicePrefetch(host_batches, functools.partial(_to_devices, mesh))


def _to_devices(mesh, host_batch: dict):
    """The host batch as the step's global batch, without the loop's own ``replaced`` counts."""
    kept = {k: v for k, v in host_batch.items() if k != "replaced"}
    return parallel.host_batch_to_global(kept, mesh)


def _write_metrics(
    config,
    writer,
    manager,
    checks,
    alarm,
    data_wait_alarm,
    workdir,
    *,
    state,
    progress: Progress,
    window: Window,
    waited: float,
):
    """The log step's scalars; ``waited``: the window's seconds spent waiting for batches."""
    checks(state, progress.step)
    checkpoint.check_for_errors(manager)
    elapsed = window.seconds()
    # The step's collapse statistics are those of this (log) step, not a mean over the window.
    scalars = alarm.scalars(window.mean(), window.metrics[-1])
    images = len(window) * config.data.batch_size
    scalars["images_per_sec"] = images / max(elapsed, 1e-9)
    scalars.update(prefetch.interval_scalars(images=images, wall=elapsed, waited=waited))
    scalars["epoch"] = progress.epochs
    writer.write_scalars(progress.step, scalars)
    data_wait_alarm.check(progress.step, scalars["perf/data_wait_fraction"])
    finding = alarm.check(progress.step, scalars, writer)
    if finding is not None:  # monitor.on_collapse=stop
        _stop_on_collapse(alarm, finding, manager, workdir, state=state, progress=progress)


def _stop_on_collapse(alarm, finding, manager, workdir: str, *, state, progress: Progress):
    """Saves this step (the state was just checked finite) and raises the alarm's
    CollapseError, naming the checkpoint from before the statistic first crossed its bound."""
    checkpoint.finish(manager)  # a save in flight counts among the earlier ones
    before = [s for s in checkpoint.saved_steps(workdir) if s < finding.first_step]
    checkpoint.save(manager, state, progress.next, force=True)
    checkpoint.finish(manager)
    directory = checkpoint.checkpoint_dir(workdir)
    earlier = os.path.join(directory, str(before[-1])) if before else ""
    raise collapse.CollapseError(alarm.stop_message(finding, directory, earlier))


def _save_in_epoch(manager, checks, *, state, progress: Progress) -> None:
    if progress.next.step_in_epoch != 0:  # the end of the epoch saves anyway (forced)
        checks(state, progress.step)
        checkpoint.save(manager, state, progress.next)


def _test_phase(config, eval_step, forward, mesh, workdir, writer, *, state, progress: Progress):
    """The test phase after epoch ``progress.epoch``; writes and returns its results."""
    results = monitor.test_phase(
        config,
        eval_step,
        forward,
        state,
        mesh,
        workdir=workdir,
        epoch=progress.epoch + 1,
        writer=writer,
        step=progress.step,
    )
    writer.write_scalars(progress.step, {f"test/{k}": v for k, v in results.items()})
    return results


def _report_replaced(config, writer, epoch: int, step: int, replaced: int) -> None:
    """Logs and writes how many unreadable examples an epoch skipped (data.skip_corrupt)."""
    if not config.data.skip_corrupt:
        return
    if jax.process_count() > 1:
        replaced = int(np.sum(multihost_utils.process_allgather(np.int64(replaced))))
    if replaced:
        logging.warning(
            "Epoch %d: %d unreadable training examples were skipped (each replaced by the "
            "next readable one; data.skip_corrupt=True).",
            epoch,
            replaced,
        )
    writer.write_scalars(step, {"data/skipped_examples": replaced})
