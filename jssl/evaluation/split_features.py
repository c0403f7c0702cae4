"""One layer of one extracted split as the SVM, low-shot and clustering evaluators read it
(single-label class ids or VISSL's multi-label matrix), and the checks on its classes that
make their figures meaningful: two classes at least, enough examples of each for the folds."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jssl.evaluation import feature_store


@dataclasses.dataclass
class SplitFeatures:
    """One layer of one extracted split, as the three evaluators read it."""

    features: np.ndarray  # (n, d) float32, flattened (memory-mapped when read from disk)
    targets: np.ndarray  # (n,) class ids, or (n, C) in {1, 0, -1} (multi-label)
    indices: np.ndarray  # (n,) dataset indices

    @property
    def multi_label(self) -> bool:
        return self.targets.ndim == 2

    def __len__(self) -> int:
        return len(self.indices)


def load_split(features_dir: str, split: str, layer: str, field: str = "") -> SplitFeatures:
    """``layer``'s features of ``split`` from an extract_features workdir (or its
    ``features/``): a split or slice through ``feature_store.load_features``, or a whole split
    whose ``<layer>_targets.npy`` is VISSL's ``(n, C)`` multi-label matrix, which the feature
    store's reader (one class id per row) does not read. ``field`` names the config field of
    ``split`` in the refusal of a split that is not there."""
    features_dir = features_root(features_dir)
    if "[" not in split:
        directory = os.path.join(features_dir, feature_store.split_dir_name(split))
        if _multi_label_dir(directory, layer):
            return _load_multi_label(directory, layer)
    else:
        base = split.split("[", 1)[0]
        names = sorted(os.listdir(features_dir)) if os.path.isdir(features_dir) else []
        for name in names:
            if (name == base or name.startswith(f"{base}@")) and _multi_label_dir(
                os.path.join(features_dir, name), layer
            ):
                raise ValueError(
                    f"{split!r} is a slice of a split with multi-label targets ({name}); "
                    "slices of multi-label features are not read yet: evaluate the whole split."
                )
    loaded = feature_store.load_features(features_dir, split, [layer], field)
    feats = loaded.features[layer]
    return SplitFeatures(feats.reshape(len(feats), -1), loaded.labels, loaded.indices)


def _multi_label_dir(directory: str, layer: str) -> bool:
    path = os.path.join(directory, f"{layer}_targets.npy")
    return os.path.exists(path) and np.load(path, mmap_mode="r").ndim == 2


def _load_multi_label(directory: str, layer: str) -> SplitFeatures:
    prefix = os.path.join(directory, f"{layer}_")
    feats = np.load(prefix + "features.npy", mmap_mode="r")
    targets = np.load(prefix + "targets.npy").astype(np.int32)
    indices = np.load(prefix + "inds.npy").reshape(-1).astype(np.int64)
    if not len(feats) == len(targets) == len(indices):
        raise ValueError(
            f"{prefix}*.npy disagree in length: features {len(feats)}, targets {len(targets)}, "
            f"inds {len(indices)}; re-run the extraction."
        )
    bad = np.setdiff1d(np.unique(targets), [-1, 0, 1])
    if bad.size:
        raise ValueError(
            f"{prefix}targets.npy is a (n, C) matrix but holds {bad[:5].tolist()}: multi-label "
            "targets are 1 (present), 0 (absent) and -1 (difficult, ignored in the test AP)."
        )
    return SplitFeatures(feats.reshape(len(feats), -1), targets, indices)


def num_classes(*splits: SplitFeatures) -> int:
    """Columns of multi-label targets, else the largest class id plus one."""
    if splits[0].multi_label:
        return int(splits[0].targets.shape[1])
    return int(max(int(s.targets.max(initial=-1)) for s in splits)) + 1


def check_pair(train: SplitFeatures, test: SplitFeatures, what: str) -> None:
    """Train and test must be the same kind of targets over the same classes and dims."""
    if train.multi_label != test.multi_label or (
        train.multi_label and train.targets.shape[1] != test.targets.shape[1]
    ):
        raise ValueError(
            f"{what}: the train targets are {_describe(train)} and the test targets "
            f"{_describe(test)}; extract both splits from the same dataset."
        )
    if train.features.shape[1] != test.features.shape[1]:
        raise ValueError(
            f"{what}: train features have {train.features.shape[1]} dims and test features "
            f"{test.features.shape[1]}; extract both with the same layer and pooling."
        )
    if not train.multi_label and len(train) and train.targets.min() < 0:
        raise ValueError(f"{what}: negative class ids in the train targets.")


def require_two_classes(split: SplitFeatures, where: str, field: str, why: str) -> None:
    """Single-label targets must hold two classes or more: one class makes every one-vs-rest
    problem one-sided and every clustering score trivial. ``where`` names the split (e.g.
    "svm.train_split='train[:64]' (layer 'avgpool')"), ``field`` its config field, ``why``
    what needs two classes."""
    if split.multi_label:
        return
    present = np.unique(split.targets)
    if len(present) >= 2:
        return
    held = f"one class, {int(present[0])}," if len(present) else "no class:"
    raise ValueError(
        f"The targets of {where} hold {held} in {len(split)} examples: {why}. Evaluate the "
        "features of a split with at least two classes: extract one with "
        "--config=configs/extract_features.py (extract.splits; the first examples of a dataset "
        f"stored class by class, such as an image folder, are all of one class) and set "
        f"--config.{field} to it."
    )


def check_train_classes(train: SplitFeatures, classes: int, folds: int, where: str) -> None:
    """Every class's SVM can be trained and cross-validated: two classes or more, and each
    class with at least ``folds`` positive and ``folds`` negative train examples (each
    stratified fold needs both). Raises naming the class with the fewest; the advice to lower
    ``svm.cross_val_folds`` is given only where that helps (folds cannot go below 2)."""
    require_two_classes(train, where, "svm.train_split", "one-vs-rest SVMs need at least two")
    counts = []
    for cls in range(classes):
        y, _ = binary_targets(train.targets, cls, test=False)
        positives = int((y == 1).sum())
        counts.append((min(positives, len(y) - positives), cls, positives, len(y) - positives))
    fewest, cls, positives, negatives = min(counts, default=(folds, 0, 0, 0))
    if fewest >= folds:
        return
    found = (
        f"Class {cls} has {positives} positive and {negatives} negative train examples in {where}"
    )
    if fewest >= 2:
        raise ValueError(
            f"{found}, fewer than svm.cross_val_folds={folds}: each fold needs both. Lower "
            f"--config.svm.cross_val_folds to {fewest} or use a larger svm.train_split."
        )
    raise ValueError(
        f"{found}: cross-validating its cost needs at least 2 of each (svm.cross_val_folds "
        ">= 2), so no number of folds can. Use a train split (svm.train_split) in which every "
        f"class has at least {folds} examples with it and {folds} without it."
    )


def _describe(split: SplitFeatures) -> str:
    if split.multi_label:
        return f"multi-label over {split.targets.shape[1]} classes"
    return "single-label class ids"


def features_root(features_dir: str) -> str:
    inner = os.path.join(features_dir, "features")
    return inner if os.path.isdir(inner) else features_dir


def binary_targets(targets: np.ndarray, cls: int, *, test: bool) -> tuple[np.ndarray, np.ndarray]:
    """(+1 / -1 labels of class ``cls``, rows kept). Multi-label: 1 is +1, 0 is -1, and -1
    (difficult) is -1 in training and left out of the test (VISSL's train / test)."""
    if targets.ndim == 1:
        return np.where(targets == cls, 1, -1), np.ones(len(targets), bool)
    column = targets[:, cls]
    keep = column != -1 if test else np.ones(len(column), bool)
    return np.where(column == 1, 1, -1)[keep], keep


# --------------------------------------------------------------------------------------------
# Average precision and top-1
# --------------------------------------------------------------------------------------------
