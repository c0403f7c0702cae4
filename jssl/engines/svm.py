"""The svm engine: VISSL's linear SVM benchmark on extracted features (``tools/train_svm.py``,
``vissl/utils/svm_utils/svm_trainer.py``; the protocol is ``jssl.evaluation.svm``'s).

For every layer in ``svm.layers`` it reads the train and test features of an
``extract_features`` run (``svm.features_dir``), trains one SVM per class with the cost chosen
by cross-validation on the train split, and writes ``workdir/results.json``: the figures of
each layer next to the protocol that produced them (the features' source, splits, targets,
every classifier setting, how the cost was chosen and how the test figure is computed), and
TensorBoard scalars ``svm/<layer>/<metric>``. Its start-up checks (``check_inputs``,
``load_pairs``) and protocol records (``protocol``, ``features_record``) serve the low-shot and
cluster engines too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np
from absl import logging

from jssl.evaluation import svm
from jssl.evaluation.results import load_json, make_writer, write_results

REFERENCE = "VISSL tools/train_svm.py, vissl/utils/svm_utils/svm_trainer.py"


def require_section(config: ml_collections.ConfigDict, section: str, config_file: str) -> None:
    """A config without the engine's section was not built by its config file."""
    if section not in config:
        raise ValueError(
            f"engine={config.engine!r} reads config.{section}, which this config lacks: start "
            f"from --config={config_file} (its presets set every {section}.* field)."
        )


def check_inputs(config: ml_collections.ConfigDict, field: str = "svm") -> None:
    """``<field>.features_dir``, ``layers``, ``train_split`` and ``test_split`` name data."""
    section = config[field]
    if not isinstance(section.features_dir, str) or not section.features_dir:
        raise ValueError(
            f"{field}.features_dir is empty: these evaluators read extracted features. Run "
            "--config=configs/extract_features.py first and pass its workdir, e.g. "
            f"--config.{field}.features_dir=runs/demo_features."
        )
    layers = tuple(section.layers)
    if not layers or not all(isinstance(layer, str) and layer for layer in layers):
        raise ValueError(
            f"{field}.layers={layers!r} must name extracted layers, e.g. "
            f"--config.{field}.layers='(\"avgpool\",)'."
        )
    for name in ("train_split", "test_split"):
        if not isinstance(section[name], str) or not section[name]:
            raise ValueError(f"{field}.{name}={section[name]!r} must name an extracted split.")


def load_pairs(config: ml_collections.ConfigDict, field: str = "svm"):
    """``{layer: (train, test)}`` split features, memory-mapped, checked against each other."""
    section = config[field]
    pairs = {}
    for layer in section.layers:
        train = svm.load_split(
            section.features_dir, section.train_split, layer, f"{field}.train_split"
        )
        test = svm.load_split(
            section.features_dir, section.test_split, layer, f"{field}.test_split"
        )
        svm.check_pair(train, test, f"{field}.layers {layer!r}")
        pairs[layer] = (train, test)
    return pairs


def features_record(features_dir: str, layer: str) -> dict[str, Any]:
    """What the features came from, as results.json records it: extract_features writes its
    config to ``features/config.json`` (trunk, data, pooling) and the checkpoint it read with
    its training step to ``features/source.json``."""
    root = svm.features_root(features_dir)
    record: dict[str, Any] = {"features_dir": os.path.abspath(root), "layer": layer}
    config = load_json(os.path.join(root, "config.json"))
    if config is None:
        record["source"] = f"not recorded ({os.path.join(root, 'config.json')} is missing)"
        return record
    checkpoint = config.get("init", {}).get("checkpoint", "")
    source = load_json(os.path.join(root, "source.json")) or {}
    match = re.search(r"checkpoints/(\d+)/?$", checkpoint)
    record.update(
        checkpoint=source.get("checkpoint_dir", checkpoint),
        checkpoint_step=source.get("checkpoint_step", int(match.group(1)) if match else None),
        trunk=config.get("model", {}).get("trunk"),
        image_size=config.get("data", {}).get("image_size"),
        data_source=config.get("data", {}).get("source"),
        dataset=config.get("data", {}).get("name") or config.get("data", {}).get("source"),
        pool=layer_pool(config.get("extract", {}).get("pool", "none"), layer),
    )
    if record["checkpoint_step"] is None:
        record["checkpoint_step_note"] = source.get(
            "checkpoint_step_note",
            f"not recorded: {root} has no source.json naming the checkpoint read",
        )
    return record


def layer_pool(spec: Any, layer: str) -> str:
    """The pooling spec of ``layer`` in an extract/linear ``pool`` field ("a=spec;b=spec")."""
    if isinstance(spec, str) and "=" in spec:
        pairs = dict(item.split("=", 1) for item in spec.split(";") if item.strip())
        return {k.strip(): v.strip() for k, v in pairs.items()}.get(layer, "none")
    return str(spec)


