"""The train engine: VISSL's trainer as one loop of phases over a functional state.

Phases: a train epoch, then (every ``test_every_epochs``) a test phase with the validation
loss and the kNN monitor. clu periodic actions and one metric writer stand in for VISSL's
hooks; orbax checkpoints at the end of each epoch, every ``checkpoint.every_steps`` and on
SIGTERM; a restart with the same workdir resumes where the last checkpoint left off.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from clu import metric_writers, parameter_overview, periodic_actions

from jssl import checkpoint, data, methods, models, optim, parallel, probe, summaries, train_state
from jssl.engines import monitor
from jssl.train_step import make_eval_step, make_forward, make_train_step


class NonFiniteLossError(FloatingPointError):
    pass


class _Preemption:
    """Turns SIGTERM into a flag the loop checks between steps (save, then exit)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        def handler(signum, frame):
            logging.warning("SIGTERM received: saving a checkpoint and exiting.")
            self.requested = True

        try:
            self._previous = signal.signal(signal.SIGTERM, handler)
        except ValueError:  # not the main thread (e.g. called from a test thread)
            self._previous = None
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def validate(config: ml_collections.ConfigDict) -> None:
    parallel.check_batch_divisible(config.data.batch_size)
    if config.knn.enabled:
        parallel.check_batch_divisible(config.knn.batch_size)
    module = __import__(f"jssl.methods.{config.method.name}", fromlist=["check_config"])
    if hasattr(module, "check_config"):
        module.check_config(config)


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
    return optim.build_optimizer(config.optim, params_shape, schedule), schedule


