"""MoCo's state updates: queue enqueue (round robin), EMA of the key encoder, start-up checks,
and the step's bfloat16 and non-finite guards on MoCo."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import moco
from jssl import data, methods, parallel
from jssl.engines.train import init_state, make_optimizer
from jssl.methods import moco as moco_method


@pytest.fixture(scope="module")
def setup():
    config = moco.get_config("test")
    config.method.queue_size = 8
    mesh = parallel.make_mesh()
    method = methods.get(config)
    tx, _ = make_optimizer(config, method, steps_per_epoch=4)
    state = init_state(config, method, tx, mesh)
    return config, method, mesh, state


def _after_update(method, mesh, state, updates):
    fn = jax.shard_map(
        method.after_update, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False
    )
    return jax.jit(fn)(state, updates)


def test_initial_state(setup):
    config, _, _, state = setup
    queue = state.method_state["queue"]
    assert queue.shape == (8, config.model.head_dims[-1])
    np.testing.assert_allclose(jnp.linalg.norm(queue, axis=1), 1.0, rtol=1e-5)
    # The key encoder starts as a copy of the query encoder (MoCo Algorithm 1).
    jax.tree.map(np.testing.assert_array_equal, state.params, state.ema_params)


def test_queue_round_robin_and_ema(setup):
    config, method, mesh, state = setup
    dim = config.model.head_dims[-1]
    m = config.method.momentum
    params = jax.tree.map(lambda x: x + 1.0, state.params)  # pretend the optimizer moved them
    state = state.replace(params=params)
    keys = jnp.ones((4, dim)) / np.sqrt(dim)
    updates = {"ema_batch_stats": state.ema_batch_stats, "keys": keys}
    old_ema = state.ema_params
    new = _after_update(method, mesh, state, updates)
    np.testing.assert_allclose(new.method_state["queue"][:4], keys, rtol=1e-6)
    np.testing.assert_array_equal(new.method_state["queue"][4:], state.method_state["queue"][4:])
    assert int(new.method_state["queue_ptr"]) == 4
    expected = jax.tree.map(lambda e, p: m * e + (1 - m) * p, old_ema, params)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        new.ema_params,
        expected,
    )
    # Second enqueue fills the rest; the pointer wraps to 0.
    newer = _after_update(method, mesh, new, dict(updates, keys=-keys))
    np.testing.assert_allclose(newer.method_state["queue"][4:], -keys, rtol=1e-6)
    assert int(newer.method_state["queue_ptr"]) == 0


def test_queue_must_be_multiple_of_batch():
    config = moco.get_config("test")
    config.method.queue_size = 100
    config.data.batch_size = 16
    with pytest.raises(ValueError, match="multiple of data.batch_size"):
        moco_method.check_config(config)


def _step_setup(config):
    """(mesh, method, initial state, compiled train step with the probe, host batch of 16)."""
    from jssl.training.step import make_train_step

    mesh = parallel.make_mesh()
    method = methods.get(config)
    tx, schedule = make_optimizer(config, method, steps_per_epoch=4)
    state = init_state(config, method, tx, mesh)
    step = make_train_step(method, tx, schedule, mesh, probe_config=config)
    return mesh, method, state, step, data.synthetic_batch(config.data, 16)


def test_bfloat16_step_keeps_float32_state_and_loss():
    """model.dtype=bfloat16: bf16 compute, float32 params/optimizer/BN/EMA/queue and loss."""
    config = moco.get_config("test")
    config.model.dtype = "bfloat16"
    mesh, method, state, step, batch = _step_setup(config)
    out = method.model.apply(
        {"params": state.params, "batch_stats": state.batch_stats},
        batch["crops"][0][:, 0],
        train=False,
    )
    assert out["res5"].dtype == jnp.bfloat16  # compute really is bf16
    new, metrics = step(state, parallel.host_batch_to_global(batch, mesh))
    assert metrics["loss"].dtype == jnp.float32 and np.isfinite(float(metrics["loss"]))
    kept = (
        new.params,
        new.opt_state,
        new.batch_stats,
        new.ema_params,
        new.method_state["queue"],
        new.probe,
    )
    floats = {x.dtype for x in jax.tree.leaves(kept) if jnp.issubdtype(x.dtype, jnp.floating)}
    assert floats == {jnp.dtype(jnp.float32)}
    assert int(new.step) == 1 and int(new.nonfinite_step) == -1


def test_non_finite_step_keeps_every_part_of_the_state():
    """A NaN in the queue makes the loss NaN: the step keeps params, optimizer, BN, EMA, queue
    and probe as they were, records the first bad step and does not count the update."""
    config = moco.get_config("test")
    mesh, method, state, step, batch = _step_setup(config)
    global_batch = parallel.host_batch_to_global(batch, mesh)
    state, _ = step(state, global_batch)  # one good step
    queue = state.method_state["queue"].at[0, 0].set(jnp.nan)
    state = state.replace(method_state=dict(state.method_state, queue=queue))
    before = jax.device_get(state.replace(nonfinite_step=jnp.int32(1)))
    for _ in range(2):  # the second keeps the first bad step
        state, metrics = step(state, global_batch)
        assert not np.isfinite(float(metrics["loss"]))
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), before)


def test_cosine_momentum_schedule():
    from jssl.methods import common

    values = [float(common.cosine_momentum(s, 100, 0.996)) for s in (0, 50, 100, 200)]
    np.testing.assert_allclose(values, [0.996, 0.998, 1.0, 1.0], rtol=1e-6)


def test_all_finite_sees_one_bad_element_in_any_leaf():
    """The guard's flag: any inf or NaN in any floating leaf (whatever its dtype or shape)
    makes it False, integer leaves are ignored, and it is computed inside jit."""
    from jssl.training.finite import _CHECK_IN_PLACE, all_finite

    tree = {
        "loss": jnp.float32(0.5),
        "w": jnp.ones((3, 4, 5), jnp.float32),
        "b": jnp.zeros((7,), jnp.bfloat16),
        "count": jnp.arange(4, dtype=jnp.int32),
        "big": jnp.ones((_CHECK_IN_PLACE // 8, 8), jnp.float32),  # checked on its own
    }
    flag = jax.jit(all_finite)
    assert bool(flag(tree)) and bool(flag({"count": tree["count"]}))
    assert bool(flag({"big": tree["big"]}))
    for name, index in (("loss", ()), ("w", (2, 3, 4)), ("b", (6,)), ("big", (-1, 7))):
        for bad in (jnp.inf, -jnp.inf, jnp.nan):
            broken = dict(tree, **{name: tree[name].at[index].set(bad)})
            assert not bool(flag(broken)), (name, bad)
