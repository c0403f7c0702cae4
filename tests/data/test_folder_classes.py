"""Image folders label every split from one class list, the training split's class folders.

Each split used to number its own class folders, so a test split with train {a,b,c} and test
{a,c} gave test's c train's b's label (kNN 50% where 100% is right); a class folder linked to
its own split, or one without images, became a silent class without examples.
"""

import json
import logging
import os

import numpy as np
import pytest
from PIL import Image

import jssl.data as data
from jssl.data import sources
from jssl.evaluation import feature_store, knn

COLOURS = {"a": (255, 0, 0), "b": (0, 255, 0), "c": (0, 0, 255)}


def _write_split(root, split, classes, per_class=2):
    """Solid-colour 8 px images, one colour per class: kNN on the pixels is exact."""
    for name in classes:
        os.makedirs(root / split / name)
        for i in range(per_class):
            pixels = np.full((8, 8, 3), COLOURS[name], np.uint8)
            Image.fromarray(pixels).save(root / split / name / f"{i}.png")


def _config(root, **overrides):
    config = data.default_config()
    config.update(dict(source="folder", data_dir=str(root), image_size=8, batch_size=4))
    config.update(overrides)
    return config


@pytest.fixture
def folder(tmp_path):
    _write_split(tmp_path, "train", "abc")
    _write_split(tmp_path, "test", "ac")
    return tmp_path


def test_a_split_lacking_classes_keeps_the_training_numbers(folder, caplog):
    config = _config(folder)
    with caplog.at_level(logging.INFO):
        train = sources.resolve_split(config, "train")
        test = sources.resolve_split(config, "test")
    assert train.class_names == test.class_names == ("a", "b", "c")
    assert train.labels.tolist() == [0, 0, 1, 1, 2, 2]
    assert test.labels.tolist() == [0, 0, 2, 2]  # c keeps train's 2, not test's own 1
    assert test.num_classes == 3
    assert "labelled by the class folders of 'train': 0 a, 1 b, 2 c" in caplog.text
    # Extraction records the class list beside the features (split.json).
    bounds = feature_store.split_bounds(config, "test")
    feature_store.write_split_info(str(folder), "test", bounds, 4, class_names=test.class_names)
    with open(folder / feature_store.SPLIT_INFO) as f:
        assert json.load(f)["class_names"] == ["a", "b", "c"]


def _pixels_and_labels(config, split):
    batches = list(data.build_eval_dataset(config, split, batch_size=4).as_numpy_iterator())
    mask = np.concatenate([b["mask"] for b in batches])
    images = np.concatenate([b["image"] for b in batches])[mask]
    labels = np.concatenate([b["label"] for b in batches])[mask]
    return images.reshape(len(images), -1), labels


def test_knn_of_a_test_split_lacking_a_class_is_exact(folder):
    # The example through the tf.data evaluation pipeline and the kNN scorer.
    config = _config(folder)
    bank, bank_labels = _pixels_and_labels(config, "train")
    queries, query_labels = _pixels_and_labels(config, "test")
    acc = knn.knn_accuracy(bank, bank_labels, queries, query_labels, num_classes=3, k=1, topk=(1,))
    assert acc == {"top1": 100.0}


def test_a_class_the_training_split_lacks_is_refused(tmp_path):
    _write_split(tmp_path, "train", "ab")
    _write_split(tmp_path, "test", "abc")
    with pytest.raises(ValueError, match=r"\['c'\] of split 'test'.*not class folders of the "):
        sources.resolve_split(_config(tmp_path), "test")
    # Labelled by its own class folders when asked for.
    test = sources.resolve_split(_config(tmp_path, train_split="test"), "test")
    assert test.labels.tolist() == [0, 0, 1, 1, 2, 2]


def test_a_split_read_without_its_training_split_says_which_field_to_set(tmp_path):
    _write_split(tmp_path, "test", "ac")  # an evaluation folder with test/ only
    with pytest.raises(ValueError, match=r"available: \['test'\].*data.train_split=test"):
        sources.resolve_split(_config(tmp_path), "test")
    assert sources.resolve_split(_config(tmp_path, train_split="test"), "test").num_classes == 2


@pytest.mark.parametrize("target", [".", ".."], ids=["its split", "the root"])
def test_a_class_folder_linked_to_its_split_or_above_is_refused(folder, target):
    os.symlink(target, folder / "train" / "loop")
    with pytest.raises(ValueError, match=r"train/loop' of split 'train' leads back to .*symlink"):
        sources.resolve_split(_config(folder), "train")


@pytest.mark.parametrize("split", ["train", "test"])
def test_a_class_folder_without_images_is_refused(folder, split):
    os.makedirs(folder / split / "b" / "nested")
    (folder / split / "b" / "notes.txt").write_text("not an image")
    if split == "train":
        for f in (folder / "train" / "b").glob("*.png"):
            f.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{split}/b' holds no image files"):
        sources.resolve_split(_config(folder), split)
