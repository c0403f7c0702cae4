"""DINO's loss terms per teacher crop: by hand, their mean is the loss of before, a zero weight
removes that teacher crop's targets from the gradient, and in the method (the real sharded
loss) they sum to the single loss of before and follow the config's weights."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from configs import dino
from jssl import data, losses, methods, parallel
from jssl.engines import train
from jssl.methods import common
from jssl.methods.distillation import teacher_temperature
from jssl.parallel import DATA_AXIS


def test_teacher_crop_terms_by_hand_and_their_mean_is_the_loss():
    rng = np.random.RandomState(1)
    student = jnp.asarray(rng.normal(size=(5, 3, 6)), jnp.float32)
    teacher = jnp.asarray(rng.normal(size=(2, 3, 6)), jnp.float32)
    center = jnp.asarray(rng.normal(size=(6,)), jnp.float32)
    per_teacher, metrics = losses.dino_teacher_crop_losses(student, teacher, center, 0.1, 0.04)
    t = np.exp((np.asarray(teacher, np.float64) - np.asarray(center)) / 0.04)
    t /= t.sum(-1, keepdims=True)
    s = np.asarray(student, np.float64) / 0.1
    log_s = s - np.log(np.exp(s).sum(-1, keepdims=True))
    want = np.array(
        [
            [
                np.mean([-(t[a, i] * log_s[v, i]).sum() for v in range(5) if v != a])
                for i in range(3)
            ]
            for a in range(2)
        ]
    )
    np.testing.assert_allclose(per_teacher, want, rtol=1e-5)
    _, old_metrics, per_example = losses.dino_cross_entropy(student, teacher, center, 0.1, 0.04)
    np.testing.assert_allclose(0.5 * per_teacher[0] + 0.5 * per_teacher[1], per_example, 1e-6)
    assert metrics.keys() == old_metrics.keys()

    # A zero weight on teacher crop 0: the gradient is that of crop 1's targets alone, and
    # student crop 1 (the teacher's own view there) gets none.
    def weighted(student):
        rows = losses.dino_teacher_crop_losses(student, teacher, center, 0.1, 0.04)[0]
        return jnp.mean(0.0 * rows[0] + 0.5 * rows[1])

    def crop1_by_hand(student):
        target = jax.nn.softmax((teacher[1] - center) / 0.04, axis=-1)
        log_p = jax.nn.log_softmax(student / 0.1, axis=-1)
        pairs = [-jnp.sum(target * log_p[v], axis=-1) for v in (0, 2, 3, 4)]
        return jnp.mean(0.5 * sum(pairs) / 4)

    grad = jax.grad(weighted)(student)
    np.testing.assert_allclose(grad, jax.grad(crop1_by_hand)(student), rtol=1e-5, atol=1e-8)
    assert np.abs(grad[1]).max() == 0 and np.abs(grad[0]).max() > 0
    full = jax.grad(lambda s: losses.dino_cross_entropy(s, teacher, center, 0.1, 0.04)[0])
    assert np.abs(full(student)[1]).max() > 0  # at default weights crop 1 has a gradient


def _method_outputs(config):
    """The DINO method's loss outputs on one synthetic batch (1 step, the real sharding), and
    the per-example loss of before the split (``losses.dino_cross_entropy`` on the same
    student and teacher forwards)."""
    mesh = parallel.make_mesh()
    method = methods.get(config, steps_per_epoch=4)
    tx, _ = train.make_optimizer(config, method, 4)
    state = train.init_state(config, method, tx, mesh)
    batch = parallel.host_batch_to_global(data.synthetic_batch(config.data, 16, seed=0), mesh)
    teacher_crops = int(config.method.teacher_crops)
    m = config.method
    warmup = int(round(m.warmup_teacher_temp_epochs * 4))
    temperature = teacher_temperature(0, m.warmup_teacher_temp, m.teacher_temp, warmup)

    def per_replica(state, batch, rng):
        value, out = method.loss(state.params, state, batch, rng, True)
        count = common.num_crops(batch)
        student, _ = common.forward_crops(
            method.model, state.params, state.batch_stats, batch["crops"], True
        )
        groups, seen = [], 0
        for group in batch["crops"]:
            if seen < teacher_crops:
                groups.append(group)
                seen += group.shape[1]
        teacher, _ = common.forward_crops(
            method.model, state.ema_params, state.ema_batch_stats, tuple(groups), True
        )
        old = losses.dino_cross_entropy(
            common.split_crops(student["head"].astype(jnp.float32), count),
            common.split_crops(teacher["head"].astype(jnp.float32), teacher_crops),
            state.method_state["center"],
            config.method.student_temp,
            temperature,
            axis_name=DATA_AXIS,
        )[2]
        metrics = jax.lax.pmean(out.metrics, DATA_AXIS)
        return jax.lax.pmean(value, DATA_AXIS), metrics, out.per_example_loss, out.terms, old

    run = jax.jit(
        jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(P(), P(DATA_AXIS), P()),
            out_specs=(P(), P(), P(DATA_AXIS), P(DATA_AXIS), P(DATA_AXIS)),
            check_vma=False,
        )
    )
    return run(state, batch, jax.random.key(0))


def test_teacher_crop_terms_in_the_method_sum_to_the_loss_of_before_and_follow_the_weights():
    config = dino.get_config("test")
    assert [t.name for t in methods.loss_terms(config)] == [
        "cross_entropy_crop0",
        "cross_entropy_crop1",
    ]
    assert config.loss.weights.cross_entropy_crop0 is None  # a field for the command line
    value, metrics, per_example, terms, old = _method_outputs(config)
    crop0, crop1 = terms["cross_entropy_crop0"], terms["cross_entropy_crop1"]
    np.testing.assert_allclose(per_example, old, rtol=1e-6)
    np.testing.assert_allclose(per_example, 0.5 * crop0 + 0.5 * crop1, rtol=1e-6)
    np.testing.assert_array_equal(terms["cross_entropy"], per_example)
    for name in ("loss/cross_entropy_crop0", "loss/cross_entropy_crop1_weighted"):
        assert np.isfinite(float(metrics[name])), name
    assert float(metrics["loss_weight/cross_entropy_crop0"]) == 0.5
    np.testing.assert_allclose(metrics["loss/cross_entropy"], value, rtol=1e-5)

    config.loss.weights.cross_entropy_crop0 = 0.0
    config.loss.weights.cross_entropy = 3.0
    methods.check_config(config)
    value, metrics, per_example, terms, _ = _method_outputs(config)
    np.testing.assert_allclose(per_example, 1.5 * terms["cross_entropy_crop1"], rtol=1e-6)
    assert float(metrics["loss_weight/cross_entropy_crop0"]) == 0.0
    assert float(metrics["loss_weight/cross_entropy_crop1"]) == 1.5
