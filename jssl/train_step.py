"""The one compiled train step (and its evaluation twin), generic over methods.

``(state, batch) -> (state, metrics)``: gradients of the method's loss, averaged over the
``data`` axis, the optax update, then the method's ``after_update`` (EMA teacher, queue,
batch-norm statistics). The per-replica body runs under ``jax.shard_map`` so that methods
use named collectives; the whole thing is one ``jax.jit`` with the state donated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jssl import probe as online_probe
from jssl.methods import Method
from jssl.parallel import DATA_AXIS
from jssl.train_state import TrainState


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def make_train_step(
    method: Method,
    tx: optax.GradientTransformation,
    schedule: Callable[[jax.Array], jax.Array],
    mesh: Mesh,
    probe_config: Any = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """Builds the jitted, state-donating train step over ``mesh``.

    With ``probe_config`` (the run's config, probe enabled) the online linear probe is
    trained in the same step on the method's stop-gradient ``updates["features"]``.
    """

    def per_replica(state: TrainState, batch: Any):
        # Same key on every replica: methods that need agreement (shuffle-BN's permutation)
        # get it for free; per-replica randomness folds in jax.lax.axis_index(DATA_AXIS).
        rng = jax.random.fold_in(state.rng, state.step)
        grad_fn = jax.value_and_grad(method.loss, has_aux=True)
        (loss, (metrics, updates)), grads = grad_fn(state.params, state, batch, rng)
        # Equal local batches, so the mean of per-replica means is the global mean.
        grads = jax.lax.pmean(grads, DATA_AXIS)
        loss = jax.lax.pmean(loss, DATA_AXIS)
        metrics = jax.lax.pmean(metrics, DATA_AXIS)

        param_updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new_state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, param_updates),
            opt_state=opt_state,
        )
        new_state = method.after_update(new_state, updates)
        if probe_config is not None and state.probe:
            new_probe, probe_metrics = online_probe.update(
                probe_config, state.probe, updates["features"], batch["label"], DATA_AXIS
            )
            new_state = new_state.replace(probe=new_probe)
            metrics = dict(metrics, **probe_metrics)

        # A non-finite loss or gradient keeps the previous state and records the step, so
        # the host can stop with a precise message and the last checkpoint stays valid.
        finite = jnp.isfinite(loss) & _all_finite(grads)
        first_bad = jnp.where(state.nonfinite_step >= 0, state.nonfinite_step, state.step)
        kept = state.replace(nonfinite_step=first_bad)
        new_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_state, kept)

        metrics = dict(metrics, loss=loss, learning_rate=schedule(state.step))
        return new_state, metrics

    sharded = jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(P(), P(DATA_AXIS)),
        out_specs=(P(), P()),
        # Replicated values are kept consistent by the explicit pmeans above (pmap style).
        check_vma=False,
    )
    return jax.jit(sharded, donate_argnums=0)


def make_eval_step(method: Method, mesh: Mesh) -> Callable[[TrainState, Any], tuple]:
    """The method's loss in evaluation mode (BN running statistics, no state updates).

    Returns the batch-mean metrics and per-example outputs (sharded like the batch):
    ``per_example_loss``, ``embeddings`` (head output) and ``features`` (trunk) when the
    method provides them, for the per-epoch evaluation dumps.
    """
    per_example_keys = ("per_example_loss", "embeddings", "features")

    def per_replica(state: TrainState, batch: Any):
        loss, (metrics, updates) = method.loss(state.params, state, batch, state.rng, train=False)
        outputs = {k: updates[k].astype(jnp.float32) for k in per_example_keys if k in updates}
        return jax.lax.pmean(dict(metrics, loss=loss), DATA_AXIS), outputs

    sharded = jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(P(), P(DATA_AXIS)),
        out_specs=(P(), P(DATA_AXIS)),
        check_vma=False,
    )
    return jax.jit(sharded)


def make_forward(method: Method, mesh: Mesh) -> Callable[[TrainState, jax.Array], dict]:
    """Eval-mode taps of the online model on a globally sharded image batch."""

    def forward(state: TrainState, images: jax.Array) -> dict[str, jax.Array]:
        variables = {"params": state.params, "batch_stats": state.batch_stats}
        return method.model.apply(variables, images, train=False)

    # Eval mode has no cross-example coupling, so plain jit over sharded inputs suffices; the
    # module's bn_axis_name is never used with use_running_average=True.
    return jax.jit(forward)
