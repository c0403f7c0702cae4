"""k-means over a memory bank and DeepCluster-v2's cluster-prediction loss
(jssl/losses/clustering.py), eagerly: hand-computed clusters, an empty cluster, masked rows,
blocks, the initial draw's determinism, a numpy transcription of VISSL's ``cluster_memory`` on
random data, and the loss against hand-computed cross-entropies."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jssl import losses


def _unit(angle: float) -> list[float]:
    return [math.cos(angle), math.sin(angle)]


# Two clusters on the unit circle: three rows around angle 0, two at pi/2 and pi/2 + 0.3.
ROWS = np.array([_unit(0.0), _unit(0.2), _unit(-0.2), _unit(math.pi / 2), _unit(1.87)])
ROWS[4] = _unit(math.pi / 2 + 0.3)


def test_kmeans_finds_the_two_clusters_and_their_normalised_means():
    centroids, assigned, sizes = losses.kmeans(jnp.asarray(ROWS), jnp.asarray(ROWS[[1, 3]]), 3)
    np.testing.assert_array_equal(assigned, [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(sizes, [3, 2])
    # The mean of angles 0, 0.2, -0.2 points along angle 0; of pi/2 and pi/2 + 0.3, halfway.
    np.testing.assert_allclose(centroids, [_unit(0.0), _unit(math.pi / 2 + 0.15)], atol=1e-6)


def test_an_empty_cluster_keeps_its_centroid_and_masked_rows_take_no_part():
    start = np.array([ROWS[1], ROWS[3], _unit(math.pi)])  # nothing lies near angle pi
    centroids, assigned, sizes = losses.kmeans(jnp.asarray(ROWS), jnp.asarray(start), 2)
    np.testing.assert_array_equal(assigned, [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(sizes, [3, 2, 0])
    np.testing.assert_allclose(centroids[2], _unit(math.pi), atol=1e-7)
    # A row near angle pi joins cluster 2 and moves it, unless it is masked out.
    rows = np.concatenate([ROWS, [_unit(math.pi - 0.4)]])
    centroids, assigned, sizes = losses.kmeans(jnp.asarray(rows), jnp.asarray(start), 2)
    np.testing.assert_array_equal(assigned, [0, 0, 0, 1, 1, 2])
    np.testing.assert_allclose(centroids[2], _unit(math.pi - 0.4), atol=1e-6)
    valid = np.array([True] * 5 + [False])
    centroids, assigned, sizes = losses.kmeans(jnp.asarray(rows), jnp.asarray(start), 2, valid)
    np.testing.assert_array_equal(assigned, [0, 0, 0, 1, 1, -1])
    np.testing.assert_array_equal(sizes, [3, 2, 0])
    np.testing.assert_allclose(centroids[2], _unit(math.pi), atol=1e-7)


def _vissl_kmeans(memory: np.ndarray, start: np.ndarray, num_iters: int):
    """VISSL's ``cluster_memory`` for one head on one process, transcribed to numpy."""
    centroids = start.copy()
    for n_iter in range(num_iters + 1):
        assignments = np.argmax(memory @ centroids.T, axis=1)
        if n_iter == num_iters:
            break
        counts = np.bincount(assignments, minlength=len(centroids))
        sums = np.zeros_like(centroids)
        np.add.at(sums, assignments, memory)
        mask = counts > 0
        centroids[mask] = sums[mask] / counts[mask, None]
        centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    return centroids, assignments


def _random_bank(seed: int, rows: int):
    """Unit rows, 11 of them as initial centroids, and VISSL's 5-iteration clustering."""
    rs = np.random.RandomState(seed)
    memory = rs.normal(size=(rows, 8))
    memory /= np.linalg.norm(memory, axis=1, keepdims=True)
    start = memory[rs.permutation(rows)[:11]]
    want_centroids, want_assigned = _vissl_kmeans(memory, start, 5)
    assert len(np.unique(want_assigned)) > 5  # a real clustering, not one cluster
    x, c = jnp.asarray(memory, jnp.float32), jnp.asarray(start, jnp.float32)
    return x, c, want_centroids, want_assigned


def test_kmeans_matches_vissls_loop_on_random_data_in_any_block_size():
    x, c, want_centroids, want_assigned = _random_bank(0, 203)
    for block_size in (7, 64, 4096):  # padded last block, several blocks, one block
        centroids, assigned, sizes = losses.kmeans(x, c, 5, block_size=block_size)
        np.testing.assert_array_equal(assigned, want_assigned)
        np.testing.assert_allclose(centroids, want_centroids, atol=2e-6)
        np.testing.assert_array_equal(sizes, np.bincount(want_assigned, minlength=11))


