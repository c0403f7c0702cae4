"""MSN's loss (jssl.losses.msn) against hand-computed values: the targets' sharpening and label
smoothing, Sinkhorn on the targets against the reference's iteration written out in numpy, the
cross-entropy per image over its anchor views, me-max as the negative entropy of the mean
prediction, and the same terms and gradients with the batch split over 4 (vmapped) devices."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jssl import losses

LOG3 = math.log(3.0)


def _reference_sinkhorn(q: np.ndarray, iterations: int) -> np.ndarray:
    """facebookresearch/msn ``distributed_sinkhorn`` on one device, in float64: Q (K, B)
    divided by its sum, then per iteration each prototype's row to 1/K and each sample's
    column to 1/B; the columns scaled to sum to 1."""
    q = np.array(q, np.float64).T
    k, b = q.shape
    q /= q.sum()
    for _ in range(iterations):
        q /= q.sum(axis=1, keepdims=True) * k
        q /= q.sum(axis=0, keepdims=True) * b
    return (q * b).T


def test_targets_are_sharpened_and_smoothed_probabilities():
    # Temperature 1: cosines (ln 3, 0) give p = (3/4, 1/4); sharpening 0.5 squares them,
    # (9/16, 1/16), renormalised: (0.9, 0.1).
    cos = jnp.array([[LOG3, 0.0], [0.0, LOG3]])
    plain = losses.msn_targets(cos, 1.0, 1.0, use_sinkhorn=False)
    np.testing.assert_allclose(plain, [[0.75, 0.25], [0.25, 0.75]], rtol=1e-6)
    sharp = losses.msn_targets(cos, 1.0, 0.5, use_sinkhorn=False)
    np.testing.assert_allclose(sharp, [[0.9, 0.1], [0.1, 0.9]], rtol=1e-6)
    # Temperature 0.5 is the same as sharpening 0.5 at temperature 1.
    hotter = losses.msn_targets(cos, 0.5, 1.0, use_sinkhorn=False)
    np.testing.assert_allclose(hotter, sharp, rtol=1e-6)
    # Label smoothing 0.2 over K = 2: 0.8 * p + 0.1 = (0.7, 0.3), then sharpened:
    # (0.49, 0.09) / 0.58.
    smoothed = losses.msn_targets(cos, 1.0, 0.5, label_smoothing=0.2, use_sinkhorn=False)
    np.testing.assert_allclose(smoothed[0], [0.49 / 0.58, 0.09 / 0.58], rtol=1e-6)
    log_p = losses.msn_log_probabilities(cos, 1.0, label_smoothing=0.2)
    np.testing.assert_allclose(np.exp(log_p[0]), [0.7, 0.3], rtol=1e-6)


def test_sinkhorn_on_the_targets_is_the_references_iteration():
    rng = np.random.RandomState(0)
    cos = rng.uniform(-1, 1, size=(6, 5)).astype(np.float32)
    sharp = np.asarray(losses.msn_targets(cos, 0.1, 0.25, use_sinkhorn=False))
    for iterations in (1, 3):
        got = losses.msn_targets(cos, 0.1, 0.25, sinkhorn_iterations=iterations)
        np.testing.assert_allclose(got, _reference_sinkhorn(sharp, iterations), rtol=1e-4)
    balanced = np.asarray(losses.msn_targets(cos, 0.1, 0.25, sinkhorn_iterations=3))
    np.testing.assert_allclose(balanced.sum(axis=1), 1.0, rtol=1e-5)  # rows: distributions
    # The prototypes' shares move towards N / K = 1.2 each.
    assert np.ptp(balanced.sum(axis=0)) < np.ptp(sharp.sum(axis=0))


def test_cross_entropy_me_max_and_entropy_by_hand():
    # One image, two anchor views, K = 2, temperature 1 and Sinkhorn off. Anchors: p = (3/4,
    # 1/4) and (1/4, 3/4). Target: (ln 3, 0) sharpened by 0.5 -> (0.9, 0.1).
    anchors = jnp.array([[[LOG3, 0.0]], [[0.0, LOG3]]])  # (V=2, n=1, K=2)
    target = jnp.array([[LOG3, 0.0]])
    terms, metrics = losses.msn_terms(
        anchors, target, temperature=1.0, sharpen=0.5, use_sinkhorn=False
    )
    ce_view0 = -(0.9 * math.log(0.75) + 0.1 * math.log(0.25))
    ce_view1 = -(0.9 * math.log(0.25) + 0.1 * math.log(0.75))
    np.testing.assert_allclose(terms["cross_entropy"], [(ce_view0 + ce_view1) / 2], rtol=1e-6)
    # The mean prediction is uniform: me-max log 2 - H(1/2, 1/2) = 0.
    np.testing.assert_allclose(terms["me_max"], [0.0], atol=1e-6)
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    np.testing.assert_allclose(terms["entropy"], [h], rtol=1e-6)
    assert float(metrics["max_target"]) == pytest.approx(0.9, rel=1e-6)
    assert float(metrics["num_targets"]) == 1.0
    assert float(metrics["mean_anchor_entropy"]) == pytest.approx(math.log(2), rel=1e-6)

    # Both views predict (3/4, 1/4): the mean prediction is (3/4, 1/4) and me-max is log 2
    # minus its entropy, i.e. sum(p log p) + log K, the reference's regulariser.
    same = jnp.array([[[LOG3, 0.0]], [[LOG3, 0.0]]])
    terms, _ = losses.msn_terms(same, target, temperature=1.0, sharpen=0.5, use_sinkhorn=False)
    np.testing.assert_allclose(terms["me_max"], [math.log(2) - h], rtol=1e-6)
    np.testing.assert_allclose(terms["cross_entropy"], [ce_view0], rtol=1e-6)


def test_me_max_spans_the_images_and_gradients_stop_at_the_targets():
    # Two images that predict opposite prototypes: their mean is uniform, me-max 0, though
    # each image alone is confident.
    anchors = jnp.array([[[LOG3, 0.0], [0.0, LOG3]]])  # (1, n=2, 2)
    target = jnp.array([[0.0, 0.0], [0.0, 0.0]])
    terms, _ = losses.msn_terms(anchors, target, temperature=1.0, use_sinkhorn=False)
    np.testing.assert_allclose(terms["me_max"], [0.0, 0.0], atol=1e-6)

    rng = np.random.RandomState(1)
    anchors = jnp.asarray(rng.uniform(-1, 1, (3, 4, 6)), jnp.float32)
    target = jnp.asarray(rng.uniform(-1, 1, (4, 6)), jnp.float32)

    def total(anchors, target):
        terms, _ = losses.msn_terms(anchors, target)
        return jnp.mean(terms["cross_entropy"] + terms["me_max"])

    grad_anchors, grad_target = jax.jit(jax.grad(total, argnums=(0, 1)))(anchors, target)
    assert np.abs(grad_anchors).max() > 0 and np.abs(grad_target).max() == 0


def test_terms_and_gradients_do_not_depend_on_the_device_count():
    """The batch's 8 images on one device, and in 4 slices of 2 with the collectives over a
    vmapped axis: the same terms per image (Sinkhorn's and me-max's sums span every slice) and
    the same gradient of the loss (the step's mean over devices of each device's mean)."""
    rng = np.random.RandomState(2)
    anchors = jnp.asarray(rng.uniform(-1, 1, (3, 8, 5)), jnp.float32)
    target = jnp.asarray(rng.uniform(-1, 1, (8, 5)), jnp.float32)
    settings = dict(temperature=0.1, sharpen=0.25, label_smoothing=0.1)

    def loss(anchors, target, axis_name=None):
        terms, _ = losses.msn_terms(anchors, target, axis_name=axis_name, **settings)
        return jnp.mean(terms["cross_entropy"] + terms["me_max"]), terms

    (one, terms), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(anchors, target)
    split_anchors = jnp.moveaxis(anchors.reshape(3, 4, 2, 5), 1, 0)  # (4 devices, 3, 2, 5)
    per_device = jax.jit(
        jax.vmap(
            jax.value_and_grad(functools.partial(loss, axis_name="data"), has_aux=True),
            axis_name="data",
        )
    )
    (values, split_terms), split_grad = per_device(split_anchors, target.reshape(4, 2, 5))
    np.testing.assert_allclose(jnp.mean(values), one, rtol=1e-5)
    for name, value in terms.items():
        np.testing.assert_allclose(split_terms[name].reshape(8), value, rtol=1e-5, err_msg=name)
    # Each device's gradient of its own mean, averaged over the devices (the step's pmean).
    averaged = jnp.moveaxis(split_grad, 0, 1).reshape(3, 8, 5) / 4
    np.testing.assert_allclose(averaged, grad, rtol=1e-4, atol=1e-7)
    # A control: without the collectives the slices' me-max differs.
    local = jax.jit(jax.vmap(lambda a, t: losses.msn_terms(a, t, **settings)[0]["me_max"]))
    assert not np.allclose(
        local(split_anchors, target.reshape(4, 2, 5)).reshape(8), terms["me_max"]
    )


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"anchors \(V, n, K\) and targets \(n, K\)"):
        losses.msn_terms(jnp.zeros((2, 3, 4)), jnp.zeros((2, 4)))
