"""The train step's last collective: the loss, the metrics and the step's flags in one
all-reduce after every other collective of the replica's step (jssl.training.step)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jssl.parallel import DATA_AXIS


def reduce_last(loss, metrics, finite, stop, replicas: int, rows=None):
    """``(loss, metrics, finite, stop, rows)`` of the whole step: the replicas' mean loss and
    metrics (equal local batches: the mean of the means is the global mean), whether every
    replica's ``finite`` holds, whether any device's ``stop`` flag is set, and ``rows``
    (``{name: (n, ...) local rows or None}``) gathered over the replicas, in one all-reduce
    that reads every other collective's result (``finite`` comes after them all).

    Every device must enter the step's collectives in one order. On GPUs and TPUs they run in
    the compiled order, but XLA's CPU runtime runs what the data allow in parallel and orders
    a collective inside a conditional or a loop (accumulation's, Sinkhorn's, a split state's
    update under the finite check) against the others only through data: two devices could
    take them in opposite orders and wait for each other until the rendezvous aborts. So this
    all-reduce comes after everything else of the replica's step, and the update (conditional
    on ``finite``) after it; on CPU the collapse statistics' rows are gathered here, as a sum
    of zero-padded parts, not inside their conditional (tests/training/test_collective_order.py
    reads the compiled steps)."""
    stop = jnp.max(stop)
    present = {k: v.reshape(v.shape[0], -1) for k, v in (rows or {}).items() if v is not None}
    if replicas == 1:
        return loss, metrics, finite, stop, present or None
    index = jax.lax.axis_index(DATA_AXIS)

    def placed(x):  # this replica's rows at their place in the global batch, zeros elsewhere
        whole = jnp.zeros((replicas * x.shape[0], x.shape[1]), jnp.float32)
        return jax.lax.dynamic_update_slice(whole, x.astype(jnp.float32), (index * x.shape[0], 0))

    local = {
        "loss": loss,
        "metrics": metrics,
        "bad": 1.0 - finite.astype(jnp.float32),
        "stop": stop.astype(jnp.float32),
        "rows": {k: placed(x) for k, x in present.items()},
    }
    leaves, tree = jax.tree.flatten(local)
    sizes = [leaf.size for leaf in leaves]
    flat = jnp.concatenate([jnp.ravel(leaf).astype(jnp.float32) for leaf in leaves])
    flat = jax.lax.psum(flat, DATA_AXIS)  # one array: XLA cannot split it
    parts = jnp.split(flat, np.cumsum(sizes)[:-1])
    total = jax.tree.unflatten(
        tree,
        [p.reshape(leaf.shape).astype(leaf.dtype) for p, leaf in zip(parts, leaves, strict=True)],
    )
    loss, metrics = jax.tree.map(lambda x: x / replicas, (total["loss"], total["metrics"]))
    finite = total["bad"] == 0
    return loss, metrics, finite, (total["stop"] > 0).astype(stop.dtype), total["rows"] or None
