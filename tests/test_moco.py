"""MoCo's state updates: queue enqueue (round robin), EMA of the key encoder, start-up checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import moco
from jssl import methods, parallel
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
    updates = {
        "batch_stats": state.batch_stats,
        "ema_batch_stats": state.ema_batch_stats,
        "keys": keys,
    }
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


def test_unknown_method_is_clear():
    config = moco.get_config("test")
    config.method.name = "mocov3"
    with pytest.raises(ValueError, match="method.name"):
        methods.get(config)