def write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    logging.info("Resolved config:\n%s", config)
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True))


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains ``config.method`` and returns the final summary (kNN accuracies, steps)."""
    validate(config)
    if config.debug.nans:
        jax.config.update("jax_debug_nans", True)
    write_config(config, workdir)

    mesh = parallel.make_mesh()
    method = methods.get(config)
    steps_per_epoch = data.steps_per_epoch(config.data, jax.process_count())
    if steps_per_epoch < 1:
        raise ValueError(
            f"The train split has {data.num_examples(config.data, config.data.train_split)} "
            f"examples, fewer than one global batch (data.batch_size={config.data.batch_size}); "
            "lower --config.data.batch_size or use more data (data.train_subset)."
        )
    total_steps = steps_per_epoch * config.num_epochs
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

    writer = metric_writers.create_default_writer(
        os.path.join(workdir, "tensorboard"), just_logging=jax.process_index() > 0
    )
    summary: dict[str, Any] = {}
    fresh = not resumed
    forward = make_forward(method, mesh)
    if fresh:
        overview = parameter_overview.get_parameter_overview(state.params)
        logging.info("Parameters of the online network:\n%s", overview)
        writer.write_texts(0, {"parameters": f"```\n{overview}\n```"})
    if config.knn.enabled:
        # The baseline a pre-training run must beat; kept in the workdir for resumed runs.
        baseline_path = os.path.join(workdir, "knn_random_init.json")
        baseline = None if fresh else monitor.load_json(baseline_path)
        if baseline is None and fresh:
            baseline = monitor.knn_eval(config, forward, state, mesh)
            monitor.save_json(baseline_path, baseline)
            writer.write_scalars(0, {f"knn/random_init_{k}": v for k, v in baseline.items()})
        if baseline is not None:
            summary["knn_random_init"] = baseline

    train_step = make_train_step(
        method, tx, schedule, mesh, probe_config=config if probe.enabled(config) else None
    )
    eval_step = make_eval_step(method, mesh)
    report = periodic_actions.ReportProgress(
        num_train_steps=total_steps, writer=writer, every_steps=config.log_every_steps
    )
    hooks = [report]
    if config.debug.profile:
        hooks.append(periodic_actions.Profile(logdir=workdir, num_profile_steps=5))

    step = int(jax.device_get(state.step))
    max_steps = config.debug.max_steps if config.debug.max_steps > 0 else total_steps
    pending: list[dict[str, jax.Array]] = []
    window_start = time.perf_counter()
    window_steps = 0

    def check_finite():
        bad = int(jax.device_get(state.nonfinite_step))
        if bad >= 0:
            raise NonFiniteLossError(
                f"The loss or gradients became non-finite at step {bad} (epoch "
                f"{bad // steps_per_epoch}). Training stopped; the parameters from before that "
                f"step are kept and the checkpoints in {checkpoint.checkpoint_dir(workdir)} "
                "are intact. Try a lower --config.optim.base_lr, warmup "
                "(--config.optim.warmup_epochs), or --config.debug.nans=True to find the op."
            )

    def save(pos: checkpoint.DataPosition, force: bool = False):
        check_finite()
        checkpoint.save(manager, state, pos, force=force)

    tested_at, test = -1, {}
    with _Preemption() as preemption:
        for epoch in range(position.epoch, config.num_epochs):
            if step >= max_steps:  # a rerun of a run that already reached debug.max_steps
                break
            start = position.step_in_epoch if epoch == position.epoch else 0
            batches = data.build_train_dataset(
                config.data,
                seed=config.seed,
                epoch=epoch,
                start_step=start,
                process_index=jax.process_index(),
                process_count=jax.process_count(),
            )
            step_in_epoch = start - 1  # the last batch trained, for _position_after
            for step_in_epoch, host_batch in enumerate(batches.as_numpy_iterator(), start):
                if step == 0:
                    summaries.write_views(writer, host_batch["views"], config.data.augment)
                batch = parallel.host_batch_to_global(host_batch, mesh)
                state, metrics = train_step(state, batch)
                step += 1
                window_steps += 1
                pending.append(metrics)
                for hook in hooks:
                    hook(step)
                if step % config.log_every_steps == 0 or step == max_steps:
                    check_finite()
                    elapsed = time.perf_counter() - window_start
                    scalars = summaries.mean_metrics(pending)
                    scalars["images_per_sec"] = (
                        window_steps * config.data.batch_size / max(elapsed, 1e-9)
                    )
                    scalars["epoch"] = epoch + (step_in_epoch + 1) / steps_per_epoch
                    writer.write_scalars(step, scalars)
                    pending, window_steps, window_start = [], 0, time.perf_counter()
                next_pos = _position_after(epoch, step_in_epoch, steps_per_epoch)
                every = config.checkpoint.every_steps
                if every > 0 and step % every == 0 and next_pos.step_in_epoch != 0:
                    save(next_pos)
                if preemption.requested or step >= max_steps:
                    break
            next_pos = _position_after(epoch, step_in_epoch, steps_per_epoch)
            save(next_pos, force=True)
            # The test phase follows every completed epoch, the last one included (max_steps
            # defaults to the total, so reaching it is not in itself an early stop); a
            # preempted run leaves as fast as it can.
            epoch_done = next_pos.epoch == epoch + 1
            test_due = config.test_every_epochs > 0 and (epoch + 1) % config.test_every_epochs == 0
            if epoch_done and test_due and not preemption.requested:
                test = monitor.test_phase(
                    config,
                    eval_step,
                    forward,
                    state,
                    mesh,
                    workdir=workdir,
                    epoch=epoch + 1,
                    writer=writer,
                    step=step,
                )
                writer.write_scalars(step, {f"test/{k}": v for k, v in test.items()})
                tested_at = step
            if preemption.requested or step >= max_steps:
                break

    manager.wait_until_finished()
    check_finite()
    summary["step"] = step
    if preemption.requested:
        logging.warning("Stopped by SIGTERM at step %d; rerun the same command to resume.", step)
        summary["preempted"] = True
    elif config.knn.enabled:
        if tested_at == step:  # the last test phase already measured this very state
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


def _position_after(epoch: int, step_in_epoch: int, steps_per_epoch: int):
    if step_in_epoch + 1 >= steps_per_epoch:
        return checkpoint.DataPosition(epoch + 1, 0)
    return checkpoint.DataPosition(epoch, step_in_epoch + 1)


def _print_knn_comparison(config, summary) -> None:
    learned, rand = summary["knn"], summary["knn_random_init"]
    line = (
        f"kNN top-1 on {config.knn.test_split} ({config.knn.layer}, k={config.knn.k}): "
        f"learned {learned['top1']:.1f}% vs random init {rand['top1']:.1f}%"
    )
    logging.info(line)
    if jax.process_index() == 0:
        print(line, flush=True)
    summary["knn_comparison"] = line
