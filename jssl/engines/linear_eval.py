"""The linear_eval engine: VISSL's linear image-classification benchmark
(``configs/config/benchmark/linear_image_classification/imagenet1k/
eval_resnet_8gpu_transfer_in1k_linear.yaml``) on a frozen trunk, over a grid of learning rates
and weight decays chosen on data held out of the train split, never on the test split (DINOv2
chooses on the split it reports), with ImageNet's robustness test sets.

Each tap in ``linear.layers`` is pooled and feeds BN -> linear heads, one per grid point
(evaluation.linear, evaluation.linear_grid), all trained in one pass with one trunk forward per
batch; ``linear.cached_features`` trains them on extracted features instead (the evaluation
view: no random crops or flips, so the figures differ). The loop is the train engine's in
miniature: one jitted step over the mesh, clu periodic actions, the heads saved every epoch; a
rerun resumes, and SIGTERM or a first Ctrl-C saves them and exits with 75. Inputs and the
held-out cut: engines.linear_eval_inputs; results.json: engines.linear_eval_record. The
protocol and what figure to quote: docs/evaluation.md, "Linear evaluation".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from clu import periodic_actions

from jssl import engines, models, parallel
from jssl.checkpoints import manager as checkpoint
from jssl.engines import linear_eval_inputs as inputs_lib
from jssl.engines import linear_eval_record as record_lib
from jssl.evaluation import linear, linear_grid, pooling, robustness_sets
from jssl.evaluation.feature_store import load_features
from jssl.evaluation.results import make_writer, write_results
from jssl.training import batches as batches_lib
from jssl.training import preemption, probe
from jssl.training.progress import Plan, Progress, Window

PyTree = Any


def validate(config: ml_collections.ConfigDict) -> None:
    """The linear_eval engine's start-up checks, run before anything is written to the
    workdir; each failure names the field and how to fix it."""
    lcfg = config.linear
    layers = tuple(lcfg.layers)
    if not layers:
        raise ValueError(
            "linear.layers is empty: name the trunk taps to evaluate, e.g. "
            '--config.linear.layers=\'("res5", "avgpool")\'.'
        )
    engines.check_positive(config, "linear.num_classes", "data.batch_size", "num_epochs")
    engines.check_positive(config, "log_every_steps")
    parallel.check_batch_divisible(config.data.batch_size)
    checkpoint.check_config(config.checkpoint)
    linear_grid.check_config(config)
    extra_sets = tuple(lcfg.extra_test_sets)
    if lcfg.cached_features:
        if extra_sets:
            raise ValueError(
                f"linear.extra_test_sets={extra_sets} needs the trunk (the sets are read as "
                "images), but linear.cached_features is set. Drop the cached features (set "
                "--config.init.checkpoint) or --config.linear.extra_test_sets='()'."
            )
        for split in (config.data.train_split, config.data.test_split):
            labels = load_features(lcfg.cached_features, split, layers[:1]).labels
            found = int(labels.max()) + 1 if len(labels) else 0
            inputs_lib.check_classes(
                config, f"The cached features of split {split!r} have", labels, found
            )
            if split == config.data.train_split:  # the held-out part leaves a batch
                limit = config.data.train_subset
                n = min(len(labels), limit) if limit > 0 else len(labels)
                inputs_lib.cached_splits(config, np.arange(n))
        inputs_lib.check_cached_hold_out(config)
        return
    if not config.init.checkpoint:
        raise ValueError(
            "engine='linear_eval' evaluates a trained model: set --config.init.checkpoint to a "
            "jssl workdir (or a checkpoint, or a VISSL .torch / torchvision .pth file), or "
            "--config.linear.cached_features to an extract_features workdir's features."
        )
    models.check_input_size(config.model, config.data.image_size, "data.image_size")
    pooling.layer_pools(lcfg.pool, layers)
    for split in (config.data.train_split, config.data.test_split):
        # The dataset's metadata, as the online probe's check (jssl.training.probe).
        found = probe.dataset_num_classes(config.data, split)
        if found is not None:
            inputs_lib.check_classes(config, f"The split {split!r} has", None, found)
    inputs_lib.image_splits(config)  # the held-out part can be cut, and leaves a batch
    if extra_sets:
        inputs_lib.check_extra_sets(config, extra_sets)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains the heads; returns ``{"results": {layer: {"top1", "top5"}} (the chosen heads
    on the test split), "record" (results.json), "step", "state", "trunk_variables"}``, or
    ``{"preempted": True, "step"}`` when SIGTERM or a first Ctrl-C stopped it: the heads are
    saved at that step, results.json is not written, and a rerun resumes."""
    validate(config)
    # A stop request from here on (loading the trunk, compiling) is acted on at the first step.
    with preemption.Preemption() as stop_request:
        mesh = parallel.make_mesh()
        parts = _setup(config, mesh)
        manager, state, position, resumed = checkpoint.resume(
            workdir, config.checkpoint, parts.state
        )
        if resumed:
            logging.info("Resumed the linear heads from step %d.", int(state.step))
        writer = make_writer(workdir)
        try:
            with checkpoint.closing(manager):  # an error or a stop waits for the save in flight
                state, step = _train_heads(
                    config, parts, mesh, manager, state, position, writer, stop_request
                )
            record, results = _final(config, parts, mesh, state, step, stop_request)
        except _Stopped as stopped:
            writer.flush()
            logging.warning(
                "Stopped by %s at step %d with the heads saved; rerun the same command to "
                "resume (exit status %d).",
                stop_request.signal_name or "SIGTERM",
                stopped.step,
                preemption.PREEMPTED_EXIT_CODE,
            )
            return {"preempted": True, "step": stopped.step}
    writer.write_scalars(step, record_lib.scalars(record))
    writer.flush()
    write_results(workdir, record)
    return {
        "results": results,
        "record": record,
        "step": step,
        "state": state,
        "trunk_variables": parts.inputs.trunk_variables,
    }


