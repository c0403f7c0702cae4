"""results.json of the linear_eval engine: every figure next to the protocol that produced it,
in the shape of the other evaluators' records (``jssl.engines.svm``)::

    {"evaluator": "linear", "reference": ...,
     "layers": {"res5": {"protocol": {...}, "selection": "...", "top1": .., "top5": ..,
                         "chosen": {"lr", "weight_decay", "tag"},
                         "grid": [{"lr", "weight_decay", "tag", "held_out_top1",
                                   "held_out_top5", "finite", "chosen"}, ...],
                         "test_every_point": {...},          # linear.report_all only
                         "extra_test_sets": {"imagenet_a:test": {"protocol": {...},
                                                                 "top1": .., "top5": ..}}}}}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np
from absl import logging

from jssl import optim
from jssl.engines import svm as svm_engine
from jssl.engines.linear_eval_inputs import Inputs
from jssl.evaluation import linear_grid, robustness_sets

REFERENCE = (
    "VISSL configs/config/benchmark/linear_image_classification/imagenet1k/"
    "eval_resnet_8gpu_transfer_in1k_linear.yaml (heads, recipe); DINOv2 dinov2/eval/linear.py "
    "(learning-rate grid, robustness test sets)"
)
ALL_POINTS_NOTE = (
    "the test figures of every grid point, for reference only: they were not used to choose, "
    "and quoting the best of them would choose on the test split"
)


def source_record(config: ml_collections.ConfigDict, inputs: Inputs, layer: str) -> dict:
    """Where the features came from: the trunk's checkpoint and step, or the extraction."""
    if config.linear.cached_features:
        return svm_engine.features_record(config.linear.cached_features, layer)
    return dict(inputs.source)


def training_record(
    config: ml_collections.ConfigDict, grid: linear_grid.Grid, chosen: linear_grid.Point, steps
) -> dict:
    """The heads' training: grid, chosen point, optimizer, schedule, data."""
    point_optim = grid.optim_config(config.optim, chosen)
    if config.linear.cached_features:
        augmentation = (
            "none: cached features of the evaluation view (resize + centre crop), the same "
            "features every epoch"
        )
    else:
        low, high = config.linear.crop_scale
        augmentation = (
            f"RandomResizedCrop to {config.data.image_size} px (scale {low}-{high}) and a "
            "horizontal flip with probability 0.5, nothing else (VISSL's linear recipe)"
        )
    settings = {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in config.optim.to_dict().items()
        if k not in ("base_lr", "weight_decay")  # the grid point's
    }
    return {
        "grid": {
            "lrs": list(grid.lrs),
            "weight_decays": list(grid.weight_decays),
            "points": grid.size,
            "lr_unit": f"per {config.optim.base_lr_batch_size} examples (optim.base_lr_batch_size)",
        },
        "chosen": {
            "lr": chosen.lr,
            "weight_decay": chosen.weight_decay,
            "peak_lr": optim.peak_learning_rate(point_optim, config.data.batch_size),
        },
        "epochs": config.num_epochs,
        "steps": int(steps),
        "batch_size": config.data.batch_size,
        "optimizer": settings,
        "augmentation": augmentation,
        "seed": config.seed,
    }


def protocol(
    config: ml_collections.ConfigDict,
    inputs: Inputs,
    grid: linear_grid.Grid,
    layer: str,
    chosen: linear_grid.Point,
    *,
    steps: int,
    num_test: int,
) -> dict:
    """What the figures of ``layer`` depend on."""
    lcfg, splits = config.linear, inputs.splits
    shape = inputs.shapes[layer]
    if lcfg.cached_features:
        mode = "offline: frozen trunk, features cached on disk by extract_features"
    else:
        mode = "offline: frozen trunk (eval mode, running BN statistics), one forward per batch"
    return {
        "evaluation": mode,
        "source": source_record(config, inputs, layer),
        "dataset": config.data.name or config.data.source,
        "train_split": splits.train,
        "num_train": splits.num_train,
        "held_out_split": splits.held_out,
        "num_held_out": splits.num_held_out,
        "held_out_rule": splits.rule,
        "test_split": splits.test,
        "num_test": num_test,
        "layer": layer,
        "pool": (
            "as extracted"
            if lcfg.cached_features
            else svm_engine.layer_pool(lcfg.pool, layer) or "none"
        ),
        "feature_shape": list(shape),
        "feature_dims": int(np.prod(shape)),
        "num_classes": lcfg.num_classes,
        "head": (
            "BatchNorm (eps 1e-5, momentum 0.1, statistics over the "
            f"{'global' if lcfg.sync_bn else 'per-device'} batch) over the channels, flatten, "
            "Linear with PyTorch's initialisation (VISSL's eval_mlp); every grid point starts "
            "from the same head"
        ),
        "training": training_record(config, grid, chosen, steps),
        "test_metric": (
            "top-1 and top-5 accuracy in % of the chosen head on every example of the test "
            "split once, evaluation view (resize + centre crop), heads in eval mode"
        ),
    }


