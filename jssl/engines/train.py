"""The train engine: VISSL's trainer as one loop over a functional state.

``run`` reads top to bottom: set-up (splits, method, optimizer, the state to start from: the
workdir's checkpoint, then ``init.checkpoint``, then scratch; writer, steps, kNN baseline), one
loop over the steps with clu periodic actions (logs, checkpoints, each epoch's test phase and
evaluators), then the final kNN and the summary. The batches reach the devices ahead of their
step from a thread (jssl.training.prefetch); each log step writes how long the loop waited
for them (``perf/data_wait_fraction``). SIGTERM or a first Ctrl-C saves and stops
(jssl.training.preemption); no non-finite state is saved (jssl.training.finite); an error in
periodic work lets a save in flight complete first (``checkpoint.closing``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from clu import parameter_overview, periodic_actions
from jax.experimental import multihost_utils

from jssl import data, engines, methods, optim, parallel
from jssl.checkpoints import manager as checkpoint
from jssl.checkpoints import warm_start
from jssl.data import device_augment
from jssl.engines import evaluate
from jssl.engines import knn as knn_engine
from jssl.evaluation import monitor
from jssl.training import (
    accumulation,
    batch_norm,
    collapse,
    finite,
    preemption,
    prefetch,
    probe,
    summaries,
)
from jssl.training import batches as batches_lib
from jssl.training import state as train_state
from jssl.training.fresh import abstract_state as abstract_state  # re-exported for callers
from jssl.training.fresh import init_state
from jssl.training.progress import Plan, Progress, Window
from jssl.training.progress import steps_per_epoch as split_steps_per_epoch
from jssl.training.step import make_forward, make_train_step, stop_flags

# Raised when the loss, the gradients or the state become non-finite (named here by the tests).
NonFiniteLossError = finite.NonFiniteLossError


def validate(config: ml_collections.ConfigDict) -> None:
    """Start-up checks of the config: each failure names the field and how to fix it."""
    engines.check_positive(
        config, "log_every_steps", "num_epochs", "data.batch_size", "data.image_size"
    )
    if config.knn.enabled:
        knn_engine.check_config(config, monitor=True)
    if config.probe.num_classes < 0:
        raise ValueError(
            f"probe.num_classes={config.probe.num_classes} must be >= 0 (0 turns the probe off)."
        )
    parallel.check_batch_divisible(config.data.batch_size)
    accumulation.check_config(config)
    batch_norm.check_config(config)
    checkpoint.check_config(config.checkpoint)
    collapse.check_config(config)
    data.crop_groups(config.data)
    methods.check_config(config)
    if config.get("evals"):
        evaluate.validate_in_training(config)


def make_optimizer(config: ml_collections.ConfigDict, method: methods.Method, steps_per_epoch: int):
    """The optax transformation and its learning-rate schedule for this run."""
    schedule = optim.build_schedule(
        config.optim,
        steps_per_epoch=steps_per_epoch,
        num_epochs=config.num_epochs,
        global_batch=config.data.batch_size,
    )
    size = config.data.image_size
    # Only the parameter tree's structure is needed (for the weight-decay mask).
    params_shape = jax.eval_shape(
        method.init, jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3))
    )["params"]
    tx = optim.build_grouped_optimizer(
        config.optim,
        params_shape,
        schedule,
        config.data.batch_size,
        steps_per_epoch=steps_per_epoch,
        num_epochs=config.num_epochs,
    )
    return optim.freeze_for_steps(tx, params_shape, method.frozen_params), schedule


def make_step(
    config: ml_collections.ConfigDict, method, tx, schedule, mesh, state, statistics_at=None
):
    """The compiled train step of ``config`` over ``mesh`` as this engine runs it: the online
    probe, the on-device augmentation, accumulation and ``state``'s layout over the devices
    (and the collapse statistics at ``statistics_at``, the loop's log steps)."""
    return make_train_step(
        method,
        tx,
        schedule,
        mesh,
        probe_config=config if probe.enabled(config) else None,
        augment=device_augment.make_batch_augment(config.data),
        accumulation_steps=config.optim.accumulation_steps,
        state_specs=train_state.specs_of(state),
        statistics_at=statistics_at,
    )


def run(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    batches: Iterable[dict] | Callable[[int], Iterable[dict]] | None = None,
    steps_per_epoch: int | None = None,
) -> dict[str, Any]:
    """Trains ``config.method`` and returns the final summary: ``step``, ``loss`` (the last
    step's; None when no step ran), ``state``, with the kNN monitor on the kNN accuracies
    (``knn``, ``knn_random_init``, ``knn_comparison``), and ``preempted`` when SIGTERM or a
    first Ctrl-C stopped it after saving (launch.py exits with ``PREEMPTED_EXIT_CODE``).

    ``batches``: the caller's host batches in place of jssl's pipeline (``jssl.train``), an
    iterable or ``epoch -> iterable``; ``steps_per_epoch`` (default ``len(batches)``) an epoch.
    """
    if batches is not None:
        steps_per_epoch = batches_lib.user_steps_per_epoch(batches, steps_per_epoch)
    validate(config)
    probe.check_num_classes(config)
    check_splits(config)
    if config.debug.nans:
        jax.config.update("jax_debug_nans", True)
    # A stop request from here on (while restoring, compiling, measuring the kNN baseline) is
    # acted on at the first step instead of killing the process before anything is saved.
    with preemption.Preemption() as stop_request, contextlib.ExitStack() as cleanup:
        mesh = parallel.make_mesh()
        plan = Plan.from_config(config, steps_per_epoch or split_steps_per_epoch(config))
        if batches is None:
            logging.info("Training order: %s.", data.train_order(config.data))
        method = methods.get(config, plan.steps_per_epoch)
        tx, schedule = make_optimizer(config, method, plan.steps_per_epoch)
        manager, state, position, resumed = _start_state(config, workdir, method, tx, mesh)
        # An error from here on waits for the save in flight before it ends the run.
        cleanup.enter_context(checkpoint.closing(manager))
        writer = summaries.create_writer(
            os.path.join(workdir, "tensorboard"), just_logging=jax.process_index() > 0
        )
        at_log_steps = collapse.log_steps(plan.log_every_steps, plan.max_steps)
        train_step = make_step(config, method, tx, schedule, mesh, state, at_log_steps)
        eval_step = monitor.make_test_step(config, method, mesh)
        forward = make_forward(method, mesh)
        pictures = summaries.MethodPictures.of(config)  # the method's own, if it makes any
        summary: dict[str, Any] = {}
        if not resumed:
            overview = parameter_overview.get_parameter_overview(state.params)
            logging.info("Parameters of the online network:\n%s", overview)
            writer.write_texts(0, {"parameters": f"```\n{overview}\n```"})
        if config.knn.enabled:
            baseline = monitor.knn_baseline(
                config, forward, state, mesh, workdir=workdir, writer=writer, resumed=resumed
            )
            if baseline is not None:
                summary["knn_random_init"] = baseline

        # The periodic work; each action is called with the steps done after every step
        # (the test phase: with the epochs done, at the end of each epoch).
        report_progress = periodic_actions.ReportProgress(
            num_train_steps=plan.total_steps, writer=writer, every_steps=plan.log_every_steps
        )
        profile = None
        if config.debug.profile:
            profile = periodic_actions.Profile(logdir=workdir, num_profile_steps=5)
        checks = finite.Guard(manager, workdir, plan.steps_per_epoch)
        write_metrics = periodic_actions.PeriodicCallback(
            every_steps=plan.log_every_steps,
            on_steps=[plan.max_steps],
            callback_fn=functools.partial(
                _write_metrics,
                config,
                writer,
                manager,
                checks,
                collapse.Alarm.of(config),
                prefetch.DataWaitAlarm(),
                workdir,
            ),
            pass_step_and_time=False,
        )
        save_in_epoch = periodic_actions.PeriodicCallback(
            every_steps=plan.checkpoint_every_steps or None,
            callback_fn=functools.partial(_save_in_epoch, manager, checks),
            pass_step_and_time=False,
        )
        test_phase = periodic_actions.PeriodicCallback(
            on_steps=plan.test_epochs,
            callback_fn=functools.partial(
                _test_phase, config, eval_step, forward, mesh, workdir, writer
            ),
            pass_step_and_time=False,
        )

        first_step = step = int(jax.device_get(state.step))
        window, metrics, stopped = Window(), None, False
        replaced = 0  # rows of this epoch standing in for unreadable examples
        tested = (-1, {})  # (step, results) of the last test phase
        device_batches = cleanup.enter_context(
            _prefetch(config, batches, position, plan, mesh, first_step)
        )
        waited_before = 0.0  # the seconds waited for data before this window
        # ``step``: steps done once this batch is trained; the run ends at max_steps or the data.
        for step, (epoch, index, host_batch, batch) in zip(
            range(first_step + 1, plan.max_steps + 1), device_batches, strict=False
        ):
            if "replaced" in host_batch:  # data.skip_corrupt
                replaced += int(np.sum(host_batch.pop("replaced")))
            if step == 1:
                summaries.write_views(writer, host_batch["crops"], config.data.augment)
            if pictures is not None:
                pictures.keep(host_batch)
            previous = metrics  # the metrics of the step before, whose stop flag is read
            state, metrics = train_step(state, batch, stop_flags(mesh, stop_request.requested))
            checks.keep(step, epoch, index, host_batch)
            if previous is not None and not np.isfinite(float(previous["loss"])):
                checks(state, step)  # one step late: that step's batch is still kept
            window.metrics.append(metrics)
            progress = Progress.after(step, epoch, index, plan)

            report_progress(step)
            if profile is not None:
                profile(step)
            waited = device_batches.waited - waited_before
            if write_metrics(step, state=state, progress=progress, window=window, waited=waited):
                window, waited_before = Window(), device_batches.waited
            save_in_epoch(step, state=state, progress=progress)
            # Every process reads the same agreed flag of the same step, so all of them stop
            # after the same step; reading the step before keeps one in flight. The last
            # step of an epoch (or of the run) reads its own flag too.
            stopped = _stop_agreed(previous)
            epoch_done = progress.next.epoch == epoch + 1
            if not (epoch_done or stopped or step >= plan.max_steps):
                continue
            stopped = stopped or _stop_agreed(metrics)

            # The end of an epoch, or of the run in the middle of one.
            _report_replaced(config, writer, epoch, step, replaced)
            checks(state, step)
            checkpoint.save(manager, state, progress.next, force=True)
            # The test phase follows every completed epoch, the last one included
            # (max_steps defaults to the total, so reaching it is not in itself an early
            # stop); a stopped run leaves as fast as it can.
            tested_now = epoch_done and not stopped
            tested_now = tested_now and test_phase(epoch + 1, state=state, progress=progress)
            if tested_now:
                tested = (step, test_phase.get_last_callback_result())
            if pictures is not None and (tested_now or step >= plan.max_steps):
                pictures.write(writer, state, step)
            if config.get("evals") and not stopped:
                checkpoint.finish(manager)  # the evaluators read the checkpoint just saved
                last = step >= plan.max_steps
                evaluate.after_epoch(config, workdir, step, epoch + 1, last, writer)
            if stopped or step >= plan.max_steps:
                break
            window, replaced, waited_before = Window(), 0, device_batches.waited

        checkpoint.finish(manager)
        checks(state, step)
        summary["step"] = step
        summary["loss"] = None if metrics is None else float(metrics["loss"])
        if not stopped and step >= plan.max_steps:
            evaluate.mark_finished(workdir, step)
        if stopped:
            logging.warning(
                "Stopped by %s at step %d after saving a checkpoint; rerun the same "
                "command to resume (exit status %d).",
                stop_request.signal_name or "SIGTERM",
                step,
                preemption.PREEMPTED_EXIT_CODE,
            )
            summary["preempted"] = True
        elif config.knn.enabled:
            knn_final = monitor.final_knn(config, forward, state, mesh, step=step, last_test=tested)
            writer.write_scalars(step, {f"knn/{k}": v for k, v in knn_final.items()})
            summary["knn"] = knn_final
            if "knn_random_init" in summary:
                summary["knn_comparison"] = monitor.knn_comparison(
                    config, knn_final, summary["knn_random_init"]
                )
        writer.flush()
    summary["state"] = state
    return summary


def check_splits(config: ml_collections.ConfigDict) -> None:
    """Resolves every split besides the train split that the run will read, so that a
    missing one stops the run before the first step, not at the end of an epoch."""
    reads = []  # (field, split, what reads it, the setting that turns that off)
    if config.test_every_epochs > 0:
        reads.append(
            ("data.test_split", config.data.test_split, "the test phases", "test_every_epochs=0")
        )
    if config.knn.enabled:
        for name in ("train_split", "test_split"):
            reads.append((f"knn.{name}", config.knn[name], "the kNN monitor", "knn.enabled=False"))
    for field, split, reader, off in reads:
        try:
            data.num_examples(config.data, split)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(
                f"{field}={split!r} cannot be read, and {reader} read it: {e} Or turn "
                f"{reader} off with --config.{off}."
            ) from e


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


def _start_state(config: ml_collections.ConfigDict, workdir: str, method, tx, mesh):
    """The state to train from, in the resume order: the workdir's own checkpoint, then
    init.checkpoint, then scratch. Returns (manager, state, data position, resumed)."""
    state = init_state(config, method, tx, mesh)
    manager, state, position, resumed = checkpoint.resume(workdir, config.checkpoint, state)
    if resumed:
        logging.info(
            "Resumed from step %d (epoch %d, batch %d).",
            int(state.step),
            position.epoch,
            position.step_in_epoch,
        )
    elif config.init.checkpoint:
        state = warm_start.init_train_state(config, state)
    return manager, state, position, resumed
