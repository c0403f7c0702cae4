"""Tests for evaluation.knn against a brute-force numpy weighted kNN (Wu et al. 2018), and of the
device-sharded bank against the host implementation.

Run as a script (``python tests/test_knn.py OUT.npz``) this file runs the sharded kNN cases
on every visible device and saves the results; the 4-device test starts it in a fresh process
with XLA_FLAGS forcing 4 CPU devices, as JAX may already have one device in pytest.
"""

import os
import signal
import sys

import jax
import numpy as np
import pytest
from support.devices import run_on_devices

from configs import knn as knn_config
from configs import moco
from jssl import engines, parallel
from jssl.engines import knn as knn_engine
from jssl.evaluation import knn, knn_sharded
from jssl.evaluation.batches import from_host_batches
from jssl.training import preemption


def _reference_scores(train, train_labels, test, num_classes, k, temperature):
    """The whole (n_test, n_train) similarity matrix at once, as VISSL's knn_utils does."""
    train = train / np.linalg.norm(train, axis=1, keepdims=True)
    test = test / np.linalg.norm(test, axis=1, keepdims=True)
    sims = test.astype(np.float64) @ train.T.astype(np.float64)
    idx = np.argsort(-sims, axis=1)[:, :k]
    top = np.take_along_axis(sims, idx, axis=1)
    scores = np.zeros((len(test), num_classes))
    for i in range(len(test)):
        np.add.at(scores[i], train_labels[idx[i]], np.exp(top[i] / temperature))
    return scores


@pytest.mark.parametrize(
    "n_train, n_test, k, query_chunk, bank_chunk",
    [
        (103, 37, 10, 8, 16),  # uneven: last query and bank chunks padded
        (103, 37, 20, 1024, 65536),  # default chunks, clamped to the data
        (50, 9, 12, 4, 5),  # bank chunk smaller than k
    ],
)
def test_matches_brute_force(n_train, n_test, k, query_chunk, bank_chunk):
    rng = np.random.default_rng(0)
    num_classes, d = 7, 16
    train = rng.normal(size=(n_train, d)).astype(np.float32)
    labels = rng.integers(0, num_classes, n_train)
    test = rng.normal(size=(n_test, d)).astype(np.float32)
    got = knn.knn_scores(
        train,
        labels,
        test,
        num_classes=num_classes,
        k=k,
        temperature=0.07,
        query_chunk=query_chunk,
        bank_chunk=bank_chunk,
    )
    want = _reference_scores(train, labels, test, num_classes, k, 0.07)
    assert got.shape == (n_test, num_classes) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_separable_toy_is_perfect():
    # Each class clusters tightly around its own axis; every query is near one axis.
    rng = np.random.default_rng(1)
    num_classes, per_class = 6, 10
    centres = np.eye(num_classes, 8, dtype=np.float32)
    labels = np.repeat(np.arange(num_classes), per_class)
    train = centres[labels] + 0.01 * rng.normal(size=(len(labels), 8)).astype(np.float32)
    test_labels = np.arange(num_classes).repeat(2)
    test = centres[test_labels] + 0.01 * rng.normal(size=(len(test_labels), 8)).astype(np.float32)
    acc = knn.knn_accuracy(
        train, labels, test, test_labels, num_classes=num_classes, k=5, bank_chunk=7
    )
    assert acc == {"top1": 100.0, "top5": 100.0}


def test_k_larger_than_bank_is_clamped(caplog):
    rng = np.random.default_rng(2)
    train = rng.normal(size=(5, 4)).astype(np.float32)
    labels = np.array([0, 1, 1, 2, 0])
    test = rng.normal(size=(3, 4)).astype(np.float32)
    got = knn.knn_scores(train, labels, test, num_classes=3, k=200, bank_chunk=2)
    want = _reference_scores(train, labels, test, 3, 5, 0.1)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert "exceeds the bank size" in caplog.text


def test_topk_accuracy():
    scores = np.array([[0.1, 0.5, 0.4], [0.9, 0.05, 0.05]])
    acc = knn.topk_accuracy(scores, np.array([2, 0]), topk=(1, 2, 5))
    assert acc == {"top1": 50.0, "top2": 100.0, "top5": 100.0}


def test_bad_labels_raise():
    with pytest.raises(ValueError, match="outside"):
        knn.knn_scores(np.ones((3, 2)), np.array([0, 1, 3]), np.ones((1, 2)), num_classes=3)


# (n_train, n_test, k, batch, block_rows): every case has padding rows in the last bank and
# query batch; block_rows < batch * batches leaves unused slots in the last block.
SHARDED_CASES = (
    (103, 37, 10, 8, 16),  # 4 devices: 4 bank rows per device and block, fewer than k
    (50, 9, 60, 8, 8192),  # k larger than the whole bank: clamped like knn_scores
    (40, 16, 1, 8, 24),  # k=1
)


