"""The train engine: VISSL's trainer as one loop of phases over a functional state.

Phases: a train epoch, then (every ``test_every_epochs``) a test phase with the validation
loss and the kNN monitor. clu periodic actions and one metric writer stand in for VISSL's
hooks; orbax checkpoints at the end of each epoch, every ``checkpoint.every_steps`` and on
SIGTERM; a restart with the same workdir resumes where the last checkpoint left off.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from clu import metric_writers, parameter_overview, periodic_actions
from jax.experimental import multihost_utils

from jssl import (
    checkpoint,
    data,
    methods,
    models,
    optim,
    parallel,
    probe,
    summaries,
    train_state,
    warm_start,
)
from jssl.engines import monitor, preemption
from jssl.train_step import make_forward, make_train_step, stop_flags


class NonFiniteLossError(FloatingPointError):
    pass


def validate(config: ml_collections.ConfigDict) -> None:
    """Start-up checks of the config: each failure names the field and how to fix it."""
    _check_positive(config, "log_every_steps", "num_epochs", "data.batch_size", "data.image_size")
    if config.knn.enabled:
        _check_positive(config, "knn.batch_size", "knn.k")
        parallel.check_batch_divisible(config.knn.batch_size)
    if config.probe.num_classes < 0:
        raise ValueError(
            f"probe.num_classes={config.probe.num_classes} must be >= 0 (0 turns the probe off)."
        )
    parallel.check_batch_divisible(config.data.batch_size)
    checkpoint.check_config(config.checkpoint)
    data.crop_groups(config.data)
    methods.check_config(config)


def _check_positive(config: ml_collections.ConfigDict, *fields: str) -> None:
    for field in fields:
        value = config
        for name in field.split("."):
            value = value[name]
        if value <= 0:
            raise ValueError(f"{field}={value} must be positive: set --config.{field}=<n> > 0.")


def init_state(config: ml_collections.ConfigDict, method: methods.Method, tx, mesh):
    """A fresh, replicated TrainState built inside jit (no host round trip of weights)."""
    size = config.data.image_size
    sample = jnp.zeros((1, size, size, 3), jnp.float32)
    rng = jax.random.PRNGKey(config.seed)
    init_rng, state_rng = jax.random.split(rng)

    def create():
        fields = method.init(init_rng, sample)
        online_probe = probe.init(config, models.trunk_feature_dim(config.model))
        return train_state.create(**fields, tx=tx, rng=state_rng, probe=online_probe)

    return jax.jit(create, out_shardings=parallel.replicated(mesh))()


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
    tx = optim.build_optimizer(config.optim, params_shape, schedule)
    return optim.freeze_for_steps(tx, params_shape, method.frozen_params), schedule


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains ``config.method`` and returns the final summary (kNN accuracies, steps).

    ``summary["preempted"]`` is True when the run stopped on SIGTERM after saving (launch.py
    then exits with ``preemption.PREEMPTED_EXIT_CODE``).
    """
    validate(config)
    probe.check_num_classes(config)
    if config.debug.nans:
        jax.config.update("jax_debug_nans", True)
    # From the start: a SIGTERM while compiling or measuring the baseline is acted on at the
    # first step, instead of killing the process before anything is saved.
    with preemption.Preemption() as sigterm:
        return _train(config, workdir, sigterm)


