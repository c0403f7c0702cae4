"""End-to-end tests of the evaluation engines (kNN, linear_eval) on a tiny trained MoCo model
(the "test" presets: 16 px, ResNet-18 x0.125, a few hundred demo examples)."""

import json
import os

import jax
import numpy as np
import pytest
from support.launch import enable_compilation_cache, prepare_shared_dirs
from test_knn import _reference_scores

from configs import dino, moco
from configs import knn as knn_config
from configs import linear_eval as linear_eval_config
from jssl import engines, parallel
from jssl.checkpoints import weights
from jssl.engines import knn as knn_engine
from jssl.engines import linear_eval, train
from jssl.evaluation import feature_store, features, frozen, knn, pooling
from jssl.evaluation.batches import eval_batches


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
    engines.run(config, workdir)  # as jssl.train and launch.py: config.json recorded
    return workdir


def _read_results(workdir):
    with open(os.path.join(workdir, "results.json")) as f:
        return json.load(f)


def test_knn_from_checkpoint(shared_dirs, trained_workdir, tmp_path):
    config = knn_config.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.init.checkpoint = trained_workdir
    workdir = str(tmp_path / "knn")
    summary = knn_engine.run(config, workdir)
    results = _read_results(workdir)
    assert results == summary
    assert results["num_train"] == 256 and results["num_test"] == 100
    for k in config.knn.ks:
        for name in ("top1", "top5"):
            assert 0.0 <= results[f"k{k}"][name] <= 100.0
        assert results[f"k{k}"]["top5"] >= results[f"k{k}"]["top1"]
    assert os.path.isdir(os.path.join(workdir, "tensorboard"))

    # The sharded bank gives what the host implementation gives on the same features.
    mesh = parallel.make_mesh()
    forward = frozen.trunk_forward(config, mesh, (config.knn.layer,))
    kcfg = config.knn

    def host_features(split):
        batches = eval_batches(config.data, split, kcfg.batch_size, mesh)
        pool = {kcfg.layer: pooling.get_pool(kcfg.pool, kcfg.layer)}
        got = features.collect_features(forward, batches, [kcfg.layer], pool=pool)
        return got.features[kcfg.layer].reshape(len(got), -1), got.labels

    (bank, bank_labels), (queries, labels) = map(host_features, (kcfg.train_split, kcfg.test_split))
    for k in config.knn.ks:
        want = knn.knn_accuracy(
            bank,
            bank_labels,
            queries,
            labels,
            num_classes=int(max(bank_labels.max(), labels.max())) + 1,
            k=k,
            temperature=kcfg.temperature,
        )
        assert results[f"k{k}"] == pytest.approx(want)


def _write_split(directory, name, feats, labels, inds, bounds=None):
    """One layer ("res5") of a split in extract_features' layout, with split.json if bounds."""
    os.makedirs(directory / name)
    np.save(directory / name / "res5_features.npy", feats)
    np.save(directory / name / "res5_targets.npy", labels.astype(np.int64))
    np.save(directory / name / "res5_inds.npy", inds.astype(np.int64))
    if bounds is not None:
        feature_store.write_split_info(str(directory / name), name, bounds, len(inds))


def test_evaluation_reads_the_trunk_whatever_the_head(shared_dirs, trained_workdir, tmp_path):
    """A workdir whose head does not fit the configured one (a DINO, SwAV or BYOL workdir, or
    a head given on the command line) evaluates: the engines read the trunk alone unless the
    head's output is asked for."""
    config = knn_config.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.init.checkpoint = trained_workdir
    trained_with = moco.get_config("test")
    whole = weights.load_variables(trained_workdir, trained_with)
    matching = knn_engine.run(config, str(tmp_path / "matching"))
    config.model.head_dims = (config.model.head_dims[0], 7, 5)
    trained_with.model.head_dims = config.model.head_dims
    with pytest.raises(weights.WeightsError, match="params/head/fc1/kernel"):
        weights.load_variables(trained_workdir, trained_with)
    trunk = weights.load_variables(trained_workdir, config, trunk_only=True)
    assert set(trunk["params"]) == {"trunk"}
    for name in ("params", "batch_stats"):
        jax.tree.map(np.testing.assert_array_equal, trunk[name]["trunk"], whole[name]["trunk"])
    other_head = knn_engine.run(config, str(tmp_path / "other_head"))
    assert other_head == matching
    # The head's output needs the head it was trained with.
    config.knn.layer = "head"
    with pytest.raises(weights.WeightsError, match="does not fit"):
        knn_engine.run(config, str(tmp_path / "head"))


@pytest.mark.e2e
def test_knn_on_a_dino_vit_workdir(shared_dirs, tmp_path):
    """Another method's workdir on a trunk without batch norm: DINO's test ViT with BN in its
    head (as the ViT demo), so the checkpoint has batch_stats but the trunk none, evaluated by
    the kNN preset given the trunk's model fields."""
    config = dino.get_config("test_vit")
    config.method.use_bn_in_head = True
    config.data.data_dir = shared_dirs[0]
    config.num_epochs = 1
    config.checkpoint.async_save = False
    train.run(config, str(tmp_path / "dino"))
    knn_cfg = knn_config.get_config("test")
    knn_cfg.data.data_dir = shared_dirs[0]
    knn_cfg.init.checkpoint = str(tmp_path / "dino")
    knn_cfg.model = config.model
    results = knn_engine.run(knn_cfg, str(tmp_path / "knn"))
    assert 0.0 < results[f"k{knn_cfg.knn.ks[0]}"]["top1"] <= 100.0


