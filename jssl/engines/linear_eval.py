"""The linear_eval engine: VISSL's linear image-classification benchmark
(``configs/config/benchmark/linear_image_classification/imagenet1k/
eval_resnet_8gpu_transfer_in1k_linear.yaml``).

The trunk in ``init.checkpoint`` is frozen in eval mode (running BN statistics, no gradients);
its taps in ``config.linear.layers`` are pooled (``config.linear.pool``, VISSL's
``LINEAR_EVAL_FEAT_POOL_OPS_MAP``) and each feeds its own BN -> linear head (evaluation.linear).
All heads train in one run with one optax optimizer (``config.optim``), each is tested on the
test split, and ``workdir/results.json`` holds ``{"<layer>": {"top1": .., "top5": ..}, ...}``.

With ``config.linear.cached_features`` (an ``extract_features`` workdir's ``features/``
folder) the heads train on the already pooled features read from disk, with no trunk forward.
Those features are of the evaluation view (resize + centre crop), so this fast mode trains
without VISSL's random crops and flips and scores differently (the demo's figures of both
modes are in docs/evaluation.md).

The loop in ``run`` is the train engine's in miniature, flat and with clu's periodic actions:
one jitted, state-donating step over the mesh, the mean metrics every ``log_every_steps`` (and
of the steps after an epoch's last full window), a checkpoint of the (small) head state at the
end of every epoch and every ``checkpoint.every_steps``, a test phase every
``test_every_epochs`` before the last, and a restart with the same workdir resumes where it
left off.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from clu import periodic_actions

from jssl import data, engines, models, optim, parallel
from jssl.checkpoints import manager as checkpoint
from jssl.evaluation import linear, pooling
from jssl.evaluation.batches import eval_batches, from_host_batches
from jssl.evaluation.feature_store import load_features
from jssl.evaluation.frozen import load_frozen_model
from jssl.evaluation.results import make_writer, write_results
from jssl.training import batches as batches_lib
from jssl.training import probe
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
    if lcfg.cached_features:
        for split in (config.data.train_split, config.data.test_split):
            labels = load_features(lcfg.cached_features, split, layers[:1]).labels
            found = int(labels.max()) + 1 if len(labels) else 0
            _check_classes(config, f"The cached features of split {split!r} have", labels, found)
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
            _check_classes(config, f"The split {split!r} has", None, found)


def _check_classes(
    config: ml_collections.ConfigDict, subject: str, labels: np.ndarray | None, found: int
) -> None:
    """A label outside [0, linear.num_classes) makes the heads' loss NaN from the first step."""
    num_classes = config.linear.num_classes
    if labels is not None and len(labels) and labels.min() < 0:
        raise ValueError(
            f"{subject} negative labels (down to {labels.min()}): the heads need labels in "
            f"[0, linear.num_classes); re-extract the features with the right labels."
        )
    if found > num_classes:
        raise ValueError(
            f"{subject} {found} classes but linear.num_classes={num_classes}: every label "
            f"needs an output of the heads. Set --config.linear.num_classes={found}."
        )


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains the heads and returns ``{"results", "step", "state", "trunk_variables"}``."""
    validate(config)
    lcfg = config.linear
    layers = tuple(lcfg.layers)
    mesh = parallel.make_mesh()
    inputs = _cached_inputs(config, mesh) if lcfg.cached_features else _trunk_inputs(config, mesh)
    logging.info(
        "Linear heads on %s",
        ", ".join(f"{k}: {tuple(s)} ({int(np.prod(s))} dims)" for k, s in inputs.shapes.items()),
    )

    heads = linear.LinearHeads(
        layers, lcfg.num_classes, bn_axis_name=parallel.DATA_AXIS if lcfg.sync_bn else None
    )
    plan = Plan.from_config(config, inputs.steps_per_epoch)
    tx, schedule = _optimizer(config, heads, inputs.shapes, plan.steps_per_epoch)
    rng = jax.random.PRNGKey(config.seed)
    state = jax.jit(
        lambda: linear.init_state(heads, tx, inputs.shapes, rng),
        out_shardings=parallel.replicated(mesh),
    )()

    manager, state, position, resumed = checkpoint.resume(workdir, config.checkpoint, state)
    if resumed:
        logging.info("Resumed the linear heads from step %d.", int(state.step))

    train_step = linear.make_train_step(heads, tx, schedule, mesh, inputs.features_fn)
    eval_step = linear.make_eval_step(heads, mesh, inputs.features_fn)
    trunk = inputs.trunk_variables
    test = functools.partial(_test, config, eval_step, trunk, inputs)
    writer = make_writer(workdir)
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
            scores = test(state)
            logging.info("Test after epoch %d: %s", epoch + 1, scores)
            writer.write_scalars(step, _test_scalars(scores))
    checkpoint.finish(manager)
    manager.close()

    results = test(state)
    for layer, scores in results.items():
        logging.info(
            "Linear eval %s: top-1 %.2f, top-5 %.2f", layer, scores["top1"], scores["top5"]
        )
    writer.write_scalars(step, _test_scalars(results))
    writer.flush()
    write_results(workdir, results)
    return {"results": results, "step": step, "state": state, "trunk_variables": trunk}


def _optimizer(config: ml_collections.ConfigDict, heads: linear.LinearHeads, shapes, steps):
    """The heads' optax transformation and its learning-rate schedule (``steps`` per epoch)."""
    schedule = optim.build_schedule(
        config.optim,
        steps_per_epoch=steps,
        num_epochs=config.num_epochs,
        global_batch=config.data.batch_size,
    )
    rng = jax.random.PRNGKey(config.seed)
    sample = {k: jax.ShapeDtypeStruct((1, *s), jnp.float32) for k, s in shapes.items()}
    params_shape = jax.eval_shape(functools.partial(heads.init, train=False), rng, sample)
    return optim.build_optimizer(config.optim, params_shape["params"], schedule), schedule


