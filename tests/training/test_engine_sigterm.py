"""SIGTERM (a scheduler's preemption) during the engines that run for minutes besides
training: each stops cleanly with exit status 75, leaves nothing half-written, and a rerun
of the same command continues to the result of a run that was never interrupted.

The signal is sent in-process, by the test itself, at a chosen point of the engine's loop
(a real SIGTERM to this process: the engine's handler takes it), so that the runs are cheap
and the stop lands where the test wants it.
"""

import json
import os
import signal

import jax
import numpy as np
import pytest
from support.runs import tiny_trained_workdir

from configs import extract_features as extract_config
from configs import linear_eval as linear_eval_config
from jssl import engines
from jssl.engines import extract_features, linear_eval
from jssl.evaluation import linear

pytestmark = pytest.mark.e2e  # the end-to-end tier (JSSL_E2E_TESTS=1)


@pytest.fixture(scope="module")
def blob_features(tmp_path_factory):
    """Cached features of one layer in extract_features' layout: 4 separable classes."""
    directory = str(tmp_path_factory.mktemp("features"))
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(4, 16)) * 3.0
    for split, n in (("train", 256), ("test", 64)):
        labels = rng.integers(0, 4, n)
        feats = centres[labels] + 0.5 * rng.normal(size=(n, 16))
        os.makedirs(os.path.join(directory, split))
        prefix = os.path.join(directory, split, "avgpool_")
        np.save(prefix + "features.npy", feats.astype(np.float32))
        np.save(prefix + "targets.npy", labels.astype(np.int64))
        np.save(prefix + "inds.npy", np.arange(n, dtype=np.int64))
    return directory


def _linear_config(features_dir):
    """2 epochs of 8 steps over the cached features, a grid of 2 points chosen on 10% held
    out, asynchronous saves at the end of each epoch only."""
    config = linear_eval_config.get_config("test")
    config.linear.layers = ("avgpool",)
    config.linear.cached_features = features_dir
    config.linear.num_classes = 4
    config.linear.lrs = (0.1, 0.5)
    config.linear.val_fraction = 0.1
    config.data.train_split, config.data.test_split = "train", "test"
    config.data.train_subset = -1
    config.data.batch_size = 28
    config.num_epochs = 2
    config.checkpoint.async_save = True
    return config


def _sigterm_at_step(monkeypatch, step: int) -> None:
    """SIGTERM to this process while the heads' step ``step`` runs."""
    make_train_step = linear.make_train_step

    def make_with_signal(*args, **kwargs):
        train_step = make_train_step(*args, **kwargs)
        calls = []

        def step_fn(state, trunk, batch):
            calls.append(1)
            if len(calls) == step:
                os.kill(os.getpid(), signal.SIGTERM)
            return train_step(state, trunk, batch)

        return step_fn

    monkeypatch.setattr(linear, "make_train_step", make_with_signal)


def test_linear_eval_sigterm_saves_exits_75_and_resumes_to_the_same_result(
    blob_features, tmp_path, monkeypatch
):
    whole = linear_eval.run(_linear_config(blob_features), str(tmp_path / "whole"))
    assert whole["step"] == 16

    workdir = str(tmp_path / "stopped")
    before = signal.getsignal(signal.SIGTERM)
    with monkeypatch.context() as patch:
        _sigterm_at_step(patch, 5)
        stopped = linear_eval.run(_linear_config(blob_features), workdir)
    assert signal.getsignal(signal.SIGTERM) is before
    assert stopped == {"preempted": True, "step": 5}
    assert engines.exit_status(stopped) == 75
    # The save in flight completed: step 5, whole, and no orbax temporary directory.
    assert os.listdir(os.path.join(workdir, "checkpoints")) == ["5"]
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "5", "state"))
    assert not os.path.exists(os.path.join(workdir, "results.json"))

    resumed = linear_eval.run(_linear_config(blob_features), workdir)
    assert resumed["step"] == 16 and resumed["results"] == whole["results"]
    with open(os.path.join(workdir, "results.json")) as f:
        assert (
            json.load(f)["layers"]["avgpool"]["grid"]
            == whole["record"]["layers"]["avgpool"]["grid"]
        )
    for a, b in zip(
        jax.tree.leaves(jax.device_get(resumed["state"].params)),
        jax.tree.leaves(jax.device_get(whole["state"].params)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def _extract_config(shared_dirs, trained):
    config = extract_config.get_config("test")  # train[:64], test[:40]; batches of 16
    config.data.data_dir = shared_dirs[0]
    config.init.checkpoint = trained
    config.extract.layers = ("avgpool",)
    return config


def test_extraction_sigterm_keeps_finished_splits_and_a_rerun_extracts_the_rest(
    shared_dirs, tmp_path_factory, tmp_path, monkeypatch
):
    trained = tiny_trained_workdir(tmp_path_factory)
    whole = str(tmp_path / "whole")
    engines.run(_extract_config(shared_dirs, trained), whole)

    workdir = str(tmp_path / "stopped")
    iterate = extract_features.features.iterate_features
    batches = []

    def iterate_with_sigterm(*args, **kwargs):
        for item in iterate(*args, **kwargs):
            batches.append(1)
            if len(batches) == 6:  # the second batch of test[:40], after train[:64]'s four
                os.kill(os.getpid(), signal.SIGTERM)
            yield item

    with monkeypatch.context() as patch:
        patch.setattr(extract_features.features, "iterate_features", iterate_with_sigterm)
        stopped = engines.run(_extract_config(shared_dirs, trained), workdir)
    assert stopped == {"preempted": True} and engines.exit_status(stopped) == 75
    features_dir = os.path.join(workdir, "features")
    assert sorted(os.listdir(features_dir)) == [
        "config.json",
        "source.json",
        "test@0-40",
        "train@0-64",
    ]
    assert os.listdir(os.path.join(features_dir, "test@0-40")) == []  # nothing half-written
    train_files = os.path.join(features_dir, "train@0-64", "avgpool_features.npy")
    written = os.stat(train_files).st_mtime_ns

    extract_split, calls = extract_features._extract_split, []

    def counted(config, extract_workdir, split, *args):
        calls.append(split)
        return extract_split(config, extract_workdir, split, *args)

    monkeypatch.setattr(extract_features, "_extract_split", counted)
    summary = engines.run(_extract_config(shared_dirs, trained), workdir)
    assert calls == ["test[:40]"]  # train[:64] was kept, untouched
    assert os.stat(train_files).st_mtime_ns == written
    assert (
        summary["train[:64]"]["num_examples"] == 64 and summary["test[:40]"]["num_examples"] == 40
    )
    for name in ("train@0-64", "test@0-40"):
        for kind in ("features", "targets", "inds"):
            file = os.path.join(name, f"avgpool_{kind}.npy")
            np.testing.assert_array_equal(
                np.load(os.path.join(features_dir, file)),
                np.load(os.path.join(whole, "features", file)),
            )
