"""Low-shot linear SVMs on frozen features: VISSL's low-shot benchmark
(``tools/train_svm_low_shot.py``, ``vissl/utils/svm_utils/svm_low_shot_trainer.py``, the
samples of ``extra_scripts/create_low_shot_samples.py``; the recipes
``configs/config/benchmark/low_shot_transfer/{voc07,places205}/*_low_shot_svm.yaml``).

For every k and each of several samples, the SVMs of ``jssl.evaluation.svm`` train on a sample
of the train split (multi-label: per class, k positives and (C - 1) * k negatives, as
``generate_voc07_low_shot_samples``; single-label: k examples of every class, as
``generate_places_low_shot_samples``) and are scored on the whole test split; each k reports
the mean, std, min and max over the samples. A sample is keyed by (seed, sample, k) alone.
Deliberately unlike VISSL, which keeps the cost of best mean *test* mAP, the cost is chosen by
cross-validation on each sample's own train examples (``cost_selection``; k = 1 uses
``low_shot.cost``), and VISSL's per-cost test table is recorded beside it, labelled so. More
(and the other differences): docs/evaluation.md, "Low-shot SVMs".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jssl.evaluation import svm
from jssl.evaluation.svm import Settings, SplitFeatures

DEFAULT_KS = (1, 2, 4, 8, 16, 32, 64, 96)
SELECTIONS = ("cross_validation", "cross_validation_per_class", "fixed")


def sample_rng(seed: int, sample: int, k: int) -> np.random.Generator:
    """The generator of sample ``sample`` at ``k``: a function of the three alone."""
    return np.random.default_rng(np.random.SeedSequence([seed % 2**63, sample, k]))


def sample_multi_label(targets: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """VISSL's VOC07 low-shot targets: an (n, C) matrix of -1 (not drawn) with, in each
    column, k rows drawn among the positives set to 1 and (C - 1) * k drawn among the
    negatives set to 0; columns drawn in order from one generator."""
    classes = targets.shape[1]
    out = np.full(targets.shape, -1, np.int8)
    for cls in range(classes):
        positives = np.flatnonzero(targets[:, cls] == 1)
        negatives = np.flatnonzero(targets[:, cls] == 0)
        out[rng.choice(positives, k, replace=False), cls] = 1
        out[rng.choice(negatives, (classes - 1) * k, replace=False), cls] = 0
    return out


def sample_single_label(
    labels: np.ndarray, k: int, classes: int, rng: np.random.Generator
) -> np.ndarray:
    """VISSL's Places205 low-shot sample: k rows of every class, sorted."""
    drawn = [rng.choice(np.flatnonzero(labels == cls), k, replace=False) for cls in range(classes)]
    return np.sort(np.concatenate(drawn))