class _Stopped(Exception):
    """A stop request (SIGTERM, a first Ctrl-C) that every process agreed on, acted on after
    the heads' state of ``step`` is saved."""

    def __init__(self, step: int):
        super().__init__(f"stopped at step {step}")
        self.step = step


def _check_stop(stop_request: preemption.Preemption, state) -> None:
    """Raises _Stopped when any process was asked to stop (a collective on several)."""
    if preemption.agreed(stop_request.requested):
        raise _Stopped(int(jax.device_get(state.step)))


@dataclasses.dataclass
class _Parts:
    """What the loop and the final evaluation share: the heads, their inputs and grid."""

    layers: tuple[str, ...]
    heads: linear.LinearHeads
    inputs: inputs_lib.Inputs
    grid: linear_grid.Grid
    grid_opt: linear_grid.GridOptimizer
    plan: Plan
    state: Any  # the fresh state (replicated), before any resume


def _setup(config: ml_collections.ConfigDict, mesh) -> _Parts:
    """The inputs (trunk and images, or cached features), the grid and the fresh heads."""
    lcfg = config.linear
    layers = tuple(lcfg.layers)
    if lcfg.cached_features:
        inputs = inputs_lib.cached_inputs(config, mesh)
    else:
        inputs = inputs_lib.trunk_inputs(config, mesh)
    grid = linear_grid.Grid.from_config(config)
    logging.info(
        "Linear heads on %s; grid of %d points (lrs %s x weight decays %s); train %s, "
        "held out %s, test %s",
        ", ".join(f"{k}: {tuple(s)} ({int(np.prod(s))} dims)" for k, s in inputs.shapes.items()),
        grid.size,
        grid.lrs,
        grid.weight_decays,
        inputs.splits.train,
        inputs.splits.held_out,
        inputs.splits.test,
    )
    if tuple(lcfg.lrs):
        logging.info("optim.base_lr is not used: the grid's linear.lrs=%s are.", grid.lrs)
    heads = linear.LinearHeads(
        layers, lcfg.num_classes, bn_axis_name=parallel.DATA_AXIS if lcfg.sync_bn else None
    )
    plan = Plan.from_config(config, inputs.steps_per_epoch)
    rng = jax.random.PRNGKey(config.seed)
    sample = linear.sample_features(inputs.shapes)
    head_params = jax.eval_shape(functools.partial(heads.init, train=False), rng, sample)
    grid_opt = linear_grid.GridOptimizer(config, grid, head_params["params"], plan.steps_per_epoch)
    state = jax.jit(
        lambda: linear.init_state(heads, grid_opt, inputs.shapes, rng),
        out_shardings=parallel.replicated(mesh),
    )()
    return _Parts(layers, heads, inputs, grid, grid_opt, plan, state)


