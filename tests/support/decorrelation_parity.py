"""Computes the Barlow Twins or VICReg loss terms and their gradients for one fixed global
batch: without a mesh (axis_name=None), and per replica under ``jax.shard_map`` on 1-device
and 4-device meshes the way jssl's train step does (value_and_grad per replica, then pmean
of loss and gradients), plus a 4-device variant whose statistics stay per device (no
axis_name) that the tests expect to differ. Saves an .npz for tests/test_barlow_twins.py and
tests/test_vicreg.py (the device count is fixed by XLA_FLAGS before JAX starts):

  XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/decorrelation_parity.py \
      barlow_twins OUT.npz
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
from jssl.methods import common  # noqa: E402
from jssl.parallel import DATA_AXIS  # noqa: E402

IMAGES, DIM_IN, DIM = 16, 6, 5
# Weights of comparable size for every term, so each term's gradient shows in the total.
WEIGHTS = {
    "barlow_twins": {"invariance": 1.0, "redundancy_reduction": 0.5},
    "vicreg": {"invariance": 1.0, "variance": 5.0, "covariance": 0.05},
}


def variants(name: str, joint: bool):
    def terms_fn(params, x, axis_name):
        z1, z2 = x[0] @ params["w"], x[1] @ params["w"]
        if name == "barlow_twins":
            return losses.barlow_twins_terms(z1, z2, normalize_jointly=joint, axis_name=axis_name)
        return losses.vicreg_terms(z1, z2, axis_name=axis_name)

    def per_replica(axis_name, reduce_axis):
        def loss_fn(params, x):
            terms, metrics = terms_fn(params, x, axis_name)
            value, per_example, term_metrics = common.weighted_loss(terms, WEIGHTS[name])
            return value, ({**metrics, **term_metrics}, per_example)

        def run(params, x):
            (value, (metrics, per_example)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, x
            )
            if reduce_axis is not None:
                grads, value, metrics = jax.lax.pmean((grads, value, metrics), reduce_axis)
            return value, grads["w"], metrics, per_example

        return run

    def sharded(devices, loss_axis):
        return jax.jit(
            jax.shard_map(
                per_replica(loss_axis, DATA_AXIS),
                mesh=Mesh(np.asarray(devices), (DATA_AXIS,)),
                in_specs=(P(), P(None, DATA_AXIS)),
                out_specs=(P(), P(), P(), P(DATA_AXIS)),
                check_vma=False,  # as jssl.training.step: replicated values via explicit pmeans
            )
        )

    devices = jax.devices()
    return {
        "plain": jax.jit(per_replica(None, None)),
        "one": sharded(devices[:1], DATA_AXIS),
        "many": sharded(devices, DATA_AXIS),
        "local": sharded(devices, None),
    }


def main() -> None:
    name, out = sys.argv[1], sys.argv[2]
    rs = np.random.RandomState(0)
    params = {"w": jnp.asarray(rs.randn(DIM_IN, DIM), jnp.float32)}
    shared = rs.randn(IMAGES, DIM_IN)
    # Two correlated views with a per-feature offset, so means and variances matter.
    x = np.stack([shared + 0.5 * rs.randn(IMAGES, DIM_IN) + 1.0 for _ in range(2)])
    if name == "vicreg":
        x = 0.25 * x  # embeddings with standard deviations below 1: the hinge is active
    x = jnp.asarray(x, jnp.float32)
    results = {"devices": np.asarray(jax.device_count())}
    for joint in (True, False) if name == "barlow_twins" else (True,):
        for label, fn in variants(name, joint).items():
            value, grad, metrics, per_example = fn(params, x)
            prefix = f"{'joint' if joint else 'per_view'}/{label}"
            results[f"{prefix}/loss"] = np.asarray(value)
            results[f"{prefix}/grad_w"] = np.asarray(grad)
            results[f"{prefix}/per_example"] = np.asarray(per_example)
            for key, v in metrics.items():
                results[f"{prefix}/metric/{key}"] = np.asarray(v)
    np.savez(out, **results)


if __name__ == "__main__":
    main()