def summarize(result: Mapping[str, Any], test: svm.SplitFeatures, metric: str, costs) -> dict:
    """The figures of one layer as results.json records them (in %)."""
    ap = result["ap"]
    valid = ~np.isnan(ap)
    out: dict[str, Any] = {"mAP": 100.0 * float(ap[valid].mean()) if valid.any() else None}
    if not test.multi_label:
        out["top1"] = svm.top1(result["scores"], test.targets)
    out["metric"] = svm.resolve_metric(metric, test.multi_label)
    out["value"] = out[out["metric"]]
    out["per_class"] = [
        {
            "class": cls,
            "ap": None if np.isnan(ap[cls]) else 100.0 * float(ap[cls]),
            "cost": float(result["costs"][cls]),
            "cv_ap": [round(100.0 * float(v), 4) for v in result["cv_ap"][cls]],
        }
        for cls in range(len(ap))
    ]
    out["chosen_costs"] = cost_counts(result["costs"], costs)
    missing = np.flatnonzero(~valid).tolist()
    if missing:
        out["classes_without_test_positives"] = missing
    return out


def cost_counts(chosen: np.ndarray, costs: Sequence[float]) -> dict[str, int]:
    """How many classes chose each cost of the grid."""
    return {str(c): int(np.sum(np.asarray(chosen) == c)) for c in costs}


def validate(config: ml_collections.ConfigDict) -> None:
    """The svm engine's start-up checks, run before anything is written to the workdir."""
    require_section(config, "svm", "configs/svm.py")
    svm.check_settings(config.svm)
    check_inputs(config)
    for layer, (train, test) in load_pairs(config).items():
        svm.resolve_metric(config.svm.metric, train.multi_label)
        svm.check_train_classes(
            train,
            svm.num_classes(train, test),
            config.svm.cross_val_folds,
            f"svm.train_split={config.svm.train_split!r} (layer {layer!r})",
        )


def targets_record(train: svm.SplitFeatures, classes: int) -> str:
    if train.multi_label:
        return (
            f"multi-label over {classes} classes: 1 present, 0 absent, -1 difficult (a negative "
            "in training, left out of the test AP), as VISSL's VOC07 targets"
        )
    return f"single-label, {classes} classes (one-vs-rest: the class +1, every other -1)"


def protocol(config: ml_collections.ConfigDict, field: str, layer: str, train, test) -> dict:
    """What every figure of ``layer`` depends on: data, features, classifier settings."""
    section = config[field]
    settings = svm.Settings.from_config(section, config.seed)
    classes = svm.num_classes(train, test)
    return {
        "features": features_record(section.features_dir, layer),
        "train_split": section.train_split,
        "test_split": section.test_split,
        "num_train": len(train),
        "num_test": len(test),
        "feature_dims": int(train.features.shape[1]),
        "num_classes": classes,
        "targets": targets_record(train, classes),
        "classifier": (
            "one binary sklearn.svm.LinearSVC per class (liblinear), random_state = seed"
        ),
        "settings": settings.record(),
        "normalization": (
            "x / (||x||_2 + 1e-5) in float64 (VISSL's _normalize_features)"
            if settings.normalize
            else "none (svm.normalize=False)"
        ),
        "test_metric": (
            "per class, VISSL's get_precision_recall AP of the decision function on the test "
            "split: the area under the interpolated precision envelope at every recall step "
            "(VOC 2010+ all-points AP, not VOC07's 11-point); mAP: the mean over classes with "
            "a positive test example; top1 (single-label): arg-max of the classes' decision "
            "functions; all in %"
        ),
    }


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains and tests the SVMs of every layer; returns (and writes) the results::

    {"evaluator": "svm", "reference": ..., "layers": {"avgpool": {"protocol": {...},
     "cost_selection": ..., "mAP": .., "top1": .., "metric": "top1", "value": ..,
     "per_class": [{"class", "ap", "cost", "cv_ap"}, ...], "chosen_costs": {...}}}}
    """
    validate(config)
    scfg = config.svm
    settings = svm.Settings.from_config(scfg, config.seed)
    writer = make_writer(workdir)
    results: dict[str, Any] = {"evaluator": "svm", "reference": REFERENCE, "layers": {}}
    for layer, (train, test) in load_pairs(config).items():
        classes = svm.num_classes(train, test)
        logging.info(
            "SVM %s: %d train / %d test examples, %d dims, %d classes, %d costs x %d folds",
            layer,
            len(train),
            len(test),
            train.features.shape[1],
            classes,
            len(settings.costs),
            settings.cross_val_folds,
        )
        outcome = svm.train_and_test(train, test, settings, classes)
        figures = summarize(outcome, test, scfg.metric, settings.costs)
        record = {
            "protocol": protocol(config, "svm", layer, train, test),
            "cost_selection": (
                f"per class, the cost of the best mean average precision (sklearn's "
                f"average_precision scorer) over stratified {settings.cross_val_folds}-fold "
                "cross-validation (no shuffling) on the train split, first of ties; the "
                "model is then refit on the whole train split; the test split selects nothing"
            ),
            **figures,
        }
        results["layers"][layer] = record
        shown = ", ".join(
            f"{name} {figures[name]:.2f}"
            for name in ("mAP", "top1")
            if figures.get(name) is not None
        )
        logging.info("SVM %s: %s (chosen costs %s)", layer, shown, figures["chosen_costs"])
        print(f"SVM {layer}: {shown}", flush=True)
        writer.write_scalars(
            0,
            {
                f"svm/{layer}/{name}": figures[name]
                for name in ("mAP", "top1")
                if isinstance(figures.get(name), float) and np.isfinite(figures[name])
            },
        )
    writer.flush()
    write_results(workdir, results)
    return results
