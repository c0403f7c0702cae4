"""Tests of the low-shot evaluator (jssl.evaluation.low_shot, the low_shot engine): VISSL's
samples, keyed by the seed; each sample's figure against scikit-learn run by hand; the spread
over samples; the protocol in results.json; refused settings."""

import json

import numpy as np
import pytest
from sklearn.model_selection import cross_val_score
from sklearn.svm import LinearSVC
from test_svm import _blobs, _split, _voc_ap_by_definition, features_dir

from configs import low_shot as low_shot_config
from jssl import engines
from jssl.evaluation import low_shot, svm


def test_multi_label_samples_are_vissls_k_positives_and_c_minus_1_k_negatives_per_class():
    rng = np.random.default_rng(0)
    targets = rng.choice([1, 0, 0, 0, -1], size=(200, 4))
    drawn = low_shot.sample_multi_label(targets, 3, low_shot.sample_rng(0, 1, 3))
    for cls in range(4):
        assert (drawn[:, cls] == 1).sum() == 3 and (drawn[:, cls] == 0).sum() == 9
        assert np.all(targets[drawn[:, cls] == 1, cls] == 1)
        assert np.all(targets[drawn[:, cls] == 0, cls] == 0)
    again = low_shot.sample_multi_label(targets, 3, low_shot.sample_rng(0, 1, 3))
    np.testing.assert_array_equal(drawn, again)
    other = low_shot.sample_multi_label(targets, 3, low_shot.sample_rng(0, 2, 3))
    assert not np.array_equal(drawn, other)


def test_single_label_samples_hold_k_of_every_class():
    labels = np.arange(50) % 5
    rows = low_shot.sample_single_label(labels, 4, 5, low_shot.sample_rng(3, 1, 4))
    assert np.array_equal(np.bincount(labels[rows]), [4] * 5) and len(set(rows)) == 20


def test_a_k_larger_than_a_class_is_refused_naming_the_class():
    labels = np.array([0] * 10 + [1] * 3 + [2] * 10)
    with pytest.raises(ValueError, match=r"k=4 .* class 1, which has 3 positive .* is 3"):
        low_shot.check_ks(labels, (1, 4), 3)
    targets = np.zeros((20, 3), int)
    targets[:6] = 1  # 6 positives and 14 negatives per class: (C - 1) * k <= 14 gives k <= 6
    low_shot.check_ks(targets, (6,), 3)
    targets[:10, 2] = 1  # 10 negatives: room for (C - 1) * k = 2 * 5 at most
    with pytest.raises(ValueError, match=r"class 2, which has 10 positive and 10 negative.* 5:"):
        low_shot.check_ks(targets, (1, 6), 3)


def test_each_sample_is_svms_trained_on_it_by_hand_and_k_reports_the_spread():
    x, y = _blobs(90, noise=1.5)
    xt, yt = _blobs(30, seed=1, noise=1.5)
    settings = svm.Settings(costs=(0.1, 1.0), seed=2)
    got = low_shot.evaluate(
        _split(x, y), _split(xt, yt), settings, ks=(2,), num_samples=3, selection="fixed"
    )["k2"]
    normed, normed_t = svm.l2_normalize(x), svm.l2_normalize(xt)
    top1s, maps = [], []
    for sample in (1, 2, 3):
        rows = low_shot.sample_single_label(y, 2, 3, low_shot.sample_rng(2, sample, 2))
        scores = np.stack(
            [
                LinearSVC(C=1.0, class_weight={1: 2, -1: 1}, random_state=2)
                .fit(normed[rows], np.where(y[rows] == cls, 1, -1))
                .decision_function(normed_t)
                for cls in range(3)
            ],
            1,
        )
        top1s.append(100 * np.mean(scores.argmax(1) == yt))
        aps = [_voc_ap_by_definition(np.where(yt == c, 1, -1), scores[:, c]) for c in range(3)]
        maps.append(100 * np.mean(aps))
    np.testing.assert_allclose(got["top1"]["samples"], top1s)
    np.testing.assert_allclose(got["mAP"]["samples"], maps)
    assert got["metric"] == "top1" and got["value"]["mean"] == pytest.approx(np.mean(top1s))
    assert got["top1"]["std"] == pytest.approx(np.std(top1s))
    assert (got["top1"]["min"], got["top1"]["max"]) == (min(top1s), max(top1s))
    assert got["chosen_costs"] == {"1.0": 9}
    assert got["test_per_cost"]["top1"]["1.0"] == pytest.approx(np.mean(top1s))


