"""The functional TrainState carried through the one compiled train step.

Everything that changes during training lives here, so a checkpoint of this pytree (plus the
data position) is a complete snapshot of a run. The optimizer itself (an optax
GradientTransformation) is not state and stays outside.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jssl import parallel

PyTree = Any


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates applied so far
    params: PyTree  # online network (trunk + heads) parameters
    batch_stats: PyTree  # batch-norm running statistics of the online network
    opt_state: PyTree
    ema_params: PyTree  # momentum ("teacher"/key) encoder parameters, {} if the method has none
    ema_batch_stats: PyTree  # its batch-norm statistics
    method_state: PyTree  # queue, centre, ... ({} if none)
    rng: jax.Array  # base key; each step folds in its step number
    # Step at which the loss or gradients first became non-finite; -1 while all is well. The
    # step then keeps the previous parameters, so nothing is lost when the host notices.
    nonfinite_step: jax.Array
    # Online linear probe {"params", "opt_state"} on stop-gradient features; {} when off.
    probe: PyTree = struct.field(default_factory=dict)


def create(
    *,
    params: PyTree,
    batch_stats: PyTree,
    tx: Any,
    rng: jax.Array,
    ema_params: PyTree | None = None,
    ema_batch_stats: PyTree | None = None,
    method_state: PyTree | None = None,
    probe: PyTree | None = None,
) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        batch_stats=batch_stats,
        opt_state=tx.init(params),
        ema_params={} if ema_params is None else ema_params,
        ema_batch_stats={} if ema_batch_stats is None else ema_batch_stats,
        method_state={} if method_state is None else method_state,
        rng=rng,
        nonfinite_step=jnp.full((), -1, jnp.int32),
        probe={} if probe is None else probe,
    )


# The fields split over the devices by parallel.shard_params: the ones as large as the model.
SHARDED_FIELDS = ("params", "ema_params", "opt_state")


def partition_specs(
    state: TrainState,
    devices: int,
    parallel_config: Any,
    split_state: tuple[tuple[str, int], ...] = (),
) -> TrainState:
    """A PartitionSpec per leaf of ``state`` (arrays or shapes): with
    ``parallel_config.shard_params``, the FSDP rule (``parallel.leaf_spec``) for the
    parameters, the teacher and the optimizer state, whose leaves follow the parameters'
    shapes; the method's ``split_state`` leaves (``Method.split_state``: key, axis) split along
    their axis where ``devices`` divides it; everything else replicated."""
    specs = jax.tree.map(lambda _: P(), state)
    if split_state and devices > 1:
        method_specs = dict(specs.method_state)
        for key, axis in split_state:
            shape = state.method_state[key].shape
            if shape[axis] % devices == 0:
                method_specs[key] = P(*([None] * axis), parallel.DATA_AXIS)
        specs = specs.replace(method_state=method_specs)
    if not parallel_config.shard_params:
        return specs
    min_size = parallel_config.shard_min_size

    def rule(x):
        return parallel.leaf_spec(tuple(x.shape), devices, min_size)

    split = {field: jax.tree.map(rule, getattr(state, field)) for field in SHARDED_FIELDS}
    return specs.replace(**split)


def specs_of(state: TrainState) -> TrainState:
    """The PartitionSpec each leaf of ``state`` is laid out with (replicated where its
    sharding is not a NamedSharding)."""
    return jax.tree.map(
        lambda x: x.sharding.spec if isinstance(x.sharding, NamedSharding) else P(), state
    )
