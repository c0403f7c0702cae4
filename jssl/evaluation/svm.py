"""Linear SVMs on frozen features: VISSL's SVM benchmark (``tools/train_svm.py``,
``vissl/utils/svm_utils/svm_trainer.py``, ``evaluate.py``; the VOC07 recipe
``configs/config/benchmark/linear_image_classification/voc07/eval_resnet_8gpu_transfer_voc07_svm
.yaml``), and the classifiers of the low-shot benchmark. The features they read, shared with
the clustering evaluator: ``jssl.evaluation.split_features``.

As VISSL runs it: features L2-normalised in float64 (``x / (||x|| + 1e-5)``); one binary
``sklearn.svm.LinearSVC`` per class (one-vs-rest, ``class_weight={+1: 2, -1: 1}``), its cost
the grid's best mean AP of ``cross_val_score`` on the train split; each class's test AP in
VISSL's ``get_precision_recall`` form (VOC 2010+ "all points", not VOC07's 11-point AP).
Multi-label targets are VISSL's (n, C) matrix of 1 / 0 / -1 ("difficult"): -1 trains as a
negative and is left out of the test AP. Single-label targets also get top-1. The deliberate
differences from VISSL (a seeded solver, worker processes, only the chosen cost refit):
docs/evaluation.md, "Linear SVMs".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# The split's features and their class checks live in split_features; the evaluators read
# them through this module.
from jssl.evaluation.split_features import (  # noqa: F401
    SplitFeatures,
    binary_targets,
    check_pair,
    check_train_classes,
    features_root,
    load_split,
    num_classes,
    require_two_classes,
)

# VISSL's VOC07 SVM benchmark grid (eval_resnet_8gpu_transfer_voc07_svm.yaml).
VISSL_COSTS = (0.01, 0.1, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 50.0, 100.0, 1000.0)
METRICS = ("auto", "mAP", "top1")
LOSSES = ("squared_hinge", "hinge")
PENALTIES = ("l2", "l1")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The classifier settings of ``config.svm`` (VISSL's ``SVM`` section)."""

    costs: tuple[float, ...] = VISSL_COSTS
    cross_val_folds: int = 3
    loss: str = "squared_hinge"
    penalty: str = "l2"
    dual: bool = True
    max_iter: int = 2000
    tol: float = 1e-4
    positive_weight: float = 2.0  # VISSL: class_weight {1: 2, -1: 1}
    normalize: bool = True
    seed: int = 0
    workers: int = 1

    @classmethod
    def from_config(cls, svm_config: Mapping[str, Any], seed: int) -> Settings:
        names = [f.name for f in dataclasses.fields(cls) if f.name != "seed"]
        values = {name: svm_config[name] for name in names}
        values["costs"] = tuple(float(c) for c in values["costs"])
        return cls(seed=int(seed), **values)

    def record(self) -> dict[str, Any]:
        """The settings as results.json records them."""
        record = dataclasses.asdict(self)
        record["costs"] = list(self.costs)
        record["class_weight"] = {"+1": self.positive_weight, "-1": 1.0}
        del record["positive_weight"], record["workers"]
        return record