def _evaluator(parts: _Parts, mesh, stop_request, classes=None):
    """``(batches, state, what) -> (totals, scores)`` of the heads (over ``classes`` only,
    for a robustness set), stopping between batches on an agreed stop request."""
    step_fn = linear.make_eval_step(
        parts.heads, parts.grid, mesh, parts.inputs.features_fn, classes
    )
    return functools.partial(
        _evaluate,
        step_fn,
        parts.inputs.trunk_variables,
        parts.grid,
        parts.layers,
        stop=stop_request,
    )


def _train_heads(config, parts: _Parts, mesh, manager, state, position, writer, stop_request):
    """The loop over the steps; returns (state, steps done). An agreed stop request saves the
    step just trained and raises _Stopped."""
    plan, inputs, grid = parts.plan, parts.inputs, parts.grid
    train_step = linear.make_train_step(parts.heads, parts.grid_opt, mesh, inputs.features_fn)
    evaluate = _evaluator(parts, mesh, stop_request)
    trunk = inputs.trunk_variables
    report_progress = periodic_actions.ReportProgress(
        num_train_steps=plan.total_steps, writer=writer, every_steps=plan.log_every_steps
    )
    write_metrics = periodic_actions.PeriodicCallback(
        every_steps=plan.log_every_steps,
        on_steps=[plan.max_steps],
        callback_fn=functools.partial(_write_metrics, writer),
        pass_step_and_time=False,
    )
    save_in_epoch = periodic_actions.PeriodicCallback(
        every_steps=plan.checkpoint_every_steps or None,
        callback_fn=functools.partial(_save_in_epoch, manager),
        pass_step_and_time=False,
    )

    step = first_step = int(jax.device_get(state.step))
    window = Window()
    host_batches = batches_lib.positioned(inputs.train_batches, position, plan)
    # ``step``: the steps done once this batch is trained; the range ends the run at max_steps.
    for step, (epoch, index, host_batch) in zip(
        range(first_step + 1, plan.max_steps + 1), host_batches, strict=False
    ):
        state, metrics = train_step(state, trunk, parallel.host_batch_to_global(host_batch, mesh))
        window.metrics.append(metrics)
        progress = Progress.after(step, epoch, index, plan)
        report_progress(step)
        if write_metrics(step, progress=progress, window=window):
            window = Window()
        save_in_epoch(step, state=state, progress=progress)
        if preemption.agreed(stop_request.requested):
            checkpoint.save(manager, state, progress.next, force=True)
            raise _Stopped(step)
        epoch_done = progress.next.epoch == epoch + 1
        if not (epoch_done or step >= plan.max_steps):
            continue
        if window:  # the steps after the epoch's last full window
            _write_metrics(writer, progress=progress, window=window)
            window = Window()
        checkpoint.save(manager, state, progress.next, force=True)
        if step >= plan.max_steps:
            break
        if epoch_done and epoch + 1 in plan.test_epochs:  # the final heads: after the loop
            _periodic_phase(writer, step, epoch, grid, evaluate, inputs, state)
    checkpoint.finish(manager)
    return state, step


