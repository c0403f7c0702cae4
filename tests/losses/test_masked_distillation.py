"""iBOT's and DINOv2's losses (jssl/losses/masked_distillation.py) against values computed by
hand: the masked-patch loss, the centres, KoLeo against the nearest-neighbour formula, and
Sinkhorn-Knopp's marginals, on one device and split over four (this file's ``__main__`` part,
run in a subprocess with 4 CPU devices)."""

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jssl import losses


def test_patch_loss_averages_each_image_over_its_masked_places():
    # One crop, two images, three places, two prototypes. Image 0: places 0 and 1 masked; the
    # teacher says prototype 0 at place 0 and (1/2, 1/2) at place 1; the student gives
    # (3/4, 1/4) at both. Image 1: nothing masked, loss 0 (counted in the mean over images).
    student = jnp.log(jnp.asarray([[[[3.0, 1.0]] * 3, [[1.0, 1.0]] * 3]]))  # (1, 2, 3, 2)
    teacher = jnp.asarray([[[[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]], [[0.0, 1.0]] * 3]])
    mask = jnp.asarray([[[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]])
    per_image = losses.masked_patch_losses(student, teacher, mask, student_temp=1.0)
    first = -math.log(3 / 4)
    second = -0.5 * (math.log(3 / 4) + math.log(1 / 4))
    np.testing.assert_allclose(per_image, [[(first + second) / 2, 0.0]], rtol=1e-6)
    # The student temperature divides its logits: log 3 / 0.5 = log 9.
    sharp = losses.masked_patch_losses(student * 0.5, teacher, mask, student_temp=0.5)
    np.testing.assert_allclose(sharp, per_image, rtol=1e-6)

    grads = jax.grad(lambda s, t: jnp.sum(losses.masked_patch_losses(s, t, mask, 0.1)), (0, 1))
    to_student, to_teacher = grads(student, teacher)
    assert np.abs(to_teacher).max() == 0  # targets carry no gradient
    assert np.abs(to_student[0, 0, :2]).max() > 0 and np.abs(to_student[0, 0, 2]).max() == 0


def test_centred_probs_and_the_centre_of_the_masked_places():
    logits = jnp.asarray([[1.0, 3.0], [2.0, 2.0], [5.0, 1.0]])
    probs = losses.centred_probs(logits, jnp.asarray([1.0, 1.0]), 2.0)
    want = np.exp(np.asarray([[0, 1], [0.5, 0.5], [2, 0]]))
    np.testing.assert_allclose(probs, want / want.sum(1, keepdims=True), rtol=1e-6)
    center = losses.masked_batch_center(logits, jnp.asarray([1.0, 0.0, 1.0]))
    np.testing.assert_allclose(center, [3.0, 2.0])  # rows 0 and 2 only
    np.testing.assert_allclose(losses.masked_batch_center(logits, jnp.zeros(3)), [0.0, 0.0])


def _koleo_by_hand(x: np.ndarray, group: int) -> np.ndarray:
    """DINOv2's KoLeoLoss written out per row: its nearest other row of its group."""
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-8)
    out = []
    for i in range(len(x)):
        size = group or len(x)
        others = [j for j in range(len(x)) if j != i and j // size == i // size]
        nearest = max(others, key=lambda j: x[i] @ x[j])
        out.append(-np.log(np.linalg.norm(x[i] - x[nearest] + 1e-8) + 1e-8))
    return np.asarray(out)


def test_koleo_is_minus_log_the_nearest_neighbour_distance():
    x = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
    for group in (0, 4, 2):
        np.testing.assert_allclose(
            losses.koleo_losses(jnp.asarray(x), group), _koleo_by_hand(x, group), rtol=1e-5
        )
    # Scale does not matter (rows are normalised); two equal rows are each other's nearest
    # neighbour at distance ~0: a large loss that pushes them apart.
    np.testing.assert_allclose(
        losses.koleo_losses(jnp.asarray(3 * x)), losses.koleo_losses(jnp.asarray(x)), rtol=1e-5
    )
    twins = jnp.asarray(np.concatenate([x[:1], x[:1], x[2:]]))
    values = losses.koleo_losses(twins)
    assert float(values[0]) > 15 and float(values[1]) > 15
    grad = jax.grad(lambda v: jnp.mean(losses.koleo_losses(v)))(jnp.asarray(x))
    assert np.all(np.isfinite(grad)) and np.abs(grad).max() > 0


def _sinkhorn_by_hand(logits: np.ndarray, temp: float, iters: int) -> np.ndarray:
    """DINOv2's sinkhorn_knopp_teacher, multiplicative, in float64."""
    q = np.exp(logits.astype(np.float64) / temp).T  # (K, B)
    q /= q.sum()
    k, b = q.shape
    for _ in range(iters):
        q /= q.sum(axis=1, keepdims=True)
        q /= k
        q /= q.sum(axis=0, keepdims=True)
        q /= b
    return (q * b).T


def test_sinkhorn_centering_is_dinov2s_and_equipartitions():
    logits = np.random.default_rng(1).normal(size=(2, 6, 4)).astype(np.float32)  # (T, n, K)
    q = np.asarray(losses.sinkhorn_centering(jnp.asarray(logits), 0.5))
    assert q.shape == logits.shape
    want = _sinkhorn_by_hand(logits.reshape(12, 4), 0.5, 3).reshape(2, 6, 4)
    np.testing.assert_allclose(q, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)  # each row an assignment
    # Iterated further, every prototype gets an equal share of the 12 rows.
    q = np.asarray(losses.sinkhorn_centering(jnp.asarray(logits), 0.5, num_iters=200))
    np.testing.assert_allclose(q.reshape(12, 4).sum(0), 12 / 4, rtol=1e-3)

    # Only the valid rows (DINOv2's masked patches) count: they get the transport plan of
    # their own, the others zeros, and with no valid row at all every row is zeros.
    valid = np.zeros((2, 6), bool)
    valid[0, :4] = valid[1, 3] = True
    q = np.asarray(losses.sinkhorn_centering(jnp.asarray(logits), 0.5, jnp.asarray(valid)))
    np.testing.assert_allclose(q[valid], _sinkhorn_by_hand(logits[valid], 0.5, 3), rtol=1e-4)
    assert np.all(q[~valid] == 0)
    empty = losses.sinkhorn_centering(jnp.asarray(logits), 0.5, jnp.zeros((2, 6), bool))
    assert np.all(np.asarray(empty) == 0)


def test_sinkhorn_targets_enter_dinos_loss_as_logits():
    logits = np.random.default_rng(2).normal(size=(2, 3, 5)).astype(np.float32)
    student = jnp.asarray(np.random.default_rng(3).normal(size=(3, 3, 5)), jnp.float32)
    q = losses.sinkhorn_centering(jnp.asarray(logits), 0.07)
    per_teacher, _ = losses.dino_teacher_crop_losses(
        student, losses.as_teacher_logits(q), 0.0, 0.1, 1.0
    )
    log_s = np.asarray(jax.nn.log_softmax(student / 0.1, axis=-1))
    q = np.asarray(q)
    for t in range(2):
        want = np.mean([-(q[t] * log_s[v]).sum(-1) for v in range(3) if v != t], axis=0)
        np.testing.assert_allclose(per_teacher[t], want, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# One device and four


def _split_batch_values(x, valid, logits):
    """KoLeo in groups of 0 (all 16 rows), 4 (within a device) and 8 (across two devices),
    its gradient, and Sinkhorn over the valid rows: (values on this process's devices)."""
    from jax.sharding import PartitionSpec as P

    from jssl import parallel
    from jssl.parallel import DATA_AXIS

    mesh = parallel.make_mesh()

    def per_replica(x, valid, logits):
        def local_mean(x):
            return jnp.mean(losses.koleo_losses(x, 8, DATA_AXIS))

        out = {f"koleo{g}": losses.koleo_losses(x, g, DATA_AXIS) for g in (0, 4, 8)}
        # As the train step: each replica's gradient of its own mean (reaching the other
        # replicas' rows through the gather), averaged over the replicas.
        out["grad8"] = jax.grad(local_mean)(x) / jax.lax.psum(1, DATA_AXIS)
        out["sinkhorn"] = losses.sinkhorn_centering(logits, 0.1, valid, 3, DATA_AXIS)
        return out

    run = jax.jit(
        jax.shard_map(
            per_replica, mesh=mesh, in_specs=P(DATA_AXIS), out_specs=P(DATA_AXIS), check_vma=False
        )
    )
    return {k: np.asarray(v) for k, v in run(x, valid, logits).items()}


def _inputs():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 6)).astype(np.float32)
    valid = rng.random(16) < 0.5
    logits = rng.normal(size=(16, 8)).astype(np.float32)
    return x, valid, logits


def test_koleo_groups_and_sinkhorn_do_not_depend_on_the_device_count(tmp_path):
    from support.devices import run_on_devices

    many = run_on_devices(__file__, tmp_path / "many.npz", devices=4)
    assert int(many.pop("devices")) == 4
    one = _split_batch_values(*_inputs())
    x, valid, logits = _inputs()
    np.testing.assert_allclose(one["koleo8"], _koleo_by_hand(x, 8), rtol=1e-5)
    for name, value in one.items():
        np.testing.assert_allclose(many[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    # The groups matter: the whole batch's nearest neighbours differ from those within 4.
    assert not np.allclose(one["koleo0"], one["koleo4"])


if __name__ == "__main__":
    values = _split_batch_values(*_inputs())
    np.savez(sys.argv[1], devices=jax.device_count(), **values)