def _train(config: ml_collections.ConfigDict, workdir: str, sigterm) -> dict[str, Any]:
    mesh = parallel.make_mesh()
    steps_per_epoch = data.steps_per_epoch(config.data, jax.process_count())
    if steps_per_epoch < 1:
        raise ValueError(
            f"The train split has {data.num_examples(config.data, config.data.train_split)} "
            f"examples, fewer than one global batch (data.batch_size={config.data.batch_size}); "
            "lower --config.data.batch_size or use more data (data.train_subset)."
        )
    total_steps = steps_per_epoch * config.num_epochs
    method = methods.get(config, steps_per_epoch)
    tx, schedule = make_optimizer(config, method, steps_per_epoch)
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
        # The resume order: the workdir's own checkpoint, then init.checkpoint, then scratch.
        state = warm_start.init_train_state(config, state)

    writer = metric_writers.create_default_writer(
        os.path.join(workdir, "tensorboard"), just_logging=jax.process_index() > 0
    )
    summary: dict[str, Any] = {}
    forward = make_forward(method, mesh)
    if not resumed:
        overview = parameter_overview.get_parameter_overview(state.params)
        logging.info("Parameters of the online network:\n%s", overview)
        writer.write_texts(0, {"parameters": f"```\n{overview}\n```"})
    if config.knn.enabled:
        baseline = _knn_baseline(config, forward, state, mesh, workdir, writer, resumed)
        if baseline is not None:
            summary["knn_random_init"] = baseline

    loop = _Loop(
        config=config,
        workdir=workdir,
        mesh=mesh,
        manager=manager,
        writer=writer,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        train_step=make_train_step(
            method, tx, schedule, mesh, probe_config=config if probe.enabled(config) else None
        ),
        eval_step=monitor.make_test_step(config, method, mesh),
        forward=forward,
        sigterm=sigterm,
    )
    state, test = loop.run(state, position)
    step = int(jax.device_get(state.step))

    checkpoint.finish(manager)
    loop.check_finite(state)
    summary["step"] = step
    if loop.stopped:
        logging.warning(
            "Stopped by SIGTERM at step %d after saving a checkpoint; rerun the same command "
            "to resume (exit status %d).",
            step,
            preemption.PREEMPTED_EXIT_CODE,
        )
        summary["preempted"] = True
    elif config.knn.enabled:
        if loop.tested_at == step:  # the last test phase already measured this very state
            summary["knn"] = {k[4:]: v for k, v in test.items() if k.startswith("knn_")}
        else:
            summary["knn"] = monitor.knn_eval(config, forward, state, mesh)
        writer.write_scalars(step, {f"knn/{k}": v for k, v in summary["knn"].items()})
        if "knn_random_init" in summary:
            _print_knn_comparison(config, summary)
    writer.flush()
    manager.close()
    summary["state"] = state
    return summary


def _knn_baseline(config, forward, state, mesh, workdir, writer, resumed) -> dict | None:
    """The kNN accuracy before the first step (of the random init, or of init.checkpoint's
    weights), the figure a pre-training run must beat; kept in the workdir so that resumed
    runs print it too."""
    path = os.path.join(workdir, "knn_random_init.json")
    if resumed:
        return monitor.load_json(path)
    baseline = monitor.knn_eval(config, forward, state, mesh)
    monitor.save_json(path, baseline)
    writer.write_scalars(0, {f"knn/random_init_{k}": v for k, v in baseline.items()})
    return baseline


