"""Tests of the train engine's monitors (jssl/evaluation/monitor.py) on the "test" preset of
configs/moco.py: the test phase is one pass of the evaluation pipeline over the whole test
split, every example written once and sorted, the loss averaged over real rows only, and the
kNN queries taken from that same pass."""

import os

import numpy as np
import pytest
from support.launch import enable_compilation_cache, prepare_shared_dirs

from configs import moco
from jssl import methods, parallel
from jssl.engines import train
from jssl.evaluation import features, monitor
from jssl.evaluation.batches import eval_batches
from jssl.training.step import make_forward

NUM_TEST = 50  # test[:50] in batches of 16: the last batch has 14 padding rows


@pytest.fixture(scope="session")
def shared_dirs(tmp_path_factory):
    return prepare_shared_dirs(tmp_path_factory)


@pytest.fixture(scope="module")
def setup(shared_dirs):
    enable_compilation_cache(shared_dirs[1])
    config = moco.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.data.test_split = f"test[:{NUM_TEST}]"
    config.knn.enabled = True
    config.knn.train_split = "train[:100]"
    config.knn.test_split = config.data.test_split
    config.knn.k = 20
    config.knn.batch_size = 40  # 3 bank batches, the last one half padding
    config.probe.num_classes = 10
    mesh = parallel.make_mesh()
    method = methods.get(config)
    tx, _ = train.make_optimizer(config, method, steps_per_epoch=4)
    state = train.init_state(config, method, tx, mesh)
    return config, method, mesh, state


class _Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def test_test_phase_is_one_pass_over_every_example(setup, tmp_path):
    config, method, mesh, state = setup
    eval_step = _Counted(monitor.make_test_step(config, method, mesh))
    forward = _Counted(make_forward(method, mesh))
    result = monitor.test_phase(
        config, eval_step, forward, state, mesh, workdir=str(tmp_path), epoch=1
    )
    # One eval step per test batch; the network's plain forward only builds the bank.
    assert eval_step.calls == -(-NUM_TEST // config.data.batch_size)
    assert forward.calls == -(-100 // config.knn.batch_size)

    out = tmp_path / "eval" / "epoch_1"
    inds = np.load(out / "inds.npy")
    np.testing.assert_array_equal(inds, np.arange(NUM_TEST))
    per_example_loss = np.load(out / "per_example_loss.npy")
    assert per_example_loss.shape == (NUM_TEST,) and np.all(np.isfinite(per_example_loss))
    # The loss is the mean over real rows: padding rows count nowhere.
    assert result["num_examples"] == NUM_TEST
    assert np.isfinite(result["loss"])
    np.testing.assert_allclose(result["loss"], per_example_loss.mean(), rtol=1e-5)
    assert os.path.exists(out / "embedding_pca.png")

    # The outputs are of the evaluation transform (centre crop), not of augmented views.
    batches = eval_batches(config.data, config.data.test_split, config.data.batch_size, mesh)
    clean = features.collect_features(
        lambda images: make_forward(method, mesh)(state, images), batches, ["avgpool"]
    )
    np.testing.assert_array_equal(clean.labels, np.load(out / "labels.npy"))
    np.testing.assert_allclose(
        np.load(out / "features.npy"), clean.features["avgpool"], rtol=1e-4, atol=1e-5
    )

    # kNN (and the online probe) from the same pass equal a separate kNN evaluation.
    separate = monitor.knn_eval(config, make_forward(method, mesh), state, mesh)
    knn_result = {k[4:]: v for k, v in result.items() if k.startswith("knn_")}
    assert set(knn_result) == {"top1", "top5", "probe_top1", "probe_top5"}
    assert knn_result == pytest.approx(separate)


def test_test_phase_without_knn_or_outputs(setup, tmp_path):
    config, method, mesh, state = setup
    config = config.copy_and_resolve_references()
    config.knn.enabled = False
    config.eval_outputs = False
    result = monitor.test_phase(
        config,
        monitor.make_test_step(config, method, mesh),
        make_forward(method, mesh),
        state,
        mesh,
        workdir=str(tmp_path),
        epoch=2,
    )
    assert result["num_examples"] == NUM_TEST and np.isfinite(result["loss"])
    assert not any(k.startswith("knn_") for k in result)
    assert not os.path.exists(tmp_path / "eval")


def test_knn_layer_outside_the_method_outputs_is_tapped_in_the_eval_step(setup, tmp_path):
    config, method, mesh, state = setup
    config = config.copy_and_resolve_references()
    config.knn.layer = "res5"  # a (n, 1, 1, c) map at 16 px: kNN flattens it
    config.eval_outputs = False
    eval_step = monitor.make_test_step(config, method, mesh)
    forward = _Counted(make_forward(method, mesh))
    result = monitor.test_phase(
        config, eval_step, forward, state, mesh, workdir=str(tmp_path), epoch=1
    )
    assert forward.calls == -(-100 // config.knn.batch_size)  # the bank only
    separate = monitor.knn_eval(config, make_forward(method, mesh), state, mesh)
    assert {k[4:]: v for k, v in result.items() if k.startswith("knn_")} == pytest.approx(separate)
