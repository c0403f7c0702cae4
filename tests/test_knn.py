"""Tests for jssl.knn against a brute-force numpy weighted kNN (Wu et al. 2018)."""

import numpy as np
import pytest

from jssl import knn


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
