"""model.remat (jssl.models.remat): recomputing trunk blocks changes nothing but memory, the
same parameters (names and values), outputs, batch statistics and gradients for a ResNet and a
ViT, and each block of the program is a rematerialised one. (XLA's CPU backend schedules the
recomputation without lowering its peak memory, so the saving itself is measured on GPUs.)"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jssl import models


def _config(trunk: str, remat: str) -> ml_collections.ConfigDict:
    c = models.default_config()
    c.trunk, c.remat, c.head_dims = trunk, remat, ()
    if trunk.startswith("resnet"):
        c.width_multiplier, c.cifar_stem = 0.125, True
    else:
        c.vit_depth, c.patch_size, c.image_size = 2, 4, 16
    return c


def _loss_and_grad(trunk: str, remat: str, images):
    model = models.build_model(_config(trunk, remat))
    variables = model.init(jax.random.PRNGKey(0), images[:1], train=False)

    def loss(params):
        taps, updates = model.apply(
            {**variables, "params": params}, images, train=True, mutable=["batch_stats"]
        )
        return jnp.sum(jnp.square(taps["avgpool"])), updates

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    return variables, grad_fn, grad_fn(variables["params"])


def _relative(a, b) -> float:
    a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(a)])
    b = np.concatenate([np.ravel(x) for x in jax.tree.leaves(b)])
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


@pytest.mark.parametrize("trunk", ["resnet18", "vit_tiny"])
def test_remat_changes_nothing_but_memory(trunk):
    images = jax.random.normal(jax.random.PRNGKey(1), (8, 16, 16, 3))
    base_vars, _, ((base_loss, base_stats), base_grads) = _loss_and_grad(trunk, "none", images)
    for remat in ("full", "dots"):
        variables, grad_fn, ((value, stats), grads) = _loss_and_grad(trunk, remat, images)
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


def test_an_unknown_policy_names_the_field():
    with pytest.raises(ValueError, match="model.remat='some'"):
        models.build_model(_config("resnet18", "some"))
