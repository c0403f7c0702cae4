"""The train engine: VISSL's trainer as one loop over a functional state.

``run`` reads top to bottom: the start-up checks, the set-up (``_start``: method, optimizer,
the state to start from: the workdir's checkpoint, then ``init.checkpoint``, then scratch;
writer, compiled steps), the kNN baseline, the loop over the steps (jssl.engines.train_loop),
then the final kNN and the summary (``_finish``). SIGTERM or a first Ctrl-C saves and stops
(jssl.training.preemption); no non-finite state is saved (jssl.training.finite); an error in
periodic work lets a save in flight complete first (``checkpoint.closing``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from clu import parameter_overview

from jssl import data, engines, methods, optim, parallel
from jssl.checkpoints import manager as checkpoint
from jssl.checkpoints import warm_start
from jssl.data import device_augment
from jssl.engines import evaluate, train_loop
from jssl.engines import knn as knn_engine
from jssl.evaluation import monitor
from jssl.training import (
    accumulation,
    batch_norm,
    collapse,
    finite,
    preemption,
    probe,
    summaries,
)
from jssl.training import batches as batches_lib
from jssl.training import state as train_state
from jssl.training.fresh import abstract_state as abstract_state  # re-exported for callers
from jssl.training.fresh import init_state
from jssl.training.progress import Plan
from jssl.training.progress import steps_per_epoch as split_steps_per_epoch
from jssl.training.step import make_forward, make_train_step

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
        job = _start(config, workdir, steps_per_epoch, cleanup, own_data=batches is None)
        baseline = None
        if config.knn.enabled:
            baseline = monitor.knn_baseline(
                config,
                job.forward,
                job.state,
                job.mesh,
                workdir=workdir,
                writer=job.writer,
                resumed=job.resumed,
            )
        end = train_loop.train_steps(job, batches, stop_request, cleanup)
        summary = _finish(job, end, stop_request, baseline)
    summary["state"] = end.state
    return summary


def _start(config, workdir: str, steps_per_epoch, cleanup, *, own_data: bool) -> train_loop.Job:
    """The run's set-up: mesh, steps, method, optimizer, the state to start from (the workdir's
    checkpoint, then init.checkpoint, then scratch), writer and compiled steps."""
    mesh = parallel.make_mesh()
    plan = Plan.from_config(config, steps_per_epoch or split_steps_per_epoch(config))
    if own_data:
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
    job = train_loop.Job(
        config=config,
        workdir=workdir,
        mesh=mesh,
        plan=plan,
        manager=manager,
        state=state,
        position=position,
        resumed=resumed,
        writer=writer,
        train_step=make_step(config, method, tx, schedule, mesh, state, at_log_steps),
        eval_step=monitor.make_test_step(config, method, mesh),
        forward=make_forward(method, mesh),
        pictures=summaries.MethodPictures.of(config),
        checks=finite.Guard(manager, workdir, plan.steps_per_epoch),
    )
    if not resumed:
        overview = parameter_overview.get_parameter_overview(state.params)
        logging.info("Parameters of the online network:\n%s", overview)
        writer.write_texts(0, {"parameters": f"```\n{overview}\n```"})
    return job


def _finish(job: train_loop.Job, end: train_loop.End, stop_request, baseline) -> dict[str, Any]:
    """After the loop: the last save, the final state's check, and the summary (the step, the
    last loss, then the preemption or the final kNN against the random-init ``baseline``)."""
    config, step = job.config, end.step
    checkpoint.finish(job.manager)
    job.checks(end.state, step)
    summary: dict[str, Any] = {} if baseline is None else {"knn_random_init": baseline}
    summary["step"] = step
    summary["loss"] = None if end.metrics is None else float(end.metrics["loss"])
    if not end.stopped and step >= job.plan.max_steps:
        evaluate.mark_finished(job.workdir, step)
    if end.stopped:
        logging.warning(
            "Stopped by %s at step %d after saving a checkpoint; rerun the same "
            "command to resume (exit status %d).",
            stop_request.signal_name or "SIGTERM",
            step,
            preemption.PREEMPTED_EXIT_CODE,
        )
        summary["preempted"] = True
    elif config.knn.enabled:
        knn_final = monitor.final_knn(
            config, job.forward, end.state, job.mesh, step=step, last_test=end.tested
        )
        job.writer.write_scalars(step, {f"knn/{k}": v for k, v in knn_final.items()})
        summary["knn"] = knn_final
        if baseline is not None:
            summary["knn_comparison"] = monitor.knn_comparison(config, knn_final, baseline)
    job.writer.flush()
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