def _write_metrics(writer, *, progress: Progress, window: Window) -> None:
    """Writes a window's mean training metrics; a non-finite loss ends the run."""
    scalars = window.mean()
    if not np.isfinite(scalars["loss"]):
        raise FloatingPointError(
            f"The linear heads' loss is {scalars['loss']} at step {progress.step}; lower "
            "--config.optim.base_lr."
        )
    writer.write_scalars(progress.step, {f"train/{k}": v for k, v in scalars.items()})


def _save_in_epoch(manager, *, state, progress: Progress) -> None:
    if progress.next.step_in_epoch != 0:  # the end of the epoch saves anyway (forced)
        checkpoint.save(manager, state, progress.next)


def _test(config, eval_step, trunk, inputs: _Inputs, state) -> dict[str, dict[str, float]]:
    """Top-1 and top-5 (in %) of every head on the test split."""
    totals = None
    for batch in inputs.test_batches():
        out = eval_step(state, trunk, batch)
        totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
    if totals is None:
        raise ValueError(f"The test split {config.data.test_split!r} is empty.")
    totals = jax.device_get(totals)
    count = max(int(totals["count"]), 1)
    return {
        layer: {k: 100.0 * float(v) / count for k, v in totals[layer].items()}
        for layer in config.linear.layers
    }


@dataclasses.dataclass
class _Inputs:
    """What the loop needs from its input source (images + frozen trunk, or cached features)."""

    features_fn: linear.FeaturesFn  # (trunk_variables, batch inputs) -> {layer: features}
    trunk_variables: PyTree  # replicated; {} for cached features
    shapes: dict[str, tuple[int, ...]]  # per-example feature shape of each layer
    steps_per_epoch: int
    train_batches: Callable[[int, int], Iterator[dict]]  # (epoch, start_step) -> batches
    # every test example once, padded: global {"inputs", "label", "mask"} (evaluation.batches)
    test_batches: Callable[[], Iterator[dict]]


