"""SIGTERM in an engine that keeps nothing it could save part of (kNN here; the SVMs, k-means,
the test loss, verify and export alike): it stops where it is, writes no results.json and
returns ``preempted`` (exit status 75), and a rerun gives the whole result."""

import json
import os
import signal

import numpy as np
import pytest

from configs import knn as knn_config
from jssl import engines
from jssl.evaluation import knn, results
from jssl.training import preemption


def _features_dir(tmp_path) -> str:
    rng = np.random.default_rng(0)
    directory = tmp_path / "features"
    for split, n in (("train", 30), ("test", 12)):
        os.makedirs(directory / split)
        np.save(directory / split / "avgpool_features.npy", rng.normal(size=(n, 4)))
        np.save(directory / split / "avgpool_targets.npy", rng.integers(0, 3, n))
        np.save(directory / split / "avgpool_inds.npy", np.arange(n))
    return str(directory)


def _config(features_dir: str):
    config = knn_config.get_config("test")
    config.knn.features_dir = features_dir
    config.knn.train_split, config.knn.test_split = "train", "test"
    return config


def _signalled_mid_search(monkeypatch):
    """kNN's search sends this process SIGTERM once, after its first k."""
    search, sent = knn.knn_accuracy, []

    def search_then_signal(*args, **kwargs):
        accuracy = search(*args, **kwargs)
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return accuracy

    monkeypatch.setattr(knn, "knn_accuracy", search_then_signal)


def test_sigterm_stops_knn_before_its_results_and_a_rerun_finishes(tmp_path, monkeypatch):
    features_dir, workdir = _features_dir(tmp_path), str(tmp_path / "knn")
    _signalled_mid_search(monkeypatch)
    summary = engines.run(_config(features_dir), workdir)
    assert summary == {"preempted": True}
    assert engines.exit_status(summary) == preemption.PREEMPTED_EXIT_CODE
    assert not os.path.exists(os.path.join(workdir, "results.json"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is put back
    rerun = engines.run(_config(features_dir), workdir)
    assert {"k5", "k20"} <= set(rerun) and "preempted" not in rerun


def test_inside_another_engines_preemption_a_stop_is_only_requested(tmp_path, monkeypatch):
    """An evaluator run by evaluate or by training finishes; its caller then stops."""
    _signalled_mid_search(monkeypatch)
    with preemption.Preemption() as outer:
        summary = engines.run(_config(_features_dir(tmp_path)), str(tmp_path / "knn"))
    assert outer.requested and {"k5", "k20"} <= set(summary)


def test_results_files_are_replaced_whole(tmp_path, monkeypatch):
    path = str(tmp_path / "results.json")
    results.save_json(path, {"a": 1})

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", fail)
    with pytest.raises(OSError):
        results.save_json(path, {"a": 2})
    with open(path) as f:
        assert json.load(f) == {"a": 1}
    assert os.listdir(tmp_path) == ["results.json"]