def check_settings(svm_config: Mapping[str, Any], field: str = "svm") -> None:
    """Start-up checks of the classifier settings; each failure names the field and a fix."""
    costs = tuple(svm_config["costs"])
    if not costs or not all(_number(c) and math.isfinite(c) and c > 0 for c in costs):
        raise ValueError(
            f"{field}.costs={costs!r} must be a non-empty list of finite costs > 0, e.g. VISSL's "
            f"--config.{field}.costs='{VISSL_COSTS}'."
        )
    for name, low in (("cross_val_folds", 2), ("max_iter", 1), ("workers", 1)):
        value = svm_config[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{field}.{name}={value!r} must be an integer >= {low}.")
    for name in ("tol", "positive_weight"):
        value = svm_config[name]
        if not (_number(value) and math.isfinite(value) and value > 0):
            raise ValueError(f"{field}.{name}={value!r} must be a finite number > 0.")
    loss, penalty, dual = svm_config["loss"], svm_config["penalty"], svm_config["dual"]
    if loss not in LOSSES:
        raise ValueError(f"{field}.loss={loss!r} is not one of {LOSSES} (VISSL: squared_hinge).")
    if penalty not in PENALTIES:
        raise ValueError(f"{field}.penalty={penalty!r} is not one of {PENALTIES} (VISSL: l2).")
    # liblinear's solvers (sklearn.svm.LinearSVC): which combinations exist.
    if penalty == "l1" and (loss == "hinge" or dual):
        raise ValueError(
            f"{field}.penalty='l1' needs {field}.loss='squared_hinge' and {field}.dual=False "
            "(liblinear has no other L1 solver)."
        )
    if loss == "hinge" and not dual:
        raise ValueError(f"{field}.loss='hinge' needs {field}.dual=True (liblinear).")
    if svm_config["metric"] not in METRICS:
        raise ValueError(
            f"{field}.metric={svm_config['metric']!r} is not one of {METRICS}: 'auto' is mAP "
            "for multi-label targets and top-1 for single-label ones."
        )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """VISSL's ``_normalize_features``: float64 rows divided by their norm plus 1e-5."""
    x = np.asarray(x, np.float64)
    return x / (np.linalg.norm(x, axis=1) + 1e-5)[:, None]


def average_precision(labels: np.ndarray, scores: np.ndarray) -> float:
    """VISSL's test AP (``get_precision_recall`` / ``calculate_ap``): rows ranked by
    descending score, precision made non-increasing from the right (the envelope), summed
    over recall steps; each positive adds 1 / #positives times the envelope at its rank. NaN
    when there is no positive. Ties are ranked by a stable sort (VISSL's order among equal
    scores is numpy's unstable quicksort's)."""
    positive = np.asarray(labels) > 0
    if not positive.any():
        return float("nan")
    order = np.argsort(-np.asarray(scores, np.float64), kind="stable")
    hits = positive[order]
    precision = np.cumsum(hits) / np.arange(1, len(hits) + 1)
    envelope = np.maximum.accumulate(precision[::-1])[::-1]
    return float(envelope[hits].sum() / hits.sum())


def top1(scores: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 accuracy (%) of the arg-max class of ``scores`` (n, C)."""
    return 100.0 * float(np.mean(np.argmax(scores, axis=1) == labels)) if len(labels) else 0.0


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def make_svc(settings: Settings, cost: float):
    """VISSL's ``LinearSVC`` for one class and cost."""
    from sklearn.svm import LinearSVC

    return LinearSVC(
        C=cost,
        class_weight={1: settings.positive_weight, -1: 1.0},
        intercept_scaling=1.0,
        penalty=settings.penalty,
        loss=settings.loss,
        tol=settings.tol,
        dual=settings.dual,
        max_iter=settings.max_iter,
        random_state=settings.seed,
    )


def cross_validated_ap(x: np.ndarray, y: np.ndarray, settings: Settings, folds: int) -> np.ndarray:
    """Mean fold AP of every cost (sklearn's stratified ``folds``-fold split, no shuffle, and
    its ``average_precision`` scorer, as VISSL's ``cross_val_score``)."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.model_selection import cross_val_score

    out = np.zeros(len(settings.costs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # VISSL's max_iter, as VISSL
        for i, cost in enumerate(settings.costs):
            scores = cross_val_score(
                make_svc(settings, cost), x, y, cv=folds, scoring="average_precision"
            )
            out[i] = scores.mean()
    return out


def fit(x: np.ndarray, y: np.ndarray, settings: Settings, cost: float) -> np.ndarray:
    """``[coef..., intercept]`` of the SVM of one class fitted at ``cost``."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf = make_svc(settings, cost).fit(x, y)
    return np.concatenate([clf.coef_.reshape(-1), clf.intercept_.reshape(-1)])


def decision(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Decision function(s) of ``[coef..., intercept]`` rows (``weights`` (d + 1,) or
    (C, d + 1)) on ``x`` (n, d)."""
    weights = np.atleast_2d(weights)
    out = x @ weights[:, :-1].T + weights[:, -1]
    return out[:, 0] if out.shape[1] == 1 else out


def _train_class(x, targets, cls, settings: Settings) -> dict[str, Any]:
    y, _ = binary_targets(targets, cls, test=False)
    cv_ap = cross_validated_ap(x, y, settings, settings.cross_val_folds)
    best = int(np.argmax(cv_ap))  # the first of equal scores, as VISSL's np.argmax
    cost = settings.costs[best]
    return {"cv_ap": cv_ap, "cost": cost, "weights": fit(x, y, settings, cost)}


def train_and_test(
    train: SplitFeatures, test: SplitFeatures, settings: Settings, classes: int
) -> dict[str, Any]:
    """VISSL's ``SVMTrainer.train`` + ``test`` over ``classes`` classes.

    Returns ``{"ap" (C,), "cv_ap" (C, costs), "costs" (C,), "scores" (n_test, C)}``: each
    class's test AP (NaN without a positive), its cross-validated AP per cost, its chosen
    cost and its decision function on the test split."""
    check_train_classes(train, classes, settings.cross_val_folds, "the train split")
    x_train = l2_normalize(train.features) if settings.normalize else np.asarray(train.features)
    x_test = l2_normalize(test.features) if settings.normalize else np.asarray(test.features)
    jobs = [(x_train, train.targets, cls, settings) for cls in range(classes)]
    per_class = run_jobs(_train_class, jobs, settings.workers)
    weights = np.stack([r["weights"] for r in per_class])
    scores = decision(x_test, weights).reshape(len(x_test), classes)
    ap = np.array(
        [
            average_precision(*labels_for_test(test.targets, scores[:, cls], cls))
            for cls in range(classes)
        ]
    )
    return {
        "ap": ap,
        "cv_ap": np.stack([r["cv_ap"] for r in per_class]),
        "costs": np.array([r["cost"] for r in per_class]),
        "scores": scores,
    }


def labels_for_test(targets: np.ndarray, scores: np.ndarray, cls: int):
    """(+1 / -1 test labels of class ``cls``, their scores): difficult rows left out."""
    y, keep = binary_targets(targets, cls, test=True)
    return y, scores[keep]


def run_jobs(fn, jobs: Sequence[tuple], workers: int) -> list:
    """``[fn(*job) for job in jobs]``, in ``workers`` processes when more than one (joblib's
    loky backend memory-maps the large arrays instead of copying them to each worker)."""
    if workers <= 1 or len(jobs) <= 1:
        return [fn(*job) for job in jobs]
    from joblib import Parallel, delayed

    return Parallel(n_jobs=workers, backend="loky")(delayed(fn)(*job) for job in jobs)


def resolve_metric(metric: str, multi_label: bool) -> str:
    """The headline metric: ``auto`` is mAP for multi-label targets, top-1 otherwise."""
    if metric == "auto":
        return "mAP" if multi_label else "top1"
    if metric == "top1" and multi_label:
        raise ValueError(
            "metric='top1' needs single-label targets; these are multi-label: use 'mAP' or 'auto'."
        )
    return metric
