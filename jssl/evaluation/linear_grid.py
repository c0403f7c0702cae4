"""A grid of linear heads trained at once, and the choice of one head per layer.

Every layer of ``linear.layers`` gets one head per point of ``linear.lrs`` x
``linear.weight_decays``, all trained on the same batches with one trunk forward per batch: the
heads of a weight decay are stacked and ``jax.vmap``-ped over the learning rates
(``GridOptimizer``). Every point starts from the same head, so point (lr, wd) trains exactly
the head a run with that lr and wd alone would. The idea is DINOv2's linear evaluation
(``dinov2/eval/linear.py``: ``setup_linear_classifiers``, ``scale_lr``,
``evaluate_linear_classifiers``), on VISSL's heads (``evaluation.linear``) with any
``config.optim`` and an optional weight-decay axis. Unlike DINOv2, which keeps the best
classifier on the split it reports, ``select`` chooses on data held out of the train split (or
``linear.val_split``); the test split chooses nothing. More: docs/evaluation.md, "Linear
evaluation".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from jssl import optim

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Point:
    """One (base learning rate, weight decay) of the grid."""

    index: int  # position in grid order
    lr_index: int
    wd_index: int
    lr: float  # base rate, per optim.base_lr_batch_size examples
    weight_decay: float

    @property
    def tag(self) -> str:
        """Its name in metrics and results: ``lr0.01_wd0.0005``."""
        return f"lr{self.lr:g}_wd{self.weight_decay:g}"


@dataclasses.dataclass(frozen=True)
class Grid:
    """``lrs`` x ``weight_decays``; () in the config means optim.base_lr / weight_decay."""

    lrs: tuple[float, ...]
    weight_decays: tuple[float, ...]

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> Grid:
        lcfg = config.linear
        lrs = tuple(float(v) for v in lcfg.lrs) or (float(config.optim.base_lr),)
        wds = tuple(float(v) for v in lcfg.weight_decays) or (float(config.optim.weight_decay),)
        return cls(lrs, wds)

    @property
    def size(self) -> int:
        return len(self.lrs) * len(self.weight_decays)

    @property
    def points(self) -> tuple[Point, ...]:
        return tuple(
            Point(i * len(self.weight_decays) + j, i, j, lr, wd)
            for i, lr in enumerate(self.lrs)
            for j, wd in enumerate(self.weight_decays)
        )

    @property
    def groups(self) -> tuple[str, ...]:
        """The state's keys: one group of stacked heads per weight decay."""
        return tuple(f"wd{j}" for j in range(len(self.weight_decays)))

    def point(self, group: int, lr_index: int) -> Point:
        return self.points[lr_index * len(self.weight_decays) + group]

    def optim_config(
        self, optim_config: ml_collections.ConfigDict, point: Point
    ) -> ml_collections.ConfigDict:
        """``config.optim`` with the point's base rate and weight decay."""
        out = optim_config.copy_and_resolve_references()
        with out.unlocked():
            out.base_lr = point.lr
            out.weight_decay = point.weight_decay
        return out


def check_config(config: ml_collections.ConfigDict) -> None:
    """Start-up checks of ``linear.lrs``, ``linear.weight_decays``, ``linear.val_fraction``,
    ``linear.val_split`` and ``linear.report_all``; each failure names the field and the fix."""
    lcfg = config.linear
    for field, low, example in (
        ("lrs", "> 0", "(0.001, 0.01, 0.1)"),
        ("weight_decays", ">= 0", "(0.0, 5e-4)"),
    ):
        values = tuple(lcfg[field])
        bad = [
            v
            for v in values
            if isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not math.isfinite(v)
            or (v <= 0 if field == "lrs" else v < 0)
        ]
        if bad:
            raise ValueError(
                f"linear.{field}={values!r}: every value must be a finite number {low} (got "
                f"{bad[0]!r}); e.g. --config.linear.{field}='{example}', or () for "
                f"optim.{'base_lr' if field == 'lrs' else 'weight_decay'} alone."
            )
        if len(set(values)) != len(values):
            raise ValueError(
                f"linear.{field}={values!r} repeats a value: each point would train twice. "
                "List each value once."
            )
    fraction = lcfg.val_fraction
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, (int, float))
        or not 0 <= fraction < 1
    ):
        raise ValueError(
            f"linear.val_fraction={fraction!r} must be in [0, 1): the share of the train split "
            "held out to choose each layer's head, e.g. --config.linear.val_fraction=0.1."
        )
    val_split = lcfg.get("val_split", "")
    if not isinstance(val_split, str):
        raise ValueError(f"linear.val_split={val_split!r} must name a split, or '' for none.")
    if val_split and fraction > 0:
        raise ValueError(
            f"linear.val_split={val_split!r} and linear.val_fraction={fraction} both name a "
            "held-out part: choose on the split (--config.linear.val_fraction=0) or on the "
            "train split's tail (--config.linear.val_split='')."
        )
    if val_split and val_split in (config.data.train_split, config.data.test_split):
        raise ValueError(
            f"linear.val_split={val_split!r} is the train or test split: the heads must be "
            "chosen on examples they neither train nor are scored on."
        )
    grid = Grid.from_config(config)
    if fraction == 0 and not val_split and grid.size > 1:
        raise ValueError(
            f"linear.val_fraction=0 holds nothing out, but the grid has {grid.size} points "
            f"(linear.lrs={grid.lrs}, linear.weight_decays={grid.weight_decays}): the head "
            "would be chosen on the test split. Set --config.linear.val_fraction=0.1, a "
            "validation split (--config.linear.val_split=validation), or a one-point grid "
            "(--config.linear.lrs='(0.01,)' --config.linear.weight_decays='(5e-4,)')."
        )
    if not isinstance(lcfg.report_all, bool):
        raise ValueError(f"linear.report_all={lcfg.report_all!r} must be True or False.")


