"""A run's fresh TrainState: built inside jit on the devices (no host round trip of weights)
and laid out by ``jssl.training.state.partition_specs`` (replicated, or split with
``parallel.shard_params``), or only its shapes and shardings for ahead-of-time compilation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from jssl import methods, models, parallel
from jssl.training import probe
from jssl.training import state as train_state


def init_state(config: ml_collections.ConfigDict, method: methods.Method, tx, mesh):
    """A fresh TrainState built inside jit (no host round trip of weights), replicated or,
    with ``parallel.shard_params``, laid out by ``train_state.partition_specs``."""
    create, shardings = _state_creator(config, method, tx, mesh)
    return jax.jit(create, out_shardings=shardings)()


def abstract_state(config: ml_collections.ConfigDict, method: methods.Method, tx, mesh):
    """``init_state``'s shapes, dtypes and shardings, without making an array (for
    ahead-of-time compilation and memory analysis of models larger than the host)."""
    create, shardings = _state_creator(config, method, tx, mesh)
    return jax.tree.map(
        lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        jax.eval_shape(create),
        shardings,
    )


def _state_creator(config: ml_collections.ConfigDict, method: methods.Method, tx, mesh):
    size = config.data.image_size
    sample = jnp.zeros((1, size, size, 3), jnp.float32)
    rng = jax.random.PRNGKey(config.seed)
    init_rng, state_rng = jax.random.split(rng)

    def create():
        fields = method.init(init_rng, sample)
        online_probe = probe.init(config, models.trunk_feature_dim(config.model))
        return train_state.create(**fields, tx=tx, rng=state_rng, probe=online_probe)

    specs = train_state.partition_specs(
        jax.eval_shape(create), mesh.size, config.parallel, method.split_state
    )
    return create, parallel.named(mesh, specs)