def test_knn_from_features_on_disk_matches_brute_force(tmp_path):
    rng = np.random.default_rng(0)
    num_classes, k, temperature = 5, 7, 0.07
    directory = tmp_path / "extracted" / "features"
    arrays = {}
    for split, n in (("train", 90), ("test", 31)):
        # A pooled (n, h, w, c) map, as extract_features stores it: kNN flattens it.
        feats = rng.normal(size=(n, 2, 2, 3)).astype(np.float32)
        labels = rng.integers(0, num_classes, n)
        _write_split(
            directory, split, feats, labels, np.arange(n), feature_store.SplitBounds(split, 0, n, n)
        )
        arrays[split] = (feats.reshape(n, -1), labels)

    config = knn_config.get_config("test")
    config.knn.layer = "res5"
    config.knn.ks = (k, 1)
    config.knn.temperature = temperature
    config.knn.train_split = "train"
    config.knn.test_split = "test[5:20]"  # a slice: exactly its 15 examples
    # The extract_features workdir itself (its features/ dir is found).
    config.knn.features_dir = str(tmp_path / "extracted")
    results = knn_engine.run(config, str(tmp_path / "knn"))

    (train_x, train_y), (test_x, test_y) = arrays["train"], arrays["test"]
    test_x, test_y = test_x[5:20], test_y[5:20]
    assert results["num_test"] == 15
    for kk in (k, 1):
        scores = _reference_scores(train_x, train_y, test_x, num_classes, kk, temperature)
        want = knn.topk_accuracy(scores, test_y)
        assert results[f"k{kk}"] == pytest.approx(want)
    assert _read_results(tmp_path / "knn") == results


def test_slices_of_cached_features_select_exactly_their_examples(tmp_path):
    rng = np.random.default_rng(1)
    n = 40
    feats = rng.normal(size=(n, 3)).astype(np.float32)
    labels = rng.integers(0, 4, n)
    _write_split(
        tmp_path, "test", feats, labels, np.arange(n), feature_store.SplitBounds("test", 0, n, n)
    )
    # A separately extracted slice (its inds are indices in the whole split).
    rows = np.arange(10, 20)
    bounds = feature_store.SplitBounds("test", 10, 20, n)
    name = feature_store.split_dir_name("test[10:20]", bounds)
    assert name == "test@10-20"
    _write_split(tmp_path, name, feats[rows] + 1, labels[rows], rows, bounds)

    def load(split):
        return feature_store.load_features(str(tmp_path), split, ["res5"])

    for split, want in (
        ("test", np.arange(n)),
        ("test[:5]", np.arange(5)),
        ("test[:10%]", np.arange(4)),
        ("test[-3:]", np.arange(37, 40)),
        ("test[12:18]", np.arange(12, 18)),
    ):
        got = load(split)
        np.testing.assert_array_equal(got.indices, want, err_msg=split)
        np.testing.assert_array_equal(got.labels, labels[want], err_msg=split)
    # The exact slice's own directory is preferred over the whole split's (which it marks +1).
    np.testing.assert_allclose(load("test[10:20]").features["res5"], feats[rows] + 1)
    np.testing.assert_allclose(load("test[:5]").features["res5"], feats[:5])
    assert isinstance(load("test[:5]").features["res5"], np.memmap)  # still streamed

    with pytest.raises(ValueError, match="single slice"):
        load("test[:5]+test[7:9]")
    # A split without split.json cannot tell which examples it holds: slices are refused.
    _write_split(tmp_path, "train", feats, labels, np.arange(n))
    with pytest.raises(FileNotFoundError, match="split.json"):
        load("train[:5]")
    np.testing.assert_array_equal(load("test").indices, np.arange(n))
    assert len(feature_store.load_features(str(tmp_path), "train", ["res5"])) == n


def test_slice_no_extraction_covers_is_refused(tmp_path):
    bounds = feature_store.SplitBounds("test", 10, 20, 40)
    rows = np.arange(10, 20)
    _write_split(tmp_path, "test@10-20", np.zeros((10, 3), np.float32), rows % 3, rows, bounds)
    assert len(feature_store.load_features(str(tmp_path), "test[12:20]", ["res5"])) == 8
    with pytest.raises(FileNotFoundError, match=r"cover 'test\[5:15\]'.*test@10-20 \[10:20\]"):
        feature_store.load_features(str(tmp_path), "test[5:15]", ["res5"])


def test_linear_eval_end_to_end(shared_dirs, trained_workdir, tmp_path):
    config = linear_eval_config.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.init.checkpoint = trained_workdir
    workdir = str(tmp_path / "linear")
    summary = linear_eval.run(config, workdir)
    results = _read_results(workdir)
    assert set(results["layers"]) == set(config.linear.layers)
    for layer in config.linear.layers:
        record = results["layers"][layer]
        assert 0.0 <= record["top1"] <= record["top5"] <= 100.0
        assert record["protocol"]["source"]["checkpoint_step"] == 4
    assert summary["step"] == 64 // 16
    # The frozen trunk is the checkpoint's, bit for bit, after training the heads.
    saved = weights.load_variables(trained_workdir, moco.get_config("test"))
    frozen = jax.device_get(summary["trunk_variables"])
    assert set(frozen["params"]) == {"trunk"}  # MoCo's head is not read
    for name in ("params", "batch_stats"):
        jax.tree.map(
            np.testing.assert_array_equal,
            frozen[name]["trunk"],
            jax.device_get(saved[name]["trunk"]),
        )
    assert os.path.isdir(os.path.join(workdir, "checkpoints", str(summary["step"])))