def test_kmeans_over_shards_of_the_rows_is_the_same_clustering():
    # The parts a bank split over 4 or 8 devices holds, each summed apart, then added.
    x, c, want_centroids, want_assigned = _random_bank(1, 200)
    for shards, block_size in ((4, 7), (8, 4096)):
        centroids, assigned, sizes = losses.kmeans(x, c, 5, block_size=block_size, shards=shards)
        np.testing.assert_array_equal(assigned, want_assigned)
        np.testing.assert_allclose(centroids, want_centroids, atol=2e-6)
        np.testing.assert_array_equal(sizes, np.bincount(want_assigned, minlength=11))
    with pytest.raises(ValueError, match="do not split into 3 shards"):
        losses.kmeans(x, c, 1, shards=3)


def test_initial_centroids_are_distinct_valid_rows_drawn_by_the_key():
    rows = jnp.arange(100 * 2, dtype=jnp.float32).reshape(100, 2)
    valid = jnp.arange(100) % 3 != 0
    key = jax.random.key(7)
    first = np.asarray(losses.initial_centroids(key, rows, 10, valid))
    again = np.asarray(losses.initial_centroids(key, rows, 10, valid))
    other = np.asarray(losses.initial_centroids(jax.random.key(8), rows, 10, valid))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(np.sort(first[:, 0]), np.sort(other[:, 0]))
    picked = first[:, 0].astype(int) // 2
    assert len(set(picked)) == 10 and all(p % 3 != 0 for p in picked)
    with pytest.raises(ValueError, match="at least as many rows"):
        losses.initial_centroids(key, rows, 101)


def _cross_entropy(logits: list[float], target: int) -> float:
    return math.log(sum(math.exp(v) for v in logits)) - logits[target]


def test_loss_is_the_cross_entropy_averaged_over_crops_and_heads():
    # Two crops of two examples in 2-d; head 0 has 2 centroids, head 1 has 3; T = 0.5.
    z = jnp.array([[[1.0, 0.0], [0.0, 1.0]], [[0.6, 0.8], [1.0, 0.0]]])
    heads = [jnp.array([[1.0, 0.0], [0.0, 1.0]]), jnp.array([[0.0, 1.0], [-1.0, 0.0], [0.6, 0.8]])]
    targets = jnp.array([[0, -1], [2, 1]])  # example 1 has no target in head 0
    per_example, metrics = losses.cluster_prediction_loss(z, heads, targets, temperature=0.5)
    # Scores / T, by hand: head 0, example 0: crop 0 (2, 0), crop 1 (1.2, 1.6).
    head0 = [(_cross_entropy([2, 0], 0) + _cross_entropy([1.2, 1.6], 0)) / 2, 0.0]
    # Head 1: example 0 crop 0 (0, -2, 1.2), crop 1 (1.6, -1.2, 2); example 1 crop 0 (2, 0, 1.6),
    # crop 1 (0, -2, 1.2).
    head1 = [
        (_cross_entropy([0, -2, 1.2], 2) + _cross_entropy([1.6, -1.2, 2], 2)) / 2,
        (_cross_entropy([2, 0, 1.6], 1) + _cross_entropy([0, -2, 1.2], 1)) / 2,
    ]
    np.testing.assert_allclose(per_example, np.add(head0, head1) / 2, rtol=1e-6)
    # Argmax hits: head 0 crop 0 of example 0 only (1 of 4 pairs); head 1 example 0 both crops.
    np.testing.assert_allclose(metrics["prediction_accuracy"], 100 * (1 / 4 + 2 / 4) / 2)
    np.testing.assert_allclose(metrics["targets_valid"], 3 / 4)
    # No gradient reaches an example without targets, nor the centroids.
    grad_z, grad_c = jax.grad(
        lambda z, c: jnp.sum(losses.cluster_prediction_loss(z, c, targets[:1], 0.5)[0]),
        argnums=(0, 1),
    )(z, heads[:1])
    np.testing.assert_array_equal(grad_z[:, 1], 0.0)
    assert np.abs(grad_z[:, 0]).max() > 0
    np.testing.assert_array_equal(grad_c[0], 0.0)
