"""The train engine: VISSL's trainer as one loop of phases over a functional state.

Phases: a train epoch, then (every ``test_every_epochs``) a test phase with the validation
loss and the kNN monitor. clu periodic actions and one metric writer stand in for VISSL's
hooks; orbax checkpoints at the end of each epoch, every ``checkpoint.every_steps`` and on
SIGTERM; a restart with the same workdir resumes where the last checkpoint left off.

The epochs and the timing of that periodic work are the shared loop's (jssl.engines.loop);
this module sets the run up, says what each piece of work does for pre-training (``_Engine``)
and writes the final summary.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
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
from jssl.data import device_augment
from jssl.engines import loop as engine_loop
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
    tx = optim.build_grouped_optimizer(
        config.optim,
        params_shape,
        schedule,
        config.data.batch_size,
        steps_per_epoch=steps_per_epoch,
        num_epochs=config.num_epochs,
    )
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
    steps_per_epoch = _steps_per_epoch(config)
    logging.info("Training order: %s.", data.train_order(config.data))
    method = methods.get(config, steps_per_epoch)
    tx, schedule = make_optimizer(config, method, steps_per_epoch)
    manager, state, position, resumed = _start_state(config, workdir, method, tx, mesh)
    writer = metric_writers.create_default_writer(
        os.path.join(workdir, "tensorboard"), just_logging=jax.process_index() > 0
    )
    forward = make_forward(method, mesh)
    summary = _first_summaries(config, workdir, writer, forward, state, mesh, resumed)

    engine = _Engine(
        config=config,
        workdir=workdir,
        mesh=mesh,
        manager=manager,
        writer=writer,
        steps_per_epoch=steps_per_epoch,
        train_step=make_train_step(
            method,
            tx,
            schedule,
            mesh,
            probe_config=config if probe.enabled(config) else None,
            augment=device_augment.make_batch_augment(config.data),
        ),
        eval_step=monitor.make_test_step(config, method, mesh),
        forward=forward,
        sigterm=sigterm,
    )
    loop = engine_loop.Loop(
        engine_loop.Plan.from_config(config, steps_per_epoch),
        engine.hooks(),
        writer,
        agreed_stop=True,
    )
    state, _ = loop.run(state, position, int(jax.device_get(state.step)))
    return _finish(config, engine, state, stopped=loop.stopped, summary=summary)


def _finish(config, engine: _Engine, state, *, stopped: bool, summary: dict[str, Any]):
    """Waits for the last checkpoint, completes the summary (the final kNN accuracy unless
    the run was preempted) and closes the writer and the checkpoint manager."""
    step = int(jax.device_get(state.step))
    checkpoint.finish(engine.manager)
    engine.check_finite(state)
    summary["step"] = step
    if stopped:
        logging.warning(
            "Stopped by SIGTERM at step %d after saving a checkpoint; rerun the same command "
            "to resume (exit status %d).",
            step,
            preemption.PREEMPTED_EXIT_CODE,
        )
        summary["preempted"] = True
    elif config.knn.enabled:
        _final_knn(config, engine, state, step, summary)
    engine.writer.flush()
    engine.manager.close()
    summary["state"] = state
    return summary


def _steps_per_epoch(config: ml_collections.ConfigDict) -> int:
    steps_per_epoch = data.steps_per_epoch(config.data, jax.process_count())
    if steps_per_epoch < 1:
        raise ValueError(
            f"The train split has {data.num_examples(config.data, config.data.train_split)} "
            f"examples, fewer than one global batch (data.batch_size={config.data.batch_size}); "
            "lower --config.data.batch_size or use more data (data.train_subset)."
        )
    return steps_per_epoch


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


def _first_summaries(config, workdir, writer, forward, state, mesh, resumed) -> dict[str, Any]:
    """Writes what a run records before its first step (the parameter overview, the kNN
    baseline); returns the summary started with that baseline."""
    summary: dict[str, Any] = {}
    if not resumed:
        overview = parameter_overview.get_parameter_overview(state.params)
        logging.info("Parameters of the online network:\n%s", overview)
        writer.write_texts(0, {"parameters": f"```\n{overview}\n```"})
    if config.knn.enabled:
        baseline = _knn_baseline(config, forward, state, mesh, workdir, writer, resumed)
        if baseline is not None:
            summary["knn_random_init"] = baseline
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


def _final_knn(config, engine: _Engine, state, step: int, summary: dict[str, Any]) -> None:
    """The kNN accuracy of the trained state, reusing the last test phase's when it measured
    this very state."""
    if engine.tested_at == step:
        summary["knn"] = {k[4:]: v for k, v in engine.last_test.items() if k.startswith("knn_")}
    else:
        summary["knn"] = monitor.knn_eval(config, engine.forward, state, engine.mesh)
    engine.writer.write_scalars(step, {f"knn/{k}": v for k, v in summary["knn"].items()})
    if "knn_random_init" in summary:
        _print_knn_comparison(config, summary)


@dataclasses.dataclass
class _Engine:
    """What the train engine does at each point of the shared loop (jssl.engines.loop):
    its batches and step, its logged metrics, its checkpoints and its test phase."""

    config: ml_collections.ConfigDict
    workdir: str
    mesh: Any
    manager: Any
    writer: Any
    steps_per_epoch: int
    train_step: Any
    eval_step: Any
    forward: Any
    sigterm: preemption.Preemption
    tested_at: int = -1  # step of the last test phase
    last_test: dict = dataclasses.field(default_factory=dict)  # its results
    replaced: int = 0  # rows of this epoch standing in for unreadable examples

    def hooks(self) -> engine_loop.Hooks:
        actions = []
        if self.config.debug.profile:
            actions.append(periodic_actions.Profile(logdir=self.workdir, num_profile_steps=5))
        return engine_loop.Hooks(
            batches=self.batches,
            step=self.step,
            write_metrics=self.write_metrics,
            save=self.save,
            test=self.test,
            end_of_epoch=self.report_replaced,
            actions=actions,
        )

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

    def batches(self, epoch: int, start: int) -> Iterator[dict]:
        config = self.config
        dataset = data.build_train_dataset(
            config.data,
            seed=config.seed,
            epoch=epoch,
            start_step=start,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        self.replaced = 0
        return dataset.as_numpy_iterator()

    def step(self, state, host_batch: dict, step: int):
        config = self.config
        if "replaced" in host_batch:  # data.skip_corrupt
            self.replaced += int(np.sum(host_batch.pop("replaced")))
        if step == 0:
            summaries.write_views(self.writer, host_batch["crops"], config.data.augment)
        batch = parallel.host_batch_to_global(host_batch, self.mesh)
        stop = stop_flags(self.mesh, self.sigterm.requested)
        return self.train_step(state, batch, stop)

    def write_metrics(self, state, progress: engine_loop.Progress, window: engine_loop.Window):
        self.check_finite(state)
        checkpoint.check_for_errors(self.manager)
        elapsed = window.seconds()
        scalars = window.mean()
        images = len(window) * self.config.data.batch_size
        scalars["images_per_sec"] = images / max(elapsed, 1e-9)
        scalars["epoch"] = progress.epochs
        self.writer.write_scalars(progress.step, scalars)

    def save(self, state, position: checkpoint.DataPosition, force: bool = False) -> None:
        self.check_finite(state)
        checkpoint.save(self.manager, state, position, force=force)

    def test(self, state, step: int, epochs: int) -> None:
        self.last_test = monitor.test_phase(
            self.config,
            self.eval_step,
            self.forward,
            state,
            self.mesh,
            workdir=self.workdir,
            epoch=epochs,
            writer=self.writer,
            step=step,
        )
        self.writer.write_scalars(step, {f"test/{k}": v for k, v in self.last_test.items()})
        self.tested_at = step

    def report_replaced(self, epoch: int, step: int) -> None:
        if not self.config.data.skip_corrupt:
            return
        replaced = self.replaced
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
