"""Linear classifiers on frozen features: VISSL's linear image-classification benchmark.

One head per evaluated layer and grid point (``linear_grid``), all trained at once on the same
batches, as VISSL's ``FEATURE_EVAL_SETTINGS`` with several ``eval_mlp`` heads and the
``cross_entropy_multiple_output_single_target`` loss, which sums the heads' losses: they share
no parameters, so the sum trains each one exactly as if it were alone. A head is VISSL's
``eval_mlp`` (``vissl/models/heads/linear_eval_mlp.py``): BatchNorm over the channels of the
pooled map (affine, eps 1e-5, PyTorch momentum 0.1), flatten, one ``nn.Linear`` with PyTorch's
default initialisation; (N, D) inputs are normalised per feature, as VISSL does after
unsqueezing them to (N, D, 1, 1). The steps take ``features_fn(trunk_variables, inputs)`` (the
frozen trunk's eval-mode forward and pooling, or the identity for cached features); the trunk
variables are never returned and only the heads are differentiated, so the trunk cannot
change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jssl.evaluation import linear_grid
from jssl.models.resnet import torch_linear_bias_init, torch_linear_kernel_init
from jssl.parallel import DATA_AXIS

PyTree = Any
FeaturesFn = Callable[[PyTree, Any], dict[str, jax.Array]]

# VISSL MODEL.HEAD.BATCHNORM_EPS / BATCHNORM_MOMENTUM defaults (vissl/config/defaults.yaml);
# flax's momentum is the weight of the old running average, 1 - PyTorch's.
_BN_EPSILON = 1e-5
_BN_MOMENTUM = 1.0 - 0.1


class LinearHead(nn.Module):
    """BatchNorm over the last (channel) axis, flatten, Linear: VISSL's eval_mlp."""

    num_classes: int
    bn_axis_name: str | None = None  # "data": statistics over the global batch (sync BN)

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = jnp.asarray(x, jnp.float32)
        # The submodule is called "bn" so that optim.weight_decay_mask sees it as batch norm
        # (VISSL's linear recipe has regularize_bn: False).
        x = nn.BatchNorm(
            use_running_average=not train,
            momentum=_BN_MOMENTUM,
            epsilon=_BN_EPSILON,
            axis_name=self.bn_axis_name if train else None,
            name="bn",
        )(x)
        x = x.reshape(x.shape[0], -1)
        fan_in = x.shape[-1]
        return nn.Dense(
            self.num_classes,
            kernel_init=torch_linear_kernel_init,
            bias_init=torch_linear_bias_init(fan_in),
            name="fc",
        )(x)


class LinearHeads(nn.Module):
    """One LinearHead per layer, named after it: ``{layer: logits}``."""

    layers: tuple[str, ...]
    num_classes: int
    bn_axis_name: str | None = None

    @nn.compact
    def __call__(self, feats: Mapping[str, jax.Array], train: bool = True) -> dict:
        return {
            layer: LinearHead(self.num_classes, self.bn_axis_name, name=layer)(feats[layer], train)
            for layer in self.layers
        }


@struct.dataclass
class LinearState:
    """Everything linear evaluation trains (the heads of every grid point), checkpointed
    with orbax. ``params``, ``batch_stats`` and ``opt_state`` hold one entry per grid group
    (``linear_grid.Grid.groups``: one weight decay each), ``{group: {layer: {"bn", "fc"}}}``,
    every leaf stacked on a leading axis of the grid's learning rates."""

    step: jax.Array  # int32 scalar: optimizer updates so far
    params: PyTree
    batch_stats: PyTree
    opt_state: PyTree


def init_state(
    heads: LinearHeads,
    grid_opt: linear_grid.GridOptimizer,
    feature_shapes: Mapping[str, Sequence[int]],
    rng: jax.Array,
) -> LinearState:
    """Fresh heads for features of ``feature_shapes`` (per example, without the batch axis):
    every grid point starts from the same heads, those ``heads.init(rng)`` gives."""
    variables = heads.init(rng, sample_features(feature_shapes), train=False)
    n = len(grid_opt.grid.lrs)
    params, batch_stats, opt_state = {}, {}, {}
    for j, group in enumerate(grid_opt.grid.groups):
        params[group] = linear_grid.stack(variables["params"], n)
        batch_stats[group] = linear_grid.stack(variables.get("batch_stats", {}), n)
        opt_state[group] = grid_opt.init(j, params[group])
    return LinearState(
        step=jnp.zeros((), jnp.int32), params=params, batch_stats=batch_stats, opt_state=opt_state
    )


def sample_features(feature_shapes: Mapping[str, Sequence[int]]) -> dict[str, jax.Array]:
    return {layer: jnp.zeros((1, *shape), jnp.float32) for layer, shape in feature_shapes.items()}