def _pairs(x, labels, batch, mesh):
    """(features, EvalBatch) of ``x`` in batches of ``batch``, the last padded."""
    host = []
    for start in range(0, len(x), batch):
        rows = np.arange(start, start + batch)
        mask = rows < len(x)
        rows = np.where(mask, rows, 0)  # padding rows repeat example 0, masked out
        host.append({"features": x[rows], "label": labels[rows], "index": rows, "mask": mask})
    return [(b.batch["features"], b) for b in from_host_batches(host, mesh)]


def _sharded_case(n_train, n_test, k, batch, block_rows, mesh):
    """(sharded top-k accuracies, host knn_accuracy, sharded top-k sims, bank size)."""
    rng = np.random.default_rng(n_train)
    num_classes, d = 7, 6
    # A (n, 2, 3) feature map: both implementations flatten it.
    train = rng.normal(size=(n_train, 2, 3)).astype(np.float32)
    train_labels = rng.integers(0, num_classes - 1, n_train)  # class 6 only among queries
    test = rng.normal(size=(n_test, 2, 3)).astype(np.float32)
    test_labels = rng.integers(0, num_classes, n_test)

    train_pairs = _pairs(train, train_labels, batch, mesh)
    bank = knn_sharded.build_bank(train_pairs, mesh, block_rows=block_rows)
    # k beyond the bank is clamped (with a warning), as knn_scores does.
    neighbours = knn_sharded.search(bank, _pairs(test, test_labels, batch, mesh), k)
    np.testing.assert_array_equal(neighbours.query_labels, test_labels)
    num_classes_seen = neighbours.num_classes
    assert num_classes_seen == int(max(train_labels.max(), test_labels.max())) + 1
    got = neighbours.accuracy(
        k,
        temperature=0.07,
        chunk=16,  # several vote chunks, the last one padded
    )
    want = knn.knn_accuracy(
        train.reshape(n_train, d),
        train_labels,
        test.reshape(n_test, d),
        test_labels,
        num_classes=num_classes_seen,
        k=k,
        temperature=0.07,
    )
    return got, want, neighbours.sims, bank.num_examples


def _run_sharded_cases(mesh) -> dict[str, np.ndarray]:
    out = {}
    for i, case in enumerate(SHARDED_CASES):
        got, want, sims, count = _sharded_case(*case, mesh)
        out[f"got{i}"] = np.array([got["top1"], got["top5"]])
        out[f"want{i}"] = np.array([want["top1"], want["top5"]])
        out[f"sims{i}"], out[f"count{i}"] = sims, np.array(count)
    return out


def _check_sharded(results):
    for i, case in enumerate(SHARDED_CASES):
        np.testing.assert_array_equal(results[f"got{i}"], results[f"want{i}"], err_msg=str(case))
        assert int(results[f"count{i}"]) == case[0]
        n_train, n_test, k = case[:3]
        # Every query found min(k, n_train) real neighbours, best first.
        sims = results[f"sims{i}"]
        assert sims.shape == (n_test, min(k, n_train)) and np.all(np.isfinite(sims))
        assert np.all(np.diff(sims, axis=1) <= 0)


def test_sharded_bank_matches_host_knn_on_one_device():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), (parallel.DATA_AXIS,))
    _check_sharded(_run_sharded_cases(mesh))


def test_sharded_bank_matches_host_knn_on_four_devices(tmp_path):
    results = run_on_devices(__file__, tmp_path / "four.npz")
    assert int(results["num_devices"]) == 4
    _check_sharded(results)


def test_sharded_bank_keeps_rows_on_their_devices():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), (parallel.DATA_AXIS,))
    builder = knn_sharded.BankBuilder(mesh, block_rows=16)
    x = parallel.host_batch_to_global(
        (np.ones((8, 3), np.float32), np.zeros(8, np.int32), np.ones(8, bool)), mesh
    )
    for _ in range(3):
        builder.add(*x)
    bank = builder.finish()
    assert bank.num_examples == 24 and bank.max_label == 0 and len(bank.blocks) == 2
    features = bank.blocks[0][0]
    assert features.shape == (2, 8, 3)
    assert features.sharding.spec == jax.sharding.PartitionSpec(None, parallel.DATA_AXIS)
    with pytest.raises(ValueError, match="feature dims differ"):
        knn_sharded.sharded_top_k(
            bank, parallel.host_batch_to_global(np.ones((8, 5), np.float32), mesh), 3
        )


