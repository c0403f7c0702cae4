"""The linear_eval engine: VISSL's linear image-classification benchmark
(``configs/config/benchmark/linear_image_classification/imagenet1k/
eval_resnet_8gpu_transfer_in1k_linear.yaml``).

The trunk in ``init.checkpoint`` is frozen in eval mode (running BN statistics, no gradients);
its taps in ``config.linear.layers`` are pooled (``config.linear.pool``, VISSL's
``LINEAR_EVAL_FEAT_POOL_OPS_MAP``) and each feeds its own BN -> linear head (jssl.linear).
All heads train in one run with one optax optimizer (``config.optim``), each is tested on the
test split, and ``workdir/results.json`` holds ``{"<layer>": {"top1": .., "top5": ..}, ...}``.

With ``config.linear.cached_features`` (an ``extract_features`` workdir's ``features/``
folder) the heads train on the already pooled features read from disk, with no trunk forward.
Those features are of the evaluation view (resize + centre crop), so this fast mode trains
without VISSL's random crops and flips and scores differently: on the demo, res4 reached
96.3% top-1 from cached features and 86.1% with crops (6 epochs each).

The loop follows the train engine: one jitted, state-donating step over the mesh, a
checkpoint of the (small) head state at the end of every epoch and every
``checkpoint.every_steps``, and a restart with the same workdir resumes where it left off.
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

from jssl import checkpoint, data, linear, optim, parallel, pooling, summaries
from jssl.engines import evaluate

PyTree = Any


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains the heads and returns ``{"results", "step", "state", "trunk_variables"}``."""
    lcfg = config.linear
    layers = tuple(lcfg.layers)
    if not layers:
        raise ValueError("config.linear.layers is empty: name the trunk taps to evaluate.")
    parallel.check_batch_divisible(config.data.batch_size)
    mesh = parallel.make_mesh()
    inputs = _cached_inputs(config) if lcfg.cached_features else _trunk_inputs(config, mesh)
    logging.info(
        "Linear heads on %s",
        ", ".join(f"{k}: {tuple(s)} ({int(np.prod(s))} dims)" for k, s in inputs.shapes.items()),
    )

    heads = linear.LinearHeads(
        layers, lcfg.num_classes, bn_axis_name=parallel.DATA_AXIS if lcfg.sync_bn else None
    )
    steps_per_epoch = inputs.steps_per_epoch
    total_steps = steps_per_epoch * config.num_epochs
    schedule = optim.build_schedule(
        config.optim,
        steps_per_epoch=steps_per_epoch,
        num_epochs=config.num_epochs,
        global_batch=config.data.batch_size,
    )
    rng = jax.random.PRNGKey(config.seed)
    sample = {k: jax.ShapeDtypeStruct((1, *s), jnp.float32) for k, s in inputs.shapes.items()}
    params_shape = jax.eval_shape(functools.partial(heads.init, train=False), rng, sample)
    tx = optim.build_optimizer(config.optim, params_shape["params"], schedule)
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

    def test() -> dict[str, dict[str, float]]:
        totals = None
        for batch in inputs.test_batches():
            out = eval_step(state, trunk, parallel.host_batch_to_global(batch, mesh))
            totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
        if totals is None:
            raise ValueError(f"The test split {config.data.test_split!r} is empty.")
        totals = jax.device_get(totals)
        count = max(int(totals["count"]), 1)
        return {
            layer: {k: 100.0 * float(v) / count for k, v in totals[layer].items()}
            for layer in layers
        }

    writer = evaluate.make_writer(workdir)
    report = periodic_actions.ReportProgress(
        num_train_steps=total_steps, writer=writer, every_steps=config.log_every_steps
    )
    step = int(jax.device_get(state.step))
    max_steps = config.debug.max_steps if config.debug.max_steps > 0 else total_steps
    pending: list[dict[str, jax.Array]] = []

    def write_train_metrics():
        scalars = summaries.mean_metrics(pending)
        if not np.isfinite(scalars["loss"]):
            raise FloatingPointError(
                f"The linear heads' loss is {scalars['loss']} at step {step}; lower "
                "--config.optim.base_lr."
            )
        writer.write_scalars(step, {f"train/{k}": v for k, v in scalars.items()})
        pending.clear()

    for epoch in range(position.epoch, config.num_epochs):
        if step >= max_steps:
            break
        start = position.step_in_epoch if epoch == position.epoch else 0
        step_in_epoch = start - 1
        for step_in_epoch, batch in enumerate(inputs.train_batches(epoch, start), start):
            state, metrics = train_step(state, trunk, parallel.host_batch_to_global(batch, mesh))
            step += 1
            pending.append(metrics)
            report(step)
            if step % config.log_every_steps == 0 or step == max_steps:
                write_train_metrics()
            next_pos = _position_after(epoch, step_in_epoch, steps_per_epoch)
            every = config.checkpoint.every_steps
            if every > 0 and step % every == 0 and next_pos.step_in_epoch != 0:
                checkpoint.save(manager, state, next_pos)
            if step >= max_steps:
                break
        if pending:
            write_train_metrics()
        next_pos = _position_after(epoch, step_in_epoch, steps_per_epoch)
        checkpoint.save(manager, state, next_pos, force=True)
        last = epoch + 1 == config.num_epochs or step >= max_steps
        due = config.test_every_epochs > 0 and (epoch + 1) % config.test_every_epochs == 0
        if due and not last and next_pos.epoch == epoch + 1:
            scores = test()
            logging.info("Test after epoch %d: %s", epoch + 1, scores)
            writer.write_scalars(step, _test_scalars(scores))
    checkpoint.finish(manager)
    manager.close()

    results = test()
    for layer, scores in results.items():
        logging.info(
            "Linear eval %s: top-1 %.2f, top-5 %.2f", layer, scores["top1"], scores["top5"]
        )
    writer.write_scalars(step, _test_scalars(results))
    writer.flush()
    evaluate.write_results(workdir, results)
    return {"results": results, "step": step, "state": state, "trunk_variables": trunk}