def topk_correct(
    logits: jax.Array,
    labels: jax.Array,
    ks: Sequence[int] = (1, 5),
    classes: Sequence[int] | None = None,
) -> dict:
    """Per-example booleans: is the label among the ``k`` highest logits, for each k. With
    ``classes`` only those outputs compete (ImageNet-A/-R's 200 of ImageNet's 1000); a label
    outside them is never found."""
    if classes is not None:
        kept = jnp.asarray(classes, jnp.int32)
        top = kept[jax.lax.top_k(logits[..., kept], min(max(ks), len(classes)))[1]]
    else:
        top = jax.lax.top_k(logits, min(max(ks), logits.shape[-1]))[1]
    hits = top == labels[..., None]
    return {f"top{k}": jnp.any(hits[..., :k], axis=-1) for k in ks}


def make_train_step(
    heads: LinearHeads,
    grid_opt: linear_grid.GridOptimizer,
    mesh: Mesh,
    features_fn: FeaturesFn,
) -> Callable[[LinearState, PyTree, Any], tuple[LinearState, dict[str, jax.Array]]]:
    """``(state, trunk_variables, batch) -> (state, metrics)``, jitted over ``mesh``.

    ``batch`` is ``{"inputs", "label"}`` sharded on ``data``; the heads and the trunk are
    replicated. The state is donated, the trunk variables are not (they are reused). One
    trunk forward feeds every head; each group's heads run vmapped over the learning rates.

    Metrics: ``{layer}/loss`` and ``{layer}/top1`` (train batch) of each head, under
    ``{layer}/{point tag}/...`` when the grid has several points; ``learning_rate`` (or
    ``learning_rate/lr<base>``) at the step; ``loss``, the sum over layers of each layer's
    lowest finite loss, non-finite only when every point of a layer diverged.
    """
    grid = grid_opt.grid
    single = grid.size == 1

    def per_replica(state: LinearState, trunk: PyTree, batch: Any):
        feats = jax.lax.stop_gradient(features_fn(trunk, batch["inputs"]))
        labels = batch["label"]

        def loss_fn(params, batch_stats):
            variables = {"params": params, "batch_stats": batch_stats}
            logits, mutated = heads.apply(variables, feats, train=True, mutable=["batch_stats"])
            per_head = {
                layer: optax.softmax_cross_entropy_with_integer_labels(out, labels).mean()
                for layer, out in logits.items()
            }
            return sum(per_head.values()), (per_head, logits, mutated["batch_stats"])

        # The heads share no parameters: the gradient of the summed loss is each head's own.
        grad_fn = linear_grid.over_lrs(jax.value_and_grad(loss_fn, has_aux=True))
        learning_rates = grid_opt.learning_rates(state.step)
        params, batch_stats, opt_state = {}, {}, {}
        losses: dict[str, list] = {layer: [] for layer in heads.layers}
        metrics: dict[str, jax.Array] = {}
        for j, group in enumerate(grid.groups):
            (_, (per_head, logits, batch_stats[group])), grads = grad_fn(
                state.params[group], state.batch_stats[group]
            )
            # Equal local batches: the mean of per-replica means is the global mean.
            grads = jax.lax.pmean(grads, DATA_AXIS)
            params[group], opt_state[group] = grid_opt.update(
                j, grads, state.opt_state[group], state.params[group], learning_rates
            )
            for layer, out in logits.items():
                top1 = 100.0 * jnp.mean(topk_correct(out, labels, (1,))["top1"], axis=-1)
                losses[layer].append(per_head[layer])
                for i in range(len(grid.lrs)):
                    prefix = layer if single else f"{layer}/{grid.point(j, i).tag}"
                    metrics[f"{prefix}/loss"] = per_head[layer][i]
                    metrics[f"{prefix}/top1"] = top1[i]
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            batch_stats=batch_stats,  # already global means under sync BN
            opt_state=opt_state,
        )
        metrics, losses = jax.lax.pmean((metrics, losses), DATA_AXIS)
        lowest = [jnp.min(_finite_or_inf(jnp.concatenate(v))) for v in losses.values()]
        metrics["loss"] = sum(lowest)
        if single:
            metrics["learning_rate"] = learning_rates[0]
        else:
            for i, lr in enumerate(grid.lrs):
                metrics[f"learning_rate/lr{lr:g}"] = learning_rates[i]
        return new_state, metrics

    sharded = jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(P(), P(), P(DATA_AXIS)),
        out_specs=(P(), P()),
        # Replicated outputs stay consistent through the explicit pmeans (and sync BN).
        check_vma=False,
    )
    return jax.jit(sharded, donate_argnums=0)


def _finite_or_inf(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(x), x, jnp.inf)