def _trunk_inputs(config: ml_collections.ConfigDict, mesh) -> _Inputs:
    lcfg = config.linear
    layers = tuple(lcfg.layers)
    model, trunk = load_frozen_model(config, mesh, layers)
    pools = pooling.layer_pools(lcfg.pool, layers)

    def features_fn(trunk_variables: PyTree, images: jax.Array) -> dict[str, jax.Array]:
        taps = model.apply(trunk_variables, images, train=False)
        return pooling.pool_taps(taps, layers, pools, "linear.layers")

    size = config.data.image_size
    images = jax.ShapeDtypeStruct((1, size, size, 3), jnp.float32)
    shapes = jax.eval_shape(features_fn, trunk, images)
    train_data = linear.train_data_config(config.data, lcfg.crop_scale)
    process_index, process_count = jax.process_index(), jax.process_count()

    def train_batches(epoch: int, start_step: int) -> Iterator[dict]:
        ds = data.build_train_dataset(
            train_data,
            seed=config.seed,
            epoch=epoch,
            start_step=start_step,
            process_index=process_index,
            process_count=process_count,
        )
        for batch in ds.as_numpy_iterator():
            yield {"inputs": batch["crops"][0][:, 0], "label": batch["label"]}

    def test_batches() -> Iterator[dict]:
        split, size = config.data.test_split, config.data.batch_size
        for b in eval_batches(config.data, split, size, mesh):
            yield {"inputs": b.batch["image"], "label": b.batch["label"], "mask": b.batch["mask"]}

    return _Inputs(
        features_fn=features_fn,
        trunk_variables=trunk,
        shapes={layer: tuple(s.shape[1:]) for layer, s in shapes.items()},
        steps_per_epoch=data.steps_per_epoch(train_data, process_count),
        train_batches=train_batches,
        test_batches=test_batches,
    )


def _cached_inputs(config: ml_collections.ConfigDict, mesh) -> _Inputs:
    lcfg = config.linear
    layers = tuple(lcfg.layers)
    train_set = load_features(lcfg.cached_features, config.data.train_split, layers)
    test_set = load_features(lcfg.cached_features, config.data.test_split, layers)
    train_feats, train_labels = train_set.features, train_set.labels
    if config.data.train_subset > 0:  # VISSL DATA_LIMIT: the first N examples
        train_feats = {k: v[: config.data.train_subset] for k, v in train_feats.items()}
        train_labels = train_labels[: config.data.train_subset]
    batch_size = config.data.batch_size
    if len(train_labels) < batch_size:
        raise ValueError(
            f"{len(train_labels)} cached training examples are fewer than one batch of "
            f"{batch_size}; lower --config.data.batch_size."
        )
    process_index, process_count = jax.process_index(), jax.process_count()

    def train_batches(epoch: int, start_step: int) -> Iterator[dict]:
        return linear.cached_train_batches(
            train_feats,
            train_labels,
            batch_size=batch_size,
            seed=config.seed,
            epoch=epoch,
            start_step=start_step,
            process_index=process_index,
            process_count=process_count,
        )

    def test_batches() -> Iterator[dict]:
        host_batches = linear.cached_eval_batches(
            test_set.features,
            test_set.labels,
            batch_size=batch_size,
            process_index=process_index,
            process_count=process_count,
        )
        for b in from_host_batches(host_batches, mesh):
            yield {name: b.batch[name] for name in ("inputs", "label", "mask")}

    return _Inputs(
        features_fn=lambda trunk_variables, feats: feats,
        trunk_variables={},
        shapes={layer: tuple(train_feats[layer].shape[1:]) for layer in layers},
        steps_per_epoch=len(train_labels) // batch_size,
        train_batches=train_batches,
        test_batches=test_batches,
    )


def _test_scalars(results: dict[str, dict[str, float]]) -> dict[str, float]:
    return {f"test/{layer}/{k}": v for layer, scores in results.items() for k, v in scores.items()}