def test_one_search_serves_every_smaller_k():
    """The kNN engine searches once at the largest k; each smaller k reads its first columns."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), (parallel.DATA_AXIS,))
    rng = np.random.default_rng(1)
    train, test = (rng.normal(size=(n, 5)).astype(np.float32) for n in (30, 11))
    bank = knn_sharded.build_bank(_pairs(train, rng.integers(0, 4, 30), 8, mesh), mesh)
    queries = _pairs(test, rng.integers(0, 4, 11), 8, mesh)
    once = knn_sharded.search(bank, queries, 20)
    assert once.sims.shape == (11, 20)
    for k in (1, 3, 20):
        alone = knn_sharded.search(bank, queries, k)
        np.testing.assert_array_equal(once.sims[:, :k], alone.sims)
        assert once.accuracy(k, 0.1) == alone.accuracy(k, 0.1)
    with pytest.raises(ValueError, match="kept only the top 20"):
        once.accuracy(21, 0.1)
    # A k beyond the bank is clamped to it: a search of 40 keeps the 30 rows.
    beyond = knn_sharded.search(bank, queries, 40)
    assert beyond.sims.shape == (11, 30)
    assert beyond.accuracy(40, 0.1) == beyond.accuracy(30, 0.1)


if __name__ == "__main__":
    np.savez(
        sys.argv[1], num_devices=jax.device_count(), **_run_sharded_cases(parallel.make_mesh())
    )


def _features_dir(tmp_path) -> str:
    """A tiny extract_features output: 3 classes of random 4-d avgpool features."""
    rng = np.random.default_rng(0)
    directory = tmp_path / "features"
    for split, n in (("train", 30), ("test", 12)):
        os.makedirs(directory / split)
        np.save(directory / split / "avgpool_features.npy", rng.normal(size=(n, 4)))
        np.save(directory / split / "avgpool_targets.npy", rng.integers(0, 3, n))
        np.save(directory / split / "avgpool_inds.npy", np.arange(n))
    return str(directory)


def _engine_config(features_dir: str, **overrides):
    config = knn_config.get_config("test")
    config.knn.features_dir = features_dir
    config.knn.train_split, config.knn.test_split = "train", "test"
    config.update_from_flattened_dict(overrides)
    return config


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"knn.temperature": 0.0}, r"knn.temperature=0.0 must be a finite number > 0"),
        ({"knn.temperature": -0.07}, r"knn.temperature=-0.07 must be a finite number > 0"),
        ({"knn.temperature": float("inf")}, r"knn.temperature=inf must be a finite number"),
        ({"knn.temperature": float("nan")}, r"knn.temperature=nan must be a finite number"),
        ({"knn.ks": (0, 5)}, r"knn.ks=\(0, 5\): every k must be an integer >= 1"),
        ({"knn.ks": (), "knn.k": -1}, r"knn.k=-1: every k must be an integer >= 1"),
        ({"knn.layer": ""}, r"knn.layer='' must name a trunk tap"),
    ],
)
def test_knn_settings_that_make_the_result_meaningless_are_refused(tmp_path, overrides, message):
    # knn.temperature=0 used to exit 0 with a wrong top-1 recorded as a normal result.
    config = _engine_config(_features_dir(tmp_path), **overrides)
    workdir = tmp_path / "knn"
    with pytest.raises(ValueError, match=message):
        engines.run(config, str(workdir))
    assert not workdir.exists()


def test_knn_batch_size_is_checked_only_when_features_are_computed(tmp_path):
    features_dir = _features_dir(tmp_path)
    knn_engine.validate(_engine_config(features_dir, **{"knn.batch_size": 0}))
    config = _engine_config("", **{"knn.batch_size": 0})
    config.init.checkpoint = str(tmp_path / "run")
    with pytest.raises(ValueError, match=r"knn.batch_size=0 must be an integer >= 1"):
        knn_engine.validate(config)


def test_the_train_monitor_settings_are_checked_too():
    config = moco.get_config("demo")
    knn_engine.check_config(config, monitor=True)
    config.knn.temperature = 0.0
    with pytest.raises(ValueError, match=r"knn.temperature=0.0"):
        knn_engine.check_config(config, monitor=True)
    config.knn.temperature, config.knn.k = 0.07, 0
    with pytest.raises(ValueError, match=r"knn.k=0"):
        knn_engine.check_config(config, monitor=True)


def test_valid_knn_settings_run(tmp_path):
    results = engines.run(_engine_config(_features_dir(tmp_path)), str(tmp_path / "knn"))
    assert set(results) >= {"k5", "k20"} and 0 <= results["k5"]["top1"] <= 100


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
    summary = engines.run(_engine_config(features_dir), workdir)
    assert summary == {"preempted": True}
    assert engines.exit_status(summary) == preemption.PREEMPTED_EXIT_CODE
    assert not os.path.exists(os.path.join(workdir, "results.json"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is put back
    rerun = engines.run(_engine_config(features_dir), workdir)
    assert {"k5", "k20"} <= set(rerun) and "preempted" not in rerun


def test_inside_another_engines_preemption_a_stop_is_only_requested(tmp_path, monkeypatch):
    """An evaluator run by evaluate or by training finishes; its caller then stops."""
    _signalled_mid_search(monkeypatch)
    with preemption.Preemption() as outer:
        summary = engines.run(_engine_config(_features_dir(tmp_path)), str(tmp_path / "knn"))
    assert outer.requested and {"k5", "k20"} <= set(summary)
