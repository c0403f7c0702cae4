"""model.remat (jssl.models.remat): recomputing trunk blocks changes nothing but memory, the
same parameters (names and values), outputs, batch statistics and gradients for a ResNet and a
ViT (with stochastic depth too), and each block of the program is a rematerialised one whose
backward pass hands its weight and input gradients on together. (XLA's CPU backend schedules
the recomputation without lowering its peak memory, so the saving itself is measured with XLA's
GPU compiler: benchmarks/memory.py --compiler h100.)"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jssl import models


def _config(trunk: str, remat: str, drop_path: float = 0.0) -> ml_collections.ConfigDict:
    c = models.default_config()
    c.trunk, c.remat, c.head_dims, c.drop_path_rate = trunk, remat, (), drop_path
    if trunk.startswith("resnet"):
        c.width_multiplier, c.cifar_stem = 0.125, True
    else:
        c.vit_depth, c.patch_size, c.image_size = 2, 4, 16
    return c


def _loss_and_grad(trunk: str, remat: str, images, drop_path: float = 0.0):
    model = models.build_model(_config(trunk, remat, drop_path))
    variables = model.init(jax.random.PRNGKey(0), images[:1], train=False)
    # Stochastic depth's per-row keys (ViT only): an argument the blocks do not differentiate.
    extra = {"row_keys": jax.random.split(jax.random.PRNGKey(2), len(images))} if drop_path else {}

    def loss(params):
        taps, updates = model.apply(
            {**variables, "params": params},
            images,
            train=True,
            mutable=["batch_stats"],
            **extra,
        )
        return jnp.sum(jnp.square(taps["avgpool"])), updates

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    return variables, grad_fn, grad_fn(variables["params"])


def _relative(a, b) -> float:
    a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(a)])
    b = np.concatenate([np.ravel(x) for x in jax.tree.leaves(b)])
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


@pytest.mark.parametrize(("trunk", "drop_path"), [("resnet18", 0.0), ("vit_tiny", 0.5)])
def test_remat_changes_nothing_but_memory(trunk, drop_path):
    images = jax.random.normal(jax.random.PRNGKey(1), (8, 16, 16, 3))
    base = _loss_and_grad(trunk, "none", images, drop_path)
    base_vars, _, ((base_loss, base_stats), base_grads) = base
    for remat in ("full", "dots"):
        variables, grad_fn, ((value, stats), grads) = _loss_and_grad(
            trunk, remat, images, drop_path
        )
        assert jax.tree.structure(variables) == jax.tree.structure(base_vars)
        jax.tree.map(np.testing.assert_array_equal, variables, base_vars)
        np.testing.assert_allclose(value, base_loss, rtol=1e-6)
        assert jax.tree.structure(stats) == jax.tree.structure(base_stats)
        if jax.tree.leaves(stats):
            assert _relative(base_stats, stats) < 1e-6
        # Recomputed activations fuse differently: float32 rounding, compared as one vector.
        assert _relative(base_grads, grads) < 1e-5
        program = str(jax.make_jaxpr(grad_fn)(variables["params"]))
        depth = 2 if trunk == "vit_tiny" else 8  # ViT blocks / ResNet-18's basic blocks
        assert program.count("checkpoint[") + program.count("remat") >= depth, remat
        # One barrier per block ties its weight gradients to its input's (jssl.models.remat).
        assert program.count("optimization_barrier") == depth, remat


def test_an_unknown_policy_names_the_field():
    with pytest.raises(ValueError, match="model.remat='some'"):
        models.build_model(_config("resnet18", "some"))