def selection(grid: linear_grid.Grid, inputs: Inputs) -> str:
    splits = inputs.splits
    if splits.held_out is None:
        return (
            "none: a one-point grid and nothing held out (linear.val_fraction=0); the figure "
            "is that point's"
        )
    return (
        f"per layer, the point of the {grid.size}-point grid (linear.lrs x "
        f"linear.weight_decays) with the best top-1 on the held-out part {splits.held_out} "
        f"({splits.num_held_out} examples, evaluation view), first of ties in grid order "
        "(learning rates outer, weight decays inner); points whose parameters are not finite "
        "are excluded; the test split and the extra test sets select nothing"
    )


def grid_rows(
    grid: linear_grid.Grid,
    held_out: Sequence[Mapping[str, float]] | None,
    finite: Sequence[bool],
    chosen: linear_grid.Point,
) -> list[dict]:
    return [
        {
            "lr": p.lr,
            "weight_decay": p.weight_decay,
            "tag": p.tag,
            "held_out_top1": None if held_out is None else held_out[p.index]["top1"],
            "held_out_top5": None if held_out is None else held_out[p.index]["top5"],
            "finite": bool(finite[p.index]),
            "chosen": p.index == chosen.index,
        }
        for p in grid.points
    ]


def all_points(grid: linear_grid.Grid, test: Sequence[Mapping[str, float]]) -> dict:
    points = [
        {"lr": p.lr, "weight_decay": p.weight_decay, "tag": p.tag, **test[p.index]}
        for p in grid.points
    ]
    return {"note": ALL_POINTS_NOTE, "points": points}


def extra_set_record(
    spec: str,
    classes: tuple[int, ...] | None,
    num_classes: int,
    totals: Mapping[str, Any],
    figures: Mapping[str, float],
) -> dict:
    """One robustness set's figures of one layer's chosen head, with their protocol."""
    name, split = robustness_sets.parse(spec)
    count = int(totals["count"])
    outside = count - int(totals["in_classes"]) if classes is not None else 0
    return {
        "protocol": {
            "dataset": name,
            "split": split,
            "num_examples": count,
            "scored_classes": len(classes) if classes is not None else num_classes,
            "prediction": robustness_sets.subset_record(name, classes, num_classes),
            "examples_outside_classes": outside,
            "view": "evaluation view (resize + centre crop), as the test split",
            "head": "the head reported on the test split (this set chooses nothing)",
        },
        **figures,
    }


def layer_record(
    config: ml_collections.ConfigDict,
    inputs: Inputs,
    grid: linear_grid.Grid,
    layer: str,
    point: linear_grid.Point,
    *,
    steps: int,
    test: tuple[Mapping[str, Any], Sequence[Mapping[str, float]]],
    held_out: Sequence[Mapping[str, float]] | None,
    finite: Sequence[bool],
    extra: Mapping[str, tuple],
) -> dict:
    """The entry of ``layer``: its chosen ``point``'s test figures (``test``: the test split's
    totals and every point's figures) with their protocol, the grid, and the extra sets
    (``{spec: (classes, totals, every point's figures)}``); logged as well."""
    lcfg = config.linear
    totals, points = test
    figures = points[point.index]
    entry = {
        "protocol": protocol(
            config, inputs, grid, layer, point, steps=steps, num_test=int(totals["count"])
        ),
        "selection": selection(grid, inputs),
        **figures,
        "chosen": {"lr": point.lr, "weight_decay": point.weight_decay, "tag": point.tag},
        "grid": grid_rows(grid, held_out, finite, point),
    }
    if lcfg.report_all:
        entry["test_every_point"] = all_points(grid, points)
    if extra:
        entry["extra_test_sets"] = {
            spec: extra_set_record(
                spec, classes, lcfg.num_classes, set_totals, set_scores[point.index]
            )
            for spec, (classes, set_totals, set_scores) in extra.items()
        }
    shown = ", ".join(
        f"{spec} {v['top1']:.2f}" for spec, v in entry.get("extra_test_sets", {}).items()
    )
    logging.info(
        "Linear eval %s (%s): top-1 %.2f, top-5 %.2f%s",
        layer,
        point.tag,
        figures["top1"],
        figures["top5"],
        f"; {shown}" if shown else "",
    )
    return entry


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The chosen heads' test figures (``test/<layer>/top1``) and the extra sets'."""
    out = {}
    for layer, entry in record["layers"].items():
        out.update({f"test/{layer}/{k}": entry[k] for k in ("top1", "top5")})
        for spec, figures in entry.get("extra_test_sets", {}).items():
            out.update({f"extra/{spec}/{layer}/{k}": figures[k] for k in ("top1", "top5")})
    return out