@dataclasses.dataclass
class _Loop:
    """The epochs of one run: train steps, logging windows, checkpoints, test phases and
    the agreed SIGTERM stop. ``run`` threads the state through and returns it."""

    config: ml_collections.ConfigDict
    workdir: str
    mesh: Any
    manager: Any
    writer: Any
    steps_per_epoch: int
    total_steps: int
    train_step: Any
    eval_step: Any
    forward: Any
    sigterm: preemption.Preemption
    stopped: bool = False  # the agreed SIGTERM stop happened
    tested_at: int = -1  # step of the last test phase

    def check_finite(self, state) -> None:
        bad = int(jax.device_get(state.nonfinite_step))
        if bad >= 0:
            raise NonFiniteLossError(
                f"The loss or gradients (of the method or of the online probe) became "
                f"non-finite at step {bad} (epoch {bad // self.steps_per_epoch}). Training "
                "stopped; the parameters from before that step are kept and the checkpoints in "
                f"{checkpoint.checkpoint_dir(self.workdir)} are intact. Try a lower "
                "--config.optim.base_lr, warmup (--config.optim.warmup_epochs), or "
                "--config.debug.nans=True to find the op."
            )

    def save(self, state, position: checkpoint.DataPosition, force: bool = False) -> None:
        self.check_finite(state)
        checkpoint.save(self.manager, state, position, force=force)

    def run(self, state, position: checkpoint.DataPosition):
        config = self.config
        report = periodic_actions.ReportProgress(
            num_train_steps=self.total_steps,
            writer=self.writer,
            every_steps=config.log_every_steps,
        )
        hooks = [report]
        if config.debug.profile:
            hooks.append(periodic_actions.Profile(logdir=self.workdir, num_profile_steps=5))
        step = int(jax.device_get(state.step))
        max_steps = config.debug.max_steps if config.debug.max_steps > 0 else self.total_steps
        test: dict = {}
        for epoch in range(position.epoch, config.num_epochs):
            if step >= max_steps:  # a rerun of a run that already reached debug.max_steps
                break
            start = position.step_in_epoch if epoch == position.epoch else 0
            state, step, last = self.train_epoch(state, epoch, start, step, max_steps, hooks)
            next_pos = _position_after(epoch, last, self.steps_per_epoch)
            self.save(state, next_pos, force=True)
            # The test phase follows every completed epoch, the last one included
            # (max_steps defaults to the total, so reaching it is not in itself an early
            # stop); a preempted run leaves as fast as it can.
            epoch_done = next_pos.epoch == epoch + 1
            every = config.test_every_epochs
            test_due = every > 0 and (epoch + 1) % every == 0
            if epoch_done and test_due and not self.stopped:
                test = monitor.test_phase(
                    config,
                    self.eval_step,
                    self.forward,
                    state,
                    self.mesh,
                    workdir=self.workdir,
                    epoch=epoch + 1,
                    writer=self.writer,
                    step=step,
                )
                self.writer.write_scalars(step, {f"test/{k}": v for k, v in test.items()})
                self.tested_at = step
            if self.stopped or step >= max_steps:
                break
        return state, test

    def train_epoch(self, state, epoch, start, step, max_steps, hooks):
        """Trains from batch ``start`` of ``epoch``; returns (state, step, last batch index)."""
        config = self.config
        batches = data.build_train_dataset(
            config.data,
            seed=config.seed,
            epoch=epoch,
            start_step=start,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        pending: list[dict[str, jax.Array]] = []
        previous = None  # the metrics of the step before, whose "stop" the loop reads
        window_start, window_steps = time.perf_counter(), 0
        replaced = 0  # rows standing in for unreadable examples (data.skip_corrupt)
        step_in_epoch = start - 1  # the last batch trained, for _position_after
        for step_in_epoch, host_batch in enumerate(batches.as_numpy_iterator(), start):
            if "replaced" in host_batch:
                replaced += int(np.sum(host_batch.pop("replaced")))
            if step == 0:
                summaries.write_views(self.writer, host_batch["crops"], config.data.augment)
            batch = parallel.host_batch_to_global(host_batch, self.mesh)
            stop = stop_flags(self.mesh, self.sigterm.requested)
            state, metrics = self.train_step(state, batch, stop)
            step += 1
            window_steps += 1
            pending.append(metrics)
            for hook in hooks:
                hook(step)
            if step % config.log_every_steps == 0 or step == max_steps:
                self.check_finite(state)
                checkpoint.check_for_errors(self.manager)
                elapsed = time.perf_counter() - window_start
                scalars = summaries.mean_metrics(pending)
                scalars.pop("stop", None)
                scalars["images_per_sec"] = (
                    window_steps * config.data.batch_size / max(elapsed, 1e-9)
                )
                scalars["epoch"] = epoch + (step_in_epoch + 1) / self.steps_per_epoch
                self.writer.write_scalars(step, scalars)
                pending, window_steps, window_start = [], 0, time.perf_counter()
            next_pos = _position_after(epoch, step_in_epoch, self.steps_per_epoch)
            every = config.checkpoint.every_steps
            if every > 0 and step % every == 0 and next_pos.step_in_epoch != 0:
                self.save(state, next_pos)
            # Every process reads the same agreed flag of the same step, so all of them stop
            # after the same step (this one); reading the step before keeps one in flight.
            if previous is not None and int(previous["stop"]):
                self.stopped = True
            previous = metrics
            if self.stopped or step >= max_steps:
                break
        if previous is not None and int(previous["stop"]):
            self.stopped = True
        self._report_replaced(epoch, step, replaced)
        return state, step, step_in_epoch

    def _report_replaced(self, epoch: int, step: int, replaced: int) -> None:
        if not self.config.data.skip_corrupt:
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
        self.writer.write_scalars(step, {"data/skipped_examples": replaced})


def _position_after(epoch: int, step_in_epoch: int, steps_per_epoch: int):
    if step_in_epoch + 1 >= steps_per_epoch:
        return checkpoint.DataPosition(epoch + 1, 0)
    return checkpoint.DataPosition(epoch, step_in_epoch + 1)


def _print_knn_comparison(config, summary) -> None:
    learned, rand = summary["knn"], summary["knn_random_init"]
    # Started from weights, the baseline (measured before the first step) is those weights.
    start = "init.checkpoint" if config.init.checkpoint else "random init"
    line = (
        f"kNN top-1 on {config.knn.test_split} ({config.knn.layer}, k={config.knn.k}): "
        f"learned {learned['top1']:.1f}% vs {start} {rand['top1']:.1f}%"
    )
    logging.info(line)
    if jax.process_index() == 0:
        print(line, flush=True)
    summary["knn_comparison"] = line