def check_ks(targets: np.ndarray, ks: Sequence[int], classes: int, field="low_shot.ks") -> None:
    """Every k must be drawable for every class: k positives (and, multi-label, (C - 1) * k
    negatives) without replacement. Raises naming the class, its count and the largest k."""
    if targets.ndim == 2:
        positives = (targets == 1).sum(0)
        negatives = (targets == 0).sum(0)
        limit = np.minimum(positives, negatives // max(classes - 1, 1))
    else:
        positives = np.bincount(targets, minlength=classes)[:classes]
        negatives = None
        limit = positives
    largest = int(limit.min()) if len(limit) else 0
    for k in ks:
        short = np.flatnonzero(limit < k)
        if short.size:
            cls = int(short[0])
            counts = f"{int(positives[cls])} positive"
            if negatives is not None:
                counts += f" and {int(negatives[cls])} negative"
            fix = (
                f"The largest k every class allows is {largest}: drop the larger ks."
                if largest >= 1
                else "No k can be drawn: use a train split (svm.train_split) with examples of "
                "every class."
            )
            raise ValueError(
                f"{field}={tuple(ks)}: k={k} examples per class cannot be drawn for class {cls}, "
                f"which has {counts} train examples (a sample needs k positives"
                + (f" and {classes - 1} * k negatives" if negatives is not None else "")
                + f"). {fix}"
            )


def _class_rows(train_targets, drawn, cls: int, multi_label: bool):
    """(rows of the class's training set, their +1 / -1 labels) in one sample."""
    if multi_label:
        rows = np.flatnonzero(drawn[:, cls] != -1)
        return rows, np.where(drawn[rows, cls] == 1, 1, -1)
    return drawn, np.where(train_targets[drawn] == cls, 1, -1)


def _run_sample(
    x_train: np.ndarray,
    train_targets: np.ndarray,
    x_test: np.ndarray,
    test_targets: np.ndarray,
    sample: int,
    k: int,
    settings: Settings,
    selection: str,
    fixed_cost: float,
    classes: int,
) -> dict[str, Any]:
    """One sample at one k: per-class SVMs for every cost, the chosen ones, test figures."""
    multi_label = train_targets.ndim == 2
    rng = sample_rng(settings.seed, sample, k)
    if multi_label:
        drawn = sample_multi_label(train_targets, k, rng)
    else:
        drawn = sample_single_label(train_targets, k, classes, rng)
    folds = min(settings.cross_val_folds, k)
    cross_validate = selection.startswith("cross_validation") and folds >= 2
    costs = settings.costs
    per_cost = np.zeros((len(costs), classes, x_train.shape[1] + 1))
    cv_ap = np.zeros((classes, len(costs)))
    fixed = np.zeros_like(per_cost[0])  # low_shot.cost's SVMs when it is not in the grid
    for cls in range(classes):
        rows, y = _class_rows(train_targets, drawn, cls, multi_label)
        x = x_train[rows]
        for i, cost in enumerate(costs):
            per_cost[i, cls] = svm.fit(x, y, settings, cost)
        if cross_validate:
            cv_ap[cls] = svm.cross_validated_ap(x, y, settings, folds)
        elif fixed_cost not in costs:
            fixed[cls] = svm.fit(x, y, settings, fixed_cost)
    if not cross_validate:
        same = [i for i, c in enumerate(costs) if c == fixed_cost]
        chosen_weights = per_cost[same[0]] if same else fixed
        chosen_costs = [fixed_cost] * classes
    elif selection == "cross_validation_per_class":
        best = np.argmax(cv_ap, axis=1)  # the first of equal scores, as np.argmax
        chosen_weights = per_cost[best, np.arange(classes)]
        chosen_costs = [costs[i] for i in best]
    else:  # one cost for all classes: the best mean cross-validated AP over the classes
        best = int(np.argmax(cv_ap.mean(0)))
        chosen_weights = per_cost[best]
        chosen_costs = [costs[best]] * classes
    chosen = _test(x_test, test_targets, chosen_weights, classes)
    table = [_test(x_test, test_targets, per_cost[i], classes) for i in range(len(costs))]
    return {
        "chosen": chosen,
        "per_cost": {name: [t[name] for t in table] for name in chosen},
        "costs": chosen_costs,
        "cross_validated": cross_validate,
        "folds": folds,
    }


def _test(x_test, test_targets, weights, classes) -> dict[str, float]:
    scores = svm.decision(x_test, weights).reshape(len(x_test), classes)
    aps = [
        svm.average_precision(*svm.labels_for_test(test_targets, scores[:, cls], cls))
        for cls in range(classes)
    ]
    out = {"mAP": 100.0 * float(np.nanmean(aps))}
    if test_targets.ndim == 1:
        out["top1"] = svm.top1(scores, test_targets)
    return out


def evaluate(
    train: SplitFeatures,
    test: SplitFeatures,
    settings: Settings,
    *,
    ks: Sequence[int] = DEFAULT_KS,
    num_samples: int = 5,
    selection: str = "cross_validation",
    fixed_cost: float = 1.0,
    metric: str = "auto",
) -> dict[str, Any]:
    """The low-shot figures of every k: ``{"k<k>": {...}}`` (see ``_aggregate``)."""
    if selection not in SELECTIONS:
        raise ValueError(f"cost selection {selection!r} is not one of {SELECTIONS}.")
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be >= 1.")
    classes = svm.num_classes(train, test)
    check_ks(train.targets, ks, classes)
    x_train = svm.l2_normalize(train.features) if settings.normalize else np.asarray(train.features)
    x_test = svm.l2_normalize(test.features) if settings.normalize else np.asarray(test.features)
    headline = svm.resolve_metric(metric, train.multi_label)
    data = (x_train, train.targets, x_test, test.targets)
    jobs = [
        (*data, s, k, settings, selection, fixed_cost, classes)
        for k in ks
        for s in range(1, num_samples + 1)  # VISSL's sample_inds 1..5
    ]
    runs = svm.run_jobs(_run_sample, jobs, settings.workers)
    results = {}
    for i, k in enumerate(ks):
        samples = runs[i * num_samples : (i + 1) * num_samples]
        results[f"k{k}"] = _aggregate(k, samples, settings, selection, fixed_cost, headline)
    return results


def _stats(values: Sequence[float]) -> dict[str, Any]:
    v = np.asarray(values, np.float64)
    return {
        "mean": float(v.mean()),
        "std": float(v.std()),
        "min": float(v.min()),
        "max": float(v.max()),
        "samples": [float(x) for x in v],
    }


def _aggregate(k, samples, settings: Settings, selection, fixed_cost, headline) -> dict:
    names = list(samples[0]["chosen"])
    out: dict[str, Any] = {"k": k, "metric": headline}
    for name in names:
        out[name] = _stats([s["chosen"][name] for s in samples])
    out["value"] = {key: out[headline][key] for key in ("mean", "std", "min", "max")}
    if samples[0]["cross_validated"]:
        scope = "each class its own" if selection.endswith("per_class") else "one for all classes"
        out["cost_selection"] = (
            f"{scope}: the best mean AP of stratified {samples[0]['folds']}-fold "
            "cross-validation on the sample's own train examples"
        )
    elif selection != "fixed":
        out["cost_selection"] = (
            f"fixed cost {fixed_cost} (low_shot.cost): k={k} gives each class fewer than 2 "
            "positives, too few to cross-validate"
        )
    else:
        out["cost_selection"] = f"fixed cost {fixed_cost} (low_shot.cost)"
    chosen = np.concatenate([np.asarray(s["costs"], np.float64) for s in samples])
    values, counts = np.unique(chosen, return_counts=True)
    out["chosen_costs"] = {str(c): int(n) for c, n in zip(values, counts, strict=True)}
    out["test_per_cost"] = {
        name: {
            str(cost): float(np.mean([s["per_cost"][name][i] for s in samples]))
            for i, cost in enumerate(settings.costs)
        }
        for name in names
    }
    return out
