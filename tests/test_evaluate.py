"""End-to-end tests of the evaluation engines (kNN, linear_eval) on a tiny trained MoCo model
(the "test" presets: 16 px, ResNet-18 x0.125, a few hundred demo examples)."""

import json
import os

import jax
import numpy as np
import pytest
from test_knn import _reference_scores
from test_launch import enable_compilation_cache, prepare_shared_dirs

from configs import knn as knn_config
from configs import linear_eval as linear_eval_config
from configs import moco
from jssl import knn, weights
from jssl.engines import evaluate, train


@pytest.fixture(scope="session")
def shared_dirs(tmp_path_factory):
    return prepare_shared_dirs(tmp_path_factory)


@pytest.fixture(scope="session")
def trained_workdir(shared_dirs, tmp_path_factory):
    """A MoCo checkpoint after one epoch of the "test" preset."""
    enable_compilation_cache(shared_dirs[1])
    config = moco.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.num_epochs = 1
    config.checkpoint.async_save = False
    workdir = str(tmp_path_factory.mktemp("moco"))
    train.run(config, workdir)
    return workdir


def _read_results(workdir):
    with open(os.path.join(workdir, "results.json")) as f:
        return json.load(f)


def test_knn_from_checkpoint(shared_dirs, trained_workdir, tmp_path):
    config = knn_config.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.init.checkpoint = trained_workdir
    workdir = str(tmp_path / "knn")
    summary = evaluate.run_knn(config, workdir)
    results = _read_results(workdir)
    assert results == summary
    assert results["num_train"] == 256 and results["num_test"] == 100
    for k in config.knn.ks:
        for name in ("top1", "top5"):
            assert 0.0 <= results[f"k{k}"][name] <= 100.0
        assert results[f"k{k}"]["top5"] >= results[f"k{k}"]["top1"]
    assert os.path.isdir(os.path.join(workdir, "tensorboard"))


def test_knn_from_features_on_disk_matches_brute_force(tmp_path):
    rng = np.random.default_rng(0)
    num_classes, k, temperature = 5, 7, 0.07
    directory = tmp_path / "extracted" / "features"
    arrays = {}
    for split, n in (("train", 90), ("test", 31)):
        # A pooled (n, h, w, c) map, as extract_features stores it: kNN flattens it.
        feats = rng.normal(size=(n, 2, 2, 3)).astype(np.float32)
        labels = rng.integers(0, num_classes, n)
        os.makedirs(directory / split)
        np.save(directory / split / "res5_features.npy", feats)
        np.save(directory / split / "res5_targets.npy", labels.astype(np.int64))
        np.save(directory / split / "res5_inds.npy", np.arange(n, dtype=np.int64))
        arrays[split] = (feats.reshape(n, -1), labels)

    config = knn_config.get_config("test")
    config.knn.layer = "res5"
    config.knn.ks = (k, 1)
    config.knn.temperature = temperature
    config.knn.train_split = "train"
    config.knn.test_split = "test[:31]"  # a TFDS slice reads the split's directory
    # The extract_features workdir itself (its features/ dir is found).
    config.knn.features_dir = str(tmp_path / "extracted")
    results = evaluate.run_knn(config, str(tmp_path / "knn"))

    (train_x, train_y), (test_x, test_y) = arrays["train"], arrays["test"]
    for kk in (k, 1):
        scores = _reference_scores(train_x, train_y, test_x, num_classes, kk, temperature)
        want = knn.topk_accuracy(scores, test_y)
        assert results[f"k{kk}"] == pytest.approx(want)
    assert _read_results(tmp_path / "knn") == results


def test_linear_eval_end_to_end(shared_dirs, trained_workdir, tmp_path):
    config = linear_eval_config.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.init.checkpoint = trained_workdir
    workdir = str(tmp_path / "linear")
    summary = evaluate.run_linear_eval(config, workdir)
    results = _read_results(workdir)
    assert set(results) == set(config.linear.layers)
    for layer in config.linear.layers:
        assert 0.0 <= results[layer]["top1"] <= results[layer]["top5"] <= 100.0
    assert summary["step"] == 64 // 16
    # The frozen trunk is the checkpoint's, bit for bit, after training the heads.
    saved = weights.load_variables(trained_workdir, moco.get_config("test"))
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(summary["trunk_variables"]),
        jax.device_get(saved),
    )
    assert os.path.isdir(os.path.join(workdir, "checkpoints", str(summary["step"])))