def _write_metrics(writer, *, progress: Progress, window: Window) -> None:
    """Writes a window's mean training metrics; a non-finite loss (every grid point of a
    layer diverged) ends the run."""
    scalars = window.mean()
    if not np.isfinite(scalars["loss"]):
        raise FloatingPointError(
            f"The linear heads' loss is {scalars['loss']} at step {progress.step}: every "
            "head of a layer diverged; lower --config.linear.lrs (or --config.optim.base_lr "
            "when linear.lrs is empty)."
        )
    writer.write_scalars(progress.step, {f"train/{k}": v for k, v in scalars.items()})


def _save_in_epoch(manager, *, state, progress: Progress) -> None:
    if progress.next.step_in_epoch != 0:  # the end of the epoch saves anyway (forced)
        checkpoint.save(manager, state, progress.next)


def _evaluate(eval_step, trunk, grid, layers, batches, state, what: str, *, stop=None):
    """(summed counts, ``{layer: [{"top1", "top5"} per grid point]}``) over ``batches``;
    raises _Stopped between two batches once ``stop`` (a Preemption) is agreed on."""
    totals = None
    for batch in batches:
        if stop is not None:
            _check_stop(stop, state)
        out = eval_step(state, trunk, batch)
        totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
    if totals is None:
        raise ValueError(f"The {what} is empty.")
    totals = jax.device_get(totals)
    return totals, linear_grid.point_scores(grid, totals, layers)


def _periodic_phase(writer, step, epoch, grid, evaluate, inputs, state) -> None:
    """Between epochs: the held-out part (every point), or the test split when nothing is
    held out (a one-point grid, as VISSL's test phase every epoch)."""
    held_out = inputs.splits.held_out is not None
    batches = inputs.held_out_batches() if held_out else inputs.test_batches()
    name = "held_out" if held_out else "test"
    _, scores = evaluate(batches, state, f"{name} split")
    logging.info("%s after epoch %d: %s", name, epoch + 1, scores)
    scalars = {}
    for layer, points in scores.items():
        for p in grid.points:
            prefix = f"{name}/{layer}" if grid.size == 1 else f"{name}/{layer}/{p.tag}"
            scalars.update({f"{prefix}/{k}": v for k, v in points[p.index].items()})
    writer.write_scalars(step, scalars)


def _final(config, parts: _Parts, mesh, state, step: int, stop_request):
    """Selection on the held-out part, the test split and the extra sets: (record, results)."""
    lcfg, layers = config.linear, parts.layers
    grid, inputs = parts.grid, parts.inputs
    evaluate = _evaluator(parts, mesh, stop_request)
    held_out = None
    if inputs.held_out_batches is not None:
        held_out = evaluate(inputs.held_out_batches(), state, "held-out part")[1]
    finite = linear_grid.finite_points(grid, state.params, layers)
    chosen = linear_grid.select(grid, held_out, finite)
    totals, test = evaluate(inputs.test_batches(), state, f"test split {inputs.splits.test!r}")
    extra, set_steps = {}, {}
    for spec in lcfg.extra_test_sets:
        name, split = robustness_sets.parse(spec)
        dcfg = inputs_lib.extra_set_config(config, name)
        names = robustness_sets.label_names_of(dcfg, split)
        classes = robustness_sets.class_subset(name, names)
        if classes not in set_steps:  # one compiled step per class subset
            set_steps[classes] = _evaluator(parts, mesh, stop_request, classes)
        batches = inputs_lib.image_batches(config, split, mesh, dcfg)
        set_totals, set_scores = set_steps[classes](batches, state, f"set {spec!r}")
        extra[spec] = (classes, set_totals, set_scores)

    record: dict[str, Any] = {
        "evaluator": "linear",
        "reference": record_lib.REFERENCE,
        "layers": {},
    }
    for layer in layers:
        record["layers"][layer] = record_lib.layer_record(
            config,
            inputs,
            grid,
            layer,
            chosen[layer],
            steps=step,
            test=(totals, test[layer]),
            held_out=None if held_out is None else held_out[layer],
            finite=finite[layer],
            extra={spec: (c, t, scores[layer]) for spec, (c, t, scores) in extra.items()},
        )
    results = {layer: {k: e[k] for k in ("top1", "top5")} for layer, e in record["layers"].items()}
    return record, results
