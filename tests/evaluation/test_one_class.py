"""Features whose targets hold a single class are refused by the evaluators that cannot score
them (SVMs, low-shot SVMs, k-means), naming the class and the split, before the workdir is
touched; the advice to lower svm.cross_val_folds comes only where it can help."""

import os

import numpy as np
import pytest

from configs import cluster as cluster_config
from configs import low_shot as low_shot_config
from configs import svm as svm_config
from jssl import engines
from jssl.evaluation import low_shot, svm


def _features(tmp_path, train_labels, test_labels=(0, 1, 2) * 4, dims=6):
    """An extract_features layout of whole train and test splits of avgpool features."""
    root = tmp_path / "extracted"
    rng = np.random.default_rng(0)
    for split, labels in (("train", train_labels), ("test", test_labels)):
        directory = root / "features" / split
        os.makedirs(directory)
        labels = np.asarray(labels, np.int64)
        np.save(directory / "avgpool_features.npy", rng.normal(size=(len(labels), dims)))
        np.save(directory / "avgpool_targets.npy", labels)
        np.save(directory / "avgpool_inds.npy", np.arange(len(labels)))
    return str(root)


def _config(module, section, root):
    config = module.get_config("test")
    config[section].features_dir = root
    config[section].train_split, config[section].test_split = "train", "test"
    return config


ONE_CLASS = r"svm.train_split='train' \(layer 'avgpool'\) hold one class, 2, in 12 examples"


@pytest.mark.parametrize(
    "module, section, message",
    [
        (svm_config, "svm", ONE_CLASS + r": one-vs-rest SVMs need at least two"),
        (low_shot_config, "low_shot", ONE_CLASS),
        (cluster_config, "cluster", r"cluster.train_split='train' .*hold one class, 2.*100"),
    ],
)
def test_one_class_train_features_are_refused_naming_the_class(tmp_path, module, section, message):
    root = _features(tmp_path, [2] * 12)
    field = "svm" if section == "low_shot" else section
    workdir = tmp_path / "out"
    with pytest.raises(ValueError, match=message) as refused:
        engines.run(_config(module, field, root), str(workdir))
    assert "cross_val_folds" not in str(refused.value)
    assert f"--config.{field}.train_split" in str(refused.value)
    assert not workdir.exists()


def test_one_class_test_split_of_k_means_is_refused(tmp_path):
    root = _features(tmp_path, [0, 1, 2] * 4, test_labels=[1] * 9)
    with pytest.raises(ValueError, match=r"cluster.test_split='test' .*hold one class, 1"):
        engines.run(_config(cluster_config, "cluster", root), str(tmp_path / "out"))


@pytest.mark.parametrize(
    "labels, folds, message, advice",
    [
        # Class 1 has 2 examples: 2 folds would do.
        ([0, 1, 2] * 2 + [0, 2] * 3, 3, r"Class 1 has 2 positive .*fewer than", True),
        # Class 1 has a single example: no number of folds (>= 2) can split it.
        ([0] * 5 + [1] + [2] * 5, 3, r"Class 1 has 1 positive .*no number of folds", False),
        # Class 1 is absent from the train split (the test split holds it).
        ([0, 2] * 6, 2, r"Class 1 has 0 positive .*no number of folds", False),
    ],
)
def test_the_folds_advice_is_given_only_where_it_helps(labels, folds, message, advice):
    train = svm.SplitFeatures(np.zeros((len(labels), 2)), np.array(labels), np.arange(len(labels)))
    with pytest.raises(ValueError, match=message) as refused:
        svm.check_train_classes(train, 3, folds, "the train split")
    assert ("Lower --config.svm.cross_val_folds to 2" in str(refused.value)) == advice


def test_low_shot_of_multi_label_targets_over_one_class_is_refused(tmp_path):
    # VISSL's sample draws (C - 1) * k negatives: none for C = 1.
    targets = np.array([[1], [0]] * 6)
    root = _features(tmp_path, targets, test_labels=targets)
    with pytest.raises(ValueError, match=r"multi-label targets of svm.train_split='train'.*0 neg"):
        engines.run(_config(low_shot_config, "svm", root), str(tmp_path / "out"))


def test_low_shot_of_a_class_without_train_examples_says_no_k_can_be_drawn():
    with pytest.raises(ValueError, match=r"class 1, which has 0 positive .*No k can be drawn"):
        low_shot.check_ks(np.array([0, 2] * 4), (1, 2), 3)
