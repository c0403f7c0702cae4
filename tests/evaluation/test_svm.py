"""Tests of the SVM evaluator (jssl.evaluation.svm, the svm engine) against direct
re-computations: VOC's all-points AP from its definition, scikit-learn's own LinearSVC and
cross_val_score driven by hand, and the protocol recorded in results.json."""

import json
import os
import warnings

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import cross_val_score
from sklearn.svm import LinearSVC

from configs import svm as svm_config
from jssl import engines
from jssl.engines import svm as svm_engine
from jssl.evaluation import svm


def _voc_ap_by_definition(labels, scores):
    """For each positive, the best precision at any rank at or below its own, averaged."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    ranked = [labels[i] > 0 for i in order]
    precisions = [sum(ranked[: r + 1]) / (r + 1) for r in range(len(ranked))]
    per_positive = [max(precisions[r:]) for r in range(len(ranked)) if ranked[r]]
    return sum(per_positive) / len(per_positive)


def test_average_precision_is_vissls_interpolated_all_points_ap():
    # Ranked 0, 1, 1: precisions 1/2, 2/3 at the positives; the envelope lifts the first to
    # 2/3, so VISSL's AP is 2/3 where sklearn's non-interpolated AP is (1/2 + 2/3) / 2.
    assert svm.average_precision(np.array([-1, 1, 1]), np.array([3.0, 2.0, 1.0])) == 2 / 3
    assert svm.average_precision(np.array([1, -1, 1, -1]), np.array([0.9, 0.8, 0.7, 0.1])) == (
        pytest.approx((1 + 2 / 3) / 2)
    )
    assert np.isnan(svm.average_precision(np.array([-1, -1]), np.array([1.0, 2.0])))
    rng = np.random.default_rng(0)
    for n in (5, 17, 60):
        labels = np.where(rng.random(n) < 0.3, 1, -1)
        labels[0] = 1
        scores = rng.normal(size=n)
        assert svm.average_precision(labels, scores) == pytest.approx(
            _voc_ap_by_definition(labels, scores), abs=1e-12
        )


def _blobs(n, classes=3, dims=6, seed=0, noise=1.2):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dims))
    labels = np.arange(n) % classes
    return (centres[labels] + noise * rng.normal(size=(n, dims))).astype(np.float32), labels


def _split(x, targets):
    return svm.SplitFeatures(x, targets, np.arange(len(x)))


def test_train_and_test_is_vissls_procedure_run_by_hand():
    x, y = _blobs(60)
    xt, yt = _blobs(30, seed=1)
    settings = svm.Settings(costs=(0.01, 1.0, 100.0), seed=3)
    got = svm.train_and_test(_split(x, y), _split(xt, yt), settings, 3)

    normed = x.astype(np.float64) / (np.linalg.norm(x.astype(np.float64), axis=1) + 1e-5)[:, None]
    normed_t = xt / (np.linalg.norm(xt.astype(np.float64), axis=1) + 1e-5)[:, None]
    scores = np.zeros((30, 3))
    for cls in range(3):
        labels = np.where(y == cls, 1, -1)

        def clf(cost):
            return LinearSVC(
                C=cost,
                class_weight={1: 2, -1: 1},
                loss="squared_hinge",
                penalty="l2",
                dual=True,
                tol=1e-4,
                max_iter=2000,
                random_state=3,
            )

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            cv = [
                cross_val_score(clf(c), normed, labels, cv=3, scoring="average_precision").mean()
                for c in settings.costs
            ]
            best = settings.costs[int(np.argmax(cv))]
            scores[:, cls] = clf(best).fit(normed, labels).decision_function(normed_t)
        np.testing.assert_allclose(got["cv_ap"][cls], cv)
        assert got["costs"][cls] == best
        assert got["ap"][cls] == pytest.approx(
            _voc_ap_by_definition(np.where(yt == cls, 1, -1), scores[:, cls])
        )
    np.testing.assert_allclose(got["scores"], scores, rtol=1e-10, atol=1e-12)
    summary = svm_engine.summarize(got, _split(xt, yt), "auto", settings.costs)
    assert summary["metric"] == "top1"
    assert summary["top1"] == pytest.approx(100 * np.mean(scores.argmax(1) == yt))
    assert summary["mAP"] == pytest.approx(100 * got["ap"].mean())


def test_multi_label_difficult_rows_train_as_negatives_and_are_left_out_of_the_test():
    x, y = _blobs(48, classes=2)
    targets = np.stack([(y == 0).astype(int), (y == 1).astype(int)], 1)
    targets[::5, 0] = -1  # "difficult" rows of class 0
    xt, yt = _blobs(24, classes=2, seed=1)
    test_targets = np.stack([(yt == 0).astype(int), (yt == 1).astype(int)], 1)
    test_targets[::4, 0] = -1
    settings = svm.Settings(costs=(1.0,))
    got = svm.train_and_test(_split(x, targets), _split(xt, test_targets), settings, 2)

    normed = svm.l2_normalize(x)
    weights = svm.fit(normed, np.where(targets[:, 0] == 1, 1, -1), settings, 1.0)
    scores = svm.decision(svm.l2_normalize(xt), weights)
    np.testing.assert_allclose(got["scores"][:, 0], scores)
    keep = test_targets[:, 0] != -1
    want = _voc_ap_by_definition(np.where(test_targets[keep, 0] == 1, 1, -1), scores[keep])
    assert got["ap"][0] == pytest.approx(want)
    with pytest.raises(ValueError, match="needs single-label targets"):
        svm_engine.summarize(got, _split(xt, test_targets), "top1", settings.costs)
    assert "top1" not in svm_engine.summarize(got, _split(xt, test_targets), "auto", settings.costs)


def test_the_same_seed_gives_the_same_svms():
    x, y = _blobs(45, noise=3.0)
    xt, yt = _blobs(15, seed=1, noise=3.0)
    settings = svm.Settings(costs=(0.1, 1000.0), max_iter=30, seed=7)
    a = svm.train_and_test(_split(x, y), _split(xt, yt), settings, 3)
    b = svm.train_and_test(_split(x, y), _split(xt, yt), settings, 3)
    np.testing.assert_array_equal(a["scores"], b["scores"])
    np.testing.assert_array_equal(a["cv_ap"], b["cv_ap"])


@pytest.mark.slow  # worker processes start in ~10 s
def test_worker_processes_give_the_svms_of_one_process():
    x, y = _blobs(45, noise=3.0)
    xt, yt = _blobs(15, seed=1, noise=3.0)
    one = svm.Settings(costs=(0.1, 1000.0), max_iter=30)
    two = svm.Settings(costs=(0.1, 1000.0), max_iter=30, workers=2)
    a = svm.train_and_test(_split(x, y), _split(xt, yt), one, 3)
    b = svm.train_and_test(_split(x, y), _split(xt, yt), two, 3)
    np.testing.assert_array_equal(a["scores"], b["scores"])


def _write_split(directory, layer, x, targets):
    os.makedirs(directory, exist_ok=True)
    np.save(os.path.join(directory, f"{layer}_features.npy"), x)
    np.save(os.path.join(directory, f"{layer}_targets.npy"), targets)
    np.save(os.path.join(directory, f"{layer}_inds.npy"), np.arange(len(x)))


def features_dir(tmp_path, *, multi_label=False, n=(60, 30), classes=3, step=300):
    """A tiny extract_features workdir: avgpool features of train and test, and the
    features/config.json extraction writes."""
    root = tmp_path / "extracted"
    for seed, (split, count) in enumerate(zip(("train", "test"), n, strict=True)):
        x, y = _blobs(count, classes=classes, seed=seed)
        targets = np.eye(classes, dtype=np.int64)[y] if multi_label else y
        _write_split(root / "features" / split, "avgpool", x, targets)
    config = {
        "init": {"checkpoint": f"runs/demo/checkpoints/{step}"},
        "model": {"trunk": "resnet18"},
        "data": {"source": "demo", "name": "", "image_size": 32},
        "extract": {"pool": "res5=avg:2,2,0;avgpool=none"},
    }
    (root / "features" / "config.json").write_text(json.dumps(config))
    return str(root)


def test_load_split_reads_multi_label_targets_and_refuses_bad_ones(tmp_path):
    root = features_dir(tmp_path, multi_label=True)
    train = svm.load_split(root, "train", "avgpool")
    assert train.multi_label and train.targets.shape == (60, 3) and train.features.shape == (60, 6)
    with pytest.raises(ValueError, match="slices of multi-label features are not read"):
        svm.load_split(root, "train[:10]", "avgpool")
    np.save(tmp_path / "extracted/features/test/avgpool_targets.npy", np.full((30, 3), 2))
    with pytest.raises(ValueError, match=r"holds \[2\]"):
        svm.load_split(root, "test", "avgpool")


def _config(root, **overrides):
    config = svm_config.get_config("test")
    config.svm.features_dir = root
    config.svm.train_split, config.svm.test_split = "train", "test"  # features_dir()'s
    config.update_from_flattened_dict(overrides)
    return config


def test_the_engine_writes_each_figure_with_its_protocol(tmp_path):
    root = features_dir(tmp_path)
    workdir = tmp_path / "svm"
    results = engines.run(_config(root), str(workdir))
    with open(workdir / "results.json") as f:
        assert json.load(f) == json.loads(json.dumps(results))
    layer = results["layers"]["avgpool"]
    protocol = layer["protocol"]
    assert protocol["features"]["checkpoint_step"] == 300
    assert protocol["features"]["pool"] == "none" and protocol["features"]["trunk"] == "resnet18"
    assert (protocol["train_split"], protocol["test_split"]) == ("train", "test")
    assert (protocol["num_train"], protocol["num_test"], protocol["num_classes"]) == (60, 30, 3)
    assert protocol["settings"]["costs"] == [0.1, 1.0, 10.0]
    assert protocol["settings"]["cross_val_folds"] == 3 and protocol["settings"]["seed"] == 0
    assert (
        "cross-validation" in layer["cost_selection"] and "train split" in layer["cost_selection"]
    )
    train = svm.load_split(root, "train", "avgpool")
    test = svm.load_split(root, "test", "avgpool")
    want = svm.train_and_test(train, test, svm.Settings(costs=(0.1, 1.0, 10.0)), 3)
    assert layer["value"] == layer["top1"] == pytest.approx(svm.top1(want["scores"], test.targets))
    assert [c["cost"] for c in layer["per_class"]] == want["costs"].tolist()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"svm.costs": ()}, r"svm.costs=\(\) must be a non-empty list"),
        ({"svm.costs": (1.0, -2.0)}, r"finite costs > 0"),
        ({"svm.cross_val_folds": 1}, r"svm.cross_val_folds=1 must be an integer >= 2"),
        ({"svm.loss": "log"}, r"svm.loss='log' is not one of"),
        ({"svm.penalty": "l1"}, r"needs svm.loss='squared_hinge' and svm.dual=False"),
        ({"svm.metric": "top5"}, r"svm.metric='top5' is not one of"),
        ({"svm.features_dir": ""}, r"svm.features_dir is empty"),
        ({"svm.layers": ()}, r"svm.layers=\(\) must name"),
        ({"svm.layers": ("res5",)}, r"No features of layer 'res5'"),
        ({"svm.cross_val_folds": 25}, r"fewer than svm.cross_val_folds=25"),
    ],
)
def test_bad_settings_are_refused_before_the_workdir_is_touched(tmp_path, overrides, message):
    config = _config(features_dir(tmp_path), **overrides)
    workdir = tmp_path / "svm"
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        engines.run(config, str(workdir))
    assert not workdir.exists()


def test_top1_of_multi_label_targets_is_refused(tmp_path):
    config = _config(features_dir(tmp_path, multi_label=True), **{"svm.metric": "top1"})
    with pytest.raises(ValueError, match="needs single-label targets"):
        engines.validate(config)