@dataclasses.dataclass
class _Inputs:
    """What the loop needs from its input source (images + frozen trunk, or cached features)."""

    features_fn: linear.FeaturesFn  # (trunk_variables, batch inputs) -> {layer: features}
    trunk_variables: PyTree  # replicated; {} for cached features
    shapes: dict[str, tuple[int, ...]]  # per-example feature shape of each layer
    steps_per_epoch: int
    train_batches: Callable[[int, int], Iterator[dict]]  # (epoch, start_step) -> batches
    test_batches: Callable[[], Iterator[dict]]  # padded, with "mask"


def _trunk_inputs(config: ml_collections.ConfigDict, mesh) -> _Inputs:
    lcfg = config.linear
    layers = tuple(lcfg.layers)
    model, trunk = evaluate.load_frozen_model(config, mesh)
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
        ds = data.build_eval_dataset(
            config.data,
            config.data.test_split,
            batch_size=config.data.batch_size,
            process_index=process_index,
            process_count=process_count,
        )
        for batch in ds.as_numpy_iterator():
            yield {"inputs": batch["image"], "label": batch["label"], "mask": batch["mask"]}

    return _Inputs(
        features_fn=features_fn,
        trunk_variables=trunk,
        shapes={layer: tuple(s.shape[1:]) for layer, s in shapes.items()},
        steps_per_epoch=data.steps_per_epoch(train_data, process_count),
        train_batches=train_batches,
        test_batches=test_batches,
    )


def _cached_inputs(config: ml_collections.ConfigDict) -> _Inputs:
    lcfg = config.linear
    layers = tuple(lcfg.layers)
    train_set = evaluate.load_features(lcfg.cached_features, config.data.train_split, layers)
    test_set = evaluate.load_features(lcfg.cached_features, config.data.test_split, layers)
    train_feats, train_labels = train_set.features, train_set.labels
    if config.data.train_subset > 0:  # VISSL DATA_LIMIT: the first N examples
        train_feats = {k: v[: config.data.train_subset] for k, v in train_feats.items()}
        train_labels = train_labels[: config.data.train_subset]
    for name, labels in (("train", train_labels), ("test", test_set.labels)):
        if len(labels) and (labels.min() < 0 or labels.max() >= lcfg.num_classes):
            raise ValueError(
                f"The cached {name} targets span [{labels.min()}, {labels.max()}], outside "
                f"[0, config.linear.num_classes={lcfg.num_classes}); set num_classes."
            )
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
        return linear.cached_eval_batches(
            test_set.features,
            test_set.labels,
            batch_size=batch_size,
            process_index=process_index,
            process_count=process_count,
        )

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


def _position_after(epoch: int, step_in_epoch: int, steps_per_epoch: int):
    if step_in_epoch + 1 >= steps_per_epoch:
        return checkpoint.DataPosition(epoch + 1, 0)
    return checkpoint.DataPosition(epoch, step_in_epoch + 1)
