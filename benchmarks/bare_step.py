"""Any jssl method's step without jssl's machinery around the method, to measure that machinery.

``train_step.py --compare_bare`` times it next to ``jssl.training.step.make_train_step`` for every
method: the same ``Method`` (its loss, collectives and ``after_update``), the same optimizer and
state, one ``shard_map`` over the same mesh (the methods' losses use named collectives, so the
bare step keeps the map), one ``jax.jit`` with the state donated. Left out: the ``pmean`` of the
gradients, the mean of the batch statistics over devices, the non-finite guard (its check and its
``cond``), the step's last all-reduce (loss, metrics, finite and stop flags), the learning-rate
metric and the online probe. On one device the two compute the same update; the difference is
what jssl adds to the compile time, the step time and the memory of each method
(benchmarks/plain_step.py is MoCo's step written directly against flax/optax, without jssl's
``Method``).
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import PartitionSpec as P

from jssl.parallel import DATA_AXIS


def make_bare_step(method, tx: optax.GradientTransformation, mesh):
    """``step(state, batch, stop) -> (state, {"loss": loss})``; ``stop`` is accepted and unused,
    so that the bare step is called as jssl's."""

    def per_replica(state, batch, stop):
        del stop
        rng = jax.random.fold_in(state.rng, state.step)
        grad_fn = jax.value_and_grad(method.loss, has_aux=True)
        (loss, out), grads = grad_fn(state.params, state, batch, rng)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new_state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
        )
        if out.batch_stats is not None:
            new_state = new_state.replace(batch_stats=out.batch_stats)
        if method.after_update is not None:
            new_state = method.after_update(new_state, out.carry)
        return new_state, {"loss": loss}

    sharded = jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(P(), P(DATA_AXIS), P(DATA_AXIS)),
        out_specs=(P(), P()),
        check_vma=False,
    )
    return jax.jit(sharded, donate_argnums=0)
