"""Loss functions against small hand-computed cases."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jssl import losses


def _jit(fn, *arrays, traced=None, **settings):
    """fn(*arrays, **traced, **settings) compiled once, settings static: much faster on CPU
    than op-by-op dispatch."""
    return jax.jit(functools.partial(fn, **settings))(*arrays, **(traced or {}))


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


# ------------------------------------------------------------------------------------------
# SimCLR. References in numpy, written from the formulas (SimCLR Eq. 1; VISSL's masks).
# ------------------------------------------------------------------------------------------


def _np_multicrop_simclr(crops, temperature):
    """Per-image losses: every (anchor, positive) pair of crops of one image, negatives all
    crops of the other images; mean over the C * (C - 1) pairs of each image."""
    z = crops / np.linalg.norm(crops, axis=-1, keepdims=True)
    num_crops, n, _ = z.shape
    per_image = np.zeros(n)
    for a in range(num_crops):
        for i in range(n):
            neg = sum(
                math.exp(z[a, i] @ z[b, j] / temperature)
                for b in range(num_crops)
                for j in range(n)
                if j != i
            )
            for b in range(num_crops):
                if b != a:
                    pos = math.exp(z[a, i] @ z[b, i] / temperature)
                    per_image[i] -= math.log(pos / (pos + neg))
    return per_image / (num_crops * (num_crops - 1))


def test_simclr_hand_computed():
    # Two images in 2-D, T = 0.5. Image 0: views (1, 0) and (0, 1) (cosine 0); image 1: views
    # (-1, 0) and (-2, 0) (cosine 1). Each anchor's denominator has the 3 other embeddings.
    view1 = jnp.array([[1.0, 0.0], [-1.0, 0.0]])
    view2 = jnp.array([[0.0, 1.0], [-2.0, 0.0]])
    loss, metrics, per_example = _jit(losses.simclr_info_nce, view1, view2, temperature=0.5)
    e = math.exp
    # anchor (1,0): pos cos 0; others cos -1, -1. anchor (0,1): pos 0; others 0, 0.
    a00 = -math.log(e(0) / (e(0) + 2 * e(-2)))
    a01 = -math.log(e(0) / (e(0) + 2 * e(0)))
    # anchor (-1,0): pos cos 1; others -1, 0. anchor (-2,0) the same.
    a10 = -math.log(e(2) / (e(2) + e(-2) + e(0)))
    np.testing.assert_allclose(per_example, [(a00 + a01) / 2, a10], rtol=1e-6)
    np.testing.assert_allclose(loss, (a00 + a01 + 2 * a10) / 4, rtol=1e-6)
    # Positives beat all negatives for anchors (1,0), (-1,0), (-2,0); (0,1) ties at 0.
    np.testing.assert_allclose(metrics["contrastive_acc"], 0.75)
    np.testing.assert_allclose(metrics["pos_similarity"], 0.5)
    # Negatives (2 per anchor): (-1,-1), (0,0), (-1,0), (-1,0) -> mean -4/8.
    np.testing.assert_allclose(metrics["neg_similarity"], -0.5, atol=1e-7)


def test_simclr_random_against_numpy():
    rs = np.random.RandomState(0)
    views = rs.randn(2, 5, 3)
    loss, _, per_example = _jit(losses.simclr_info_nce, views[0], views[1], temperature=0.2)
    expected = _np_multicrop_simclr(views, 0.2)
    np.testing.assert_allclose(per_example, expected, rtol=1e-5)
    np.testing.assert_allclose(loss, expected.mean(), rtol=1e-5)


def test_multicrop_simclr_against_numpy():
    # 2 large + 2 small crops: all 12 (anchor, positive) pairs of an image count once.
    rs = np.random.RandomState(1)
    crops = rs.randn(4, 3, 5)
    loss, metrics, per_example = _jit(
        losses.multicrop_simclr_info_nce, [jnp.asarray(c) for c in crops], temperature=0.3
    )
    expected = _np_multicrop_simclr(crops, 0.3)
    np.testing.assert_allclose(per_example, expected, rtol=1e-5)
    np.testing.assert_allclose(loss, expected.mean(), rtol=1e-5)
    assert 0.0 <= float(metrics["contrastive_acc"]) <= 1.0


def test_multicrop_simclr_other_crops_of_the_image_are_not_negatives():
    # One image, three identical crops, and one orthogonal other image: each pair's
    # denominator holds its positive and the 3 crops of the other image, not the third crop.
    crops = jnp.array([[[1.0, 0.0], [0.0, 1.0]]] * 3)
    loss, metrics, _ = _jit(losses.multicrop_simclr_info_nce, crops, temperature=1.0)
    expected = -math.log(math.e / (math.e + 3))  # cosines: positive 1, negatives 0
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    assert float(metrics["contrastive_acc"]) == 1.0


def test_simclr_needs_two_crops_of_one_shape():
    with pytest.raises(ValueError, match="at least 2"):
        losses.multicrop_simclr_info_nce(jnp.ones((1, 2, 3)))
    with pytest.raises(ValueError, match="same images"):
        losses.multicrop_simclr_info_nce([jnp.ones((2, 3)), jnp.ones((3, 3))])


# ------------------------------------------------------------------------------------------
# SwAV. Sinkhorn as the paper's Alg. 1 (distributed_sinkhorn, one device), in float64.
# ------------------------------------------------------------------------------------------


def _np_sinkhorn(scores, epsilon, num_iters):
    q = np.exp(np.asarray(scores, np.float64) / epsilon).T  # (K, B)
    q /= q.sum()
    num_prototypes, batch = q.shape
    for _ in range(num_iters):
        q /= q.sum(axis=1, keepdims=True) * num_prototypes
        q /= q.sum(axis=0, keepdims=True) * batch
    return (q * batch).T


def _np_log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _np_swav(scores, crops_for_assign, temperature, epsilon, num_iters, queue=None):
    num_crops, batch, _ = scores.shape
    total = np.zeros(batch)
    for i, crop in enumerate(crops_for_assign):
        assign = scores[crop] if queue is None else np.concatenate([scores[crop], queue[i]])
        codes = _np_sinkhorn(assign, epsilon, num_iters)[:batch]
        for v in range(num_crops):
            if v != crop:
                log_p = _np_log_softmax(scores[v] / temperature)
                total -= (codes * log_p).sum(axis=1) / (num_crops - 1)
    return total / len(crops_for_assign)


def test_sinkhorn_against_paper_algorithm():
    scores = np.random.RandomState(2).uniform(-1, 1, (6, 4))
    codes = _jit(losses.sinkhorn_knopp, scores, epsilon=0.05, num_iters=3)
    np.testing.assert_allclose(codes, _np_sinkhorn(scores, 0.05, 3), rtol=1e-4, atol=1e-6)


def test_sinkhorn_marginals():
    # Final scaling: each sample's code sums to 1. Converged: every prototype receives the
    # same mass, B / K, the equipartition constraint (SwAV Sec. 3.1).
    scores = np.random.RandomState(3).uniform(-1, 1, (8, 4))
    three = _jit(losses.sinkhorn_knopp, scores, epsilon=0.5, num_iters=3)
    np.testing.assert_allclose(three.sum(axis=1), 1.0, rtol=1e-6)
    converged = _jit(losses.sinkhorn_knopp, scores, epsilon=0.5, num_iters=200)
    np.testing.assert_allclose(converged.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(converged.sum(axis=0), 8 / 4, rtol=1e-5)
    # Not true of the plain softmax of the scores: the equipartition is Sinkhorn's doing.
    assert not np.allclose(np.exp(_np_log_softmax(scores / 0.5)).sum(axis=0), 8 / 4, rtol=1e-2)


def test_sinkhorn_large_scores_do_not_overflow():
    # scores / epsilon up to 400: exp overflows float32 unless the max is subtracted first.
    scores = 20.0 * np.random.RandomState(4).uniform(-1, 1, (6, 3))
    codes = _jit(losses.sinkhorn_knopp, scores, epsilon=0.05)
    assert np.all(np.isfinite(codes))
    np.testing.assert_allclose(codes, _np_sinkhorn(scores, 0.05, 3), atol=1e-5)


def test_sinkhorn_sample_mask_and_hard_assignment():
    scores = jnp.asarray(np.random.RandomState(5).uniform(-1, 1, (7, 3)))
    mask = jnp.array([True, False, True, True, False, True, True])
    masked = _jit(losses.sinkhorn_knopp, scores, traced={"sample_mask": mask}, epsilon=0.3)
    alone = _jit(losses.sinkhorn_knopp, scores[mask], epsilon=0.3)
    np.testing.assert_allclose(masked[mask], alone, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(masked[~mask], 0.0)
    hard = _jit(
        losses.sinkhorn_knopp,
        scores,
        traced={"sample_mask": mask, "hard_assignment": True},
        epsilon=0.3,
    )
    expected = np.eye(3)[np.argmax(masked, axis=1)] * np.asarray(mask)[:, None]
    np.testing.assert_array_equal(hard, expected)


def test_sinkhorn_double_precision():
    scores = jnp.asarray(np.random.RandomState(6).uniform(-1, 1, (5, 3)), jnp.float32)
    with pytest.raises(ValueError, match="jax_enable_x64"):
        losses.sinkhorn_knopp(scores, use_double_precision=True)
    with jax.enable_x64(True):
        double = _jit(losses.sinkhorn_knopp, scores, use_double_precision=True)
    assert double.dtype == jnp.float32
    np.testing.assert_allclose(double, _np_sinkhorn(scores, 0.05, 3), rtol=1e-6, atol=1e-7)


def test_swav_loss_hand_computed():
    # 3 crops of 2 images, 3 prototypes. Assignment crops 0 and 1: crop 0's codes are
    # predicted from crops 1, 2 and crop 1's from crops 0, 2; each averaged over 2 crops.
    scores = np.random.RandomState(7).uniform(-1, 1, (3, 2, 3))
    loss, metrics, per_example = _jit(losses.swav_loss, scores, epsilon=0.3)
    expected = _np_swav(scores, (0, 1), 0.1, 0.3, 3)
    np.testing.assert_allclose(per_example, expected, rtol=1e-5)
    np.testing.assert_allclose(loss, expected.mean(), rtol=1e-5)
    assert float(metrics["code_entropy"]) > 0.0
    only_first = _jit(losses.swav_loss, list(scores), crops_for_assign=(0,))
    np.testing.assert_allclose(only_first[0], _np_swav(scores, (0,), 0.1, 0.05, 3).mean(), 1e-5)


def test_swav_gradient_stops_at_the_codes():
    # With the codes constant, d/ds_v of -sum_k q log softmax(s_v / T) is (softmax - q) / T.
    scores = np.random.RandomState(8).uniform(-1, 1, (3, 4, 5))
    temperature, epsilon, batch = 0.1, 0.3, 4
    grad = jax.jit(jax.grad(lambda s: losses.swav_loss(s, (0, 1), temperature, epsilon)[0]))(
        jnp.asarray(scores)
    )
    expected = np.zeros_like(scores)
    for crop in (0, 1):
        codes = _np_sinkhorn(scores[crop], epsilon, 3)
        for v in range(3):
            if v != crop:
                softmax = np.exp(_np_log_softmax(scores[v] / temperature))
                expected[v] += (softmax - codes) / temperature / batch / 2 / 2
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-6)


def test_swav_queue_joins_sinkhorn_only():
    rs = np.random.RandomState(9)
    scores = rs.uniform(-1, 1, (3, 2, 4))
    queue = rs.uniform(-1, 1, (2, 6, 4))

    def loss_fn(s, q, use_queue):
        return losses.swav_loss(s, epsilon=0.3, queue_scores=q, use_queue=use_queue)[0]

    loss = jax.jit(loss_fn)(jnp.asarray(scores), jnp.asarray(queue), True)
    np.testing.assert_allclose(loss, _np_swav(scores, (0, 1), 0.1, 0.3, 3, queue).mean(), 1e-5)
    assert not np.isclose(loss, _np_swav(scores, (0, 1), 0.1, 0.3, 3).mean(), rtol=1e-3)
    # Switched off (a traced flag under jit): exactly the loss without a queue.
    off = jax.jit(loss_fn)(jnp.asarray(scores), jnp.asarray(queue), False)
    np.testing.assert_allclose(off, _np_swav(scores, (0, 1), 0.1, 0.3, 3).mean(), 1e-5)
    queue_grad = jax.jit(jax.grad(loss_fn, argnums=1))(
        jnp.asarray(scores), jnp.asarray(queue), True
    )
    np.testing.assert_array_equal(queue_grad, 0.0)


def test_swav_bad_settings():
    scores = jnp.zeros((3, 2, 4))
    with pytest.raises(ValueError, match="crops_for_assign"):
        losses.swav_loss(scores, crops_for_assign=[0, 3])
    with pytest.raises(ValueError, match="crops_for_assign"):
        losses.swav_loss(scores, crops_for_assign=[])
    with pytest.raises(ValueError, match="queue_scores"):
        losses.swav_loss(scores, queue_scores=jnp.zeros((1, 5, 4)))
    with pytest.raises(ValueError, match="at least 2"):
        losses.swav_loss(scores[:1])
