"""Computes SimCLR / multi-crop SimCLR / MoCo v3 / SwAV losses, gradients and Sinkhorn codes
for one fixed global batch: without a mesh (axis_name=None), and per replica under
``jax.shard_map`` on 1-device and 4-device meshes, the way jssl's train step does
(value_and_grad per replica, then pmean of loss and gradients). Saves everything to an .npz for
tests/losses/test_losses_parallel.py.

The device count is fixed by XLA_FLAGS before JAX starts, hence a separate process:

  XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/losses_parity.py OUT.npz
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jssl import losses  # noqa: E402
from jssl.parallel import DATA_AXIS  # noqa: E402

IMAGES, CROPS, DIM_IN, DIM, PROTOTYPES, QUEUE_PER_DEVICE = 8, 3, 6, 4, 5, 2


def make_losses(axis_name):
    """Per-replica losses of params {"w", "prototypes"} on local inputs (crops, n, DIM_IN)."""

    def embed(params, x):
        return x @ params["w"]

    def simclr(params, x, queue):
        z = embed(params, x)
        return losses.simclr_info_nce(z[0], z[1], temperature=0.5, axis_name=axis_name)

    def multicrop(params, x, queue):
        return losses.multicrop_simclr_info_nce(embed(params, x), 0.5, axis_name)

    def mocov3(params, x, queue):
        # Keys without gradient (the momentum encoder's, here other crops' embeddings): every
        # device's keys are the negatives, the gradient is the local queries'.
        keys = jax.lax.stop_gradient(embed(params, x[1:]))
        return losses.mocov3_info_nce(embed(params, x[:2]), keys, 0.5, axis_name)

    def swav(params, x, queue):
        prototypes = losses.l2_normalize(params["prototypes"])
        scores = losses.l2_normalize(embed(params, x)) @ prototypes.T
        queue_scores = losses.l2_normalize(queue) @ prototypes.T
        # epsilon 0.5 keeps the codes soft on these random inputs, so every sum matters.
        return losses.swav_loss(
            scores, (0, 1), 0.1, 0.5, 3, queue_scores=queue_scores, axis_name=axis_name
        )

    def codes(params, x, queue):
        prototypes = losses.l2_normalize(params["prototypes"])
        scores = losses.l2_normalize(embed(params, x[0])) @ prototypes.T
        queue_scores = losses.l2_normalize(queue[0]) @ prototypes.T
        both = jnp.concatenate([scores, queue_scores])
        return losses.sinkhorn_knopp(both, 0.5, 3, axis_name)[: x.shape[1]]

    return {"simclr": simclr, "multicrop": multicrop, "mocov3": mocov3, "swav": swav}, codes


def per_replica(name, axis_name, reduce_axis):
    """The train step's per-replica body: value_and_grad, then pmean over ``reduce_axis``."""
    fns, codes = make_losses(axis_name)

    def loss_fn(params, x, queue):
        loss, metrics, per_example = fns[name](params, x, queue)
        return loss, (metrics, per_example)

    def run(params, x, queue):
        (loss, (metrics, per_example)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, x, queue
        )
        if reduce_axis is not None:
            grads, loss, metrics = jax.lax.pmean((grads, loss, metrics), reduce_axis)
        return loss, grads, metrics, per_example, codes(params, x, queue)

    return run


def main() -> None:
    out = sys.argv[1]
    rs = np.random.RandomState(0)
    params = {
        "w": jnp.asarray(rs.randn(DIM_IN, DIM), jnp.float32),
        "prototypes": jnp.asarray(rs.randn(PROTOTYPES, DIM), jnp.float32),
    }
    x = jnp.asarray(rs.randn(CROPS, IMAGES, DIM_IN), jnp.float32)
    devices = jax.devices()
    # (assignment crops, queue rows, DIM); sharded like the batch, each device keeps its part.
    queue = jnp.asarray(rs.randn(2, QUEUE_PER_DEVICE * len(devices), DIM), jnp.float32)

    def sharded(name, mesh_devices, loss_axis):
        return jax.jit(
            jax.shard_map(
                per_replica(name, loss_axis, DATA_AXIS),
                mesh=Mesh(np.asarray(mesh_devices), (DATA_AXIS,)),
                in_specs=(P(), P(None, DATA_AXIS), P(None, DATA_AXIS)),
                out_specs=(P(), P(), P(), P(DATA_AXIS), P(DATA_AXIS)),
                check_vma=False,  # as jssl.training.step: replicated values via explicit pmeans
            )
        )

    results = {"devices": np.asarray(len(devices))}
    for name in make_losses(None)[0]:
        variants = {
            "plain": jax.jit(per_replica(name, None, None)),
            "one": sharded(name, devices[:1], DATA_AXIS),
            "many": sharded(name, devices, DATA_AXIS),
            # Per-device negatives and Sinkhorn sums only: the test checks that this differs.
            "local": sharded(name, devices, None),
        }
        for label, fn in variants.items():
            loss, grads, metrics, per_example, codes = fn(params, x, queue)
            prefix = f"{name}/{label}"
            results[f"{prefix}/loss"] = np.asarray(loss)
            results[f"{prefix}/grad_w"] = np.asarray(grads["w"])
            results[f"{prefix}/grad_prototypes"] = np.asarray(grads["prototypes"])
            results[f"{prefix}/per_example"] = np.asarray(per_example)
            results[f"{prefix}/codes"] = np.asarray(codes)
            for key, value in metrics.items():
                results[f"{prefix}/metric/{key}"] = np.asarray(value)
    np.savez(out, **results)


if __name__ == "__main__":
    main()