class GridOptimizer:
    """The optax chains and learning-rate schedules of every grid point.

    ``init`` and ``update`` work on a group's stacked heads (leading axis: the grid's
    learning rates), vmapped; ``learning_rates(step)`` is each rate at the step. The chain is
    ``jssl.optim.build_optimizer``'s at a constant rate, fed each point's own schedule
    (``optim.build_schedule``) at the step: the numbers the schedule-driven chain uses. Weight
    decay enters the optimizers in different ways (coupled for SGD and LARS, inside LARC's
    trust ratio, decoupled for AdamW), so each value gets a chain of its own."""

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        grid: Grid,
        head_params: PyTree,
        steps_per_epoch: int,
    ):
        """``head_params``: the parameters (or their shapes) of one set of heads,
        ``{layer: {"bn", "fc"}}``, for the weight-decay masks."""
        self.grid = grid
        first = {p.lr_index: p for p in reversed(grid.points)}  # a point of each lr
        self.schedules = tuple(
            optim.build_schedule(
                grid.optim_config(config.optim, first[i]),
                steps_per_epoch=steps_per_epoch,
                num_epochs=config.num_epochs,
                global_batch=config.data.batch_size,
            )
            for i in range(len(grid.lrs))
        )
        self._configs = tuple(
            grid.optim_config(config.optim, grid.point(j, 0)) for j in range(len(grid.groups))
        )
        self._head_params = head_params

    def tx(self, group: int, learning_rate: Any) -> optax.GradientTransformation:
        """The chain of the group's weight decay at a constant ``learning_rate``."""
        return optim.build_optimizer(self._configs[group], self._head_params, learning_rate)

    def learning_rates(self, step: jax.Array) -> jax.Array:
        """(n_lrs,) float32: each grid learning rate's schedule at ``step``."""
        return jnp.stack([jnp.asarray(s(step), jnp.float32) for s in self.schedules])

    def init(self, group: int, stacked_params: PyTree) -> PyTree:
        return over_lrs(self.tx(group, 0.0).init)(stacked_params)

    def update(self, group: int, grads, opt_state, params, learning_rates):
        """New (params, opt_state) of the group's stacked heads."""

        def one(g, state, p, lr):
            updates, state = self.tx(group, lr).update(g, state, p)
            return optax.apply_updates(p, updates), state

        return over_lrs(one)(grads, opt_state, params, learning_rates)


def over_lrs(fn):
    """``jax.vmap(fn)`` over the leading (learning-rate) axis of every argument; with one
    learning rate, ``fn`` on the unstacked arguments, so that a one-point grid runs the very
    operations of a single head (vmap may order a matmul's sums differently)."""
    vmapped = jax.vmap(fn)

    def call(*args):
        if jax.tree.leaves(args)[0].shape[0] != 1:
            return vmapped(*args)
        out = fn(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: jnp.asarray(x)[None], out)

    return call


def stack(tree: PyTree, n: int) -> PyTree:
    """``n`` copies of every leaf on a new leading axis."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), tree)


def finite_points(grid: Grid, params: Mapping[str, PyTree], layers: Sequence[str]) -> dict:
    """``{layer: [bool per point, grid order]}``: are the head's parameters all finite
    (reduced on the devices: only one flag per head and leaf comes to the host)."""
    flags = jax.device_get(
        jax.tree.map(lambda x: jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim))), params)
    )
    out = {}
    for layer in layers:
        out[layer] = []
        for point in grid.points:
            leaves = jax.tree.leaves(flags[grid.groups[point.wd_index]][layer])
            out[layer].append(all(bool(leaf[point.lr_index]) for leaf in leaves))
    return out


def point_scores(grid: Grid, totals: Mapping[str, Any], layers: Sequence[str]) -> dict:
    """``{layer: [{"top1", "top5"} in %, per point in grid order]}`` from an evaluation's
    summed counts (``evaluation.linear.make_eval_step``)."""
    count = max(int(totals["count"]), 1)
    return {
        layer: [
            {
                k: 100.0 * float(totals[grid.groups[p.wd_index]][layer][k][p.lr_index]) / count
                for k in ("top1", "top5")
            }
            for p in grid.points
        ]
        for layer in layers
    }


def select(
    grid: Grid,
    held_out: Mapping[str, Sequence[Mapping[str, float]]] | None,
    finite: Mapping[str, Sequence[bool]],
) -> dict[str, Point]:
    """Each layer's chosen point: the best held-out top-1 among finite points, first of
    ties in grid order (learning rates outer, weight decays inner); with nothing held out,
    the one-point grid's point."""
    chosen = {}
    for layer, flags in finite.items():
        candidates = [p for p in grid.points if flags[p.index]]
        if not candidates:
            raise FloatingPointError(
                f"Every head of {layer!r} has non-finite parameters: the learning rates "
                f"linear.lrs={grid.lrs} are too large for it; lower them."
            )
        if held_out is None:
            if grid.size != 1:
                raise ValueError("A grid of several points needs held-out data to choose.")
            chosen[layer] = candidates[0]
            continue
        scores = held_out[layer]
        # max keeps the first of equal keys: the first of ties in grid order.
        chosen[layer] = max(candidates, key=lambda p: scores[p.index]["top1"])
    return chosen