def make_eval_step(
    heads: LinearHeads,
    grid: linear_grid.Grid,
    mesh: Mesh,
    features_fn: FeaturesFn,
    classes: Sequence[int] | None = None,
) -> Callable[[LinearState, PyTree, Any], dict]:
    """``(state, trunk_variables, batch) -> {group: {layer: {"top1", "top5"}}, "count"}``:
    correct predictions of every grid point (arrays over the group's learning rates) summed
    over the batch's real rows (``batch["mask"]``), heads in eval mode; with ``classes``,
    only those outputs compete (``topk_correct``) and ``"in_classes"`` counts the rows whose
    label is one of them."""

    def per_replica(state: LinearState, trunk: PyTree, batch: Any):
        feats = features_fn(trunk, batch["inputs"])
        mask = batch["mask"].astype(jnp.int32)

        def apply(params, batch_stats):
            return heads.apply({"params": params, "batch_stats": batch_stats}, feats, train=False)

        out: dict[str, Any] = {"count": jnp.sum(mask)}
        if classes is not None:  # rows whose label is one of the scored classes
            known = jnp.isin(batch["label"], jnp.asarray(classes, jnp.int32))
            out["in_classes"] = jnp.sum(known.astype(jnp.int32) * mask)
        for group in grid.groups:
            logits = linear_grid.over_lrs(apply)(state.params[group], state.batch_stats[group])
            out[group] = {}
            for layer, scores in logits.items():
                correct = topk_correct(scores, batch["label"], classes=classes)
                out[group][layer] = {
                    k: jnp.sum(v.astype(jnp.int32) * mask, axis=-1) for k, v in correct.items()
                }
        return jax.lax.psum(out, DATA_AXIS)

    sharded = jax.shard_map(
        per_replica, mesh=mesh, in_specs=(P(), P(), P(DATA_AXIS)), out_specs=P(), check_vma=False
    )
    return jax.jit(sharded)


def train_data_config(
    data_config: ml_collections.ConfigDict, crop_scale: Sequence[float]
) -> ml_collections.ConfigDict:
    """The data config of the linear heads' training images: one view, RandomResizedCrop and
    a horizontal flip only (VISSL's linear recipe), through jssl.data's deterministic train
    pipeline with colour distortion, blur and solarisation switched off."""
    out = data_config.copy_and_resolve_references()
    with out.unlocked():
        a = out.augment
        a.num_crops = (1,)
        a.crop_sizes = ()
        a.crop_scale = tuple(crop_scale)
        a.flip_prob = (0.5,)
        a.color_jitter_prob = (0.0,)
        a.grayscale_prob = (0.0,)
        a.blur_prob = (0.0,)
        a.solarize_prob = (0.0,)
        a.on_device = False  # the linear heads read the host's normalised float crops
    return out


def cached_train_batches(
    feats: Mapping[str, np.ndarray],
    labels: np.ndarray,
    *,
    batch_size: int,
    seed: int,
    epoch: int,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[dict[str, Any]]:
    """This process's rows of one shuffled epoch of cached features (last partial batch
    dropped): ``{"inputs": {layer: ...}, "label"}``. The order is a function of (seed, epoch)
    only, so a resumed run replays the same batches from ``start_step``."""
    local = batch_size // process_count
    order = np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(len(labels))
    for step in range(start_step, len(labels) // batch_size):
        rows = order[step * batch_size + process_index * local :][:local]
        # Sorted rows read memory-mapped files front to back; a batch is a set anyway.
        rows = np.sort(rows)
        yield {
            "inputs": {layer: np.asarray(x[rows], np.float32) for layer, x in feats.items()},
            "label": np.asarray(labels[rows], np.int32),
        }


def cached_eval_batches(
    feats: Mapping[str, np.ndarray],
    labels: np.ndarray,
    *,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[dict[str, Any]]:
    """Every cached row exactly once, in order, padded to full batches with mask=False:
    ``{"inputs": {layer: ...}, "label", "mask"}``; every process yields as many batches."""
    local = batch_size // process_count
    n = len(labels)
    for start in range(0, n, batch_size):
        first = start + process_index * local
        rows = np.arange(first, min(first + local, n))
        pad = local - len(rows)
        inputs = {}
        for layer, x in feats.items():
            part = (
                np.asarray(x[rows], np.float32)
                if len(rows)
                else np.zeros((0, *x.shape[1:]), np.float32)
            )
            inputs[layer] = np.concatenate([part, np.zeros((pad, *x.shape[1:]), np.float32)])
        label = np.concatenate([np.asarray(labels[rows], np.int32), np.zeros(pad, np.int32)])
        mask = np.arange(local) < len(rows)
        yield {"inputs": inputs, "label": label, "mask": mask}