def test_samples_depend_on_the_seed_sample_and_k_alone():
    x, y = _blobs(60, noise=2.0)
    xt, yt = _blobs(30, seed=1, noise=2.0)
    settings = svm.Settings(costs=(1.0,))
    kwargs = dict(num_samples=2, selection="cross_validation")
    both = low_shot.evaluate(_split(x, y), _split(xt, yt), settings, ks=(1, 4), **kwargs)
    alone = low_shot.evaluate(_split(x, y), _split(xt, yt), settings, ks=(4,), **kwargs)
    assert both["k4"] == alone["k4"]
    assert "too few to cross-validate" in both["k1"]["cost_selection"]
    selection = both["k4"]["cost_selection"]
    assert "one for all classes: the best mean AP of stratified 3-fold" in selection
    other_seed = svm.Settings(costs=(1.0,), seed=1)
    moved = low_shot.evaluate(_split(x, y), _split(xt, yt), other_seed, ks=(4,), **kwargs)
    assert moved["k4"]["mAP"]["samples"] != alone["k4"]["mAP"]["samples"]


def test_costs_are_chosen_by_cross_validation_on_the_sample_alone():
    x, y = _blobs(90, noise=2.5)
    xt, yt = _blobs(30, seed=1, noise=2.5)
    settings = svm.Settings(costs=(0.01, 1.0, 100.0), seed=4)
    rows = low_shot.sample_single_label(y, 4, 3, low_shot.sample_rng(4, 1, 4))
    normed = svm.l2_normalize(x)[rows]
    cv = np.array(
        [
            [
                cross_val_score(
                    LinearSVC(C=c, class_weight={1: 2, -1: 1}, random_state=4),
                    normed,
                    np.where(y[rows] == cls, 1, -1),
                    cv=3,
                    scoring="average_precision",
                ).mean()
                for c in settings.costs
            ]
            for cls in range(3)
        ]
    )
    data = (_split(x, y), _split(xt, yt), settings)
    shared = low_shot.evaluate(*data, ks=(4,), num_samples=1)["k4"]
    shared_cost = str(settings.costs[int(np.argmax(cv.mean(0)))])
    assert shared["chosen_costs"] == {shared_cost: 3}
    assert shared["top1"]["mean"] == shared["test_per_cost"]["top1"][shared_cost]
    per_class = low_shot.evaluate(
        *data, ks=(4,), num_samples=1, selection="cross_validation_per_class"
    )["k4"]
    want = np.unique([settings.costs[i] for i in cv.argmax(1)], return_counts=True)
    assert per_class["chosen_costs"] == {str(c): int(n) for c, n in zip(*want, strict=True)}
    assert "each class its own" in per_class["cost_selection"]


def _config(root, **overrides):
    config = low_shot_config.get_config("test")
    config.svm.features_dir = root
    config.svm.train_split, config.svm.test_split = "train", "test"  # features_dir()'s
    config.update_from_flattened_dict(overrides)
    return config


def test_the_engine_writes_the_spread_of_every_k_with_its_protocol(tmp_path):
    root = features_dir(tmp_path, multi_label=True, n=(120, 30))
    workdir = tmp_path / "low_shot"
    results = engines.run(_config(root), str(workdir))
    with open(workdir / "results.json") as f:
        assert json.load(f) == json.loads(json.dumps(results))
    layer = results["layers"]["avgpool"]
    protocol = layer["protocol"]
    assert protocol["ks"] == [1, 2, 4] and protocol["num_samples"] == 2
    assert protocol["features"]["checkpoint_step"] == 300
    assert "generate_voc07_low_shot_samples" in protocol["sampling"]
    assert "select nothing" in protocol["test_per_cost"]
    for k in (1, 2, 4):
        fig = layer[f"k{k}"]
        assert fig["metric"] == "mAP" and "top1" not in fig
        assert len(fig["mAP"]["samples"]) == 2
        assert fig["value"]["mean"] == pytest.approx(np.mean(fig["mAP"]["samples"]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"low_shot.ks": (0, 2)}, r"low_shot.ks=\(0, 2\) must be integers >= 1"),
        ({"low_shot.ks": (2, 2)}, r"lists a k twice"),
        ({"low_shot.ks": (1, 64)}, r"k=64 examples per class cannot be drawn for class 0"),
        ({"low_shot.num_samples": 0}, r"low_shot.num_samples=0 must be an integer >= 1"),
        ({"low_shot.cost_selection": "test"}, r"low_shot.cost_selection='test' is not one of"),
        ({"low_shot.cost": 0.0}, r"low_shot.cost=0.0 must be a finite number > 0"),
        ({"svm.metric": "top5"}, r"svm.metric='top5' is not one of"),
    ],
)
def test_bad_settings_are_refused_before_the_workdir_is_touched(tmp_path, overrides, message):
    config = _config(features_dir(tmp_path), **overrides)
    workdir = tmp_path / "low_shot"
    with pytest.raises(ValueError, match=message):
        engines.run(config, str(workdir))
    assert not workdir.exists()
