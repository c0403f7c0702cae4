"""Loss functions against small hand-computed cases."""

import math

import jax.numpy as jnp
import numpy as np

from jssl import losses


def test_info_nce_hand_computed():
    # One query, its positive key and two queued negatives, in 2-D; temperature 0.5.
    query = jnp.array([[2.0, 0.0]])  # normalised to (1, 0)
    key = jnp.array([[3.0, 0.0]])  # normalised to (1, 0): cosine 1
    queue = jnp.array([[0.0, 1.0], [-1.0, 0.0]])  # cosines 0 and -1
    loss, metrics, per_example = losses.info_nce_with_queue(query, key, queue, temperature=0.5)
    np.testing.assert_allclose(per_example, [loss], rtol=1e-6)
    # logits = (1, 0, -1) / 0.5 = (2, 0, -2); cross-entropy with the positive at index 0.
    expected = math.log(math.exp(2) + math.exp(0) + math.exp(-2)) - 2
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    assert float(metrics["contrastive_acc"]) == 1.0
    np.testing.assert_allclose(metrics["pos_similarity"], 1.0)
    np.testing.assert_allclose(metrics["neg_similarity"], -0.5)


def test_info_nce_batch_mean_and_wrong_positive():
    query = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    key = jnp.array([[1.0, 0.0], [1.0, 0.0]])  # second query's positive is orthogonal
    queue = jnp.array([[0.0, 1.0]])
    loss, metrics, per_example = losses.info_nce_with_queue(query, key, queue, temperature=1.0)
    first = math.log(math.e + 1) - 1  # logits (1, 0)
    second = math.log(1 + math.e) - 0  # logits (0, 1)
    np.testing.assert_allclose(loss, (first + second) / 2, rtol=1e-6)
    np.testing.assert_allclose(per_example, [first, second], rtol=1e-6)
    assert float(metrics["contrastive_acc"]) == 0.5


def test_l2_normalize_zero_safe():
    out = losses.l2_normalize(jnp.zeros((2, 3)))
    assert np.all(np.isfinite(out))
