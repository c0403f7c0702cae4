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
from jssl.models import remat as remat_lib


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
        # One barrier per ViT block ties its weight gradients to its input's; the ResNet's
        # blocks, with batch norm in train mode, go without (jssl.models.remat).
        barriers = depth if trunk == "vit_tiny" else 0
        assert program.count("optimization_barrier") == barriers, remat


def test_an_unknown_policy_names_the_field():
    with pytest.raises(ValueError, match="model.remat='some'"):
        models.build_model(_config("resnet18", "some"))


def test_recording_names_the_parameters_that_reach_a_block_unchanged():
    # What the train step asks before it leaves split parameters for the blocks to gather
    # (a split state; tests/training/test_verify.py and test_parallel.py train with it): a
    # parameter changed on its way (here block 1's, scaled) is not one of them.
    model = models.build_model(_config("vit_tiny", "full"))
    images = jnp.zeros((2, 16, 16, 3))
    params = model.init(jax.random.PRNGKey(0), images[:1], train=False)["params"]
    found = {}

    def trace(params):
        paths = {id(leaf): path for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
        trunk = dict(
            params["trunk"], blocks_1=jax.tree.map(lambda x: 2 * x, params["trunk"]["blocks_1"])
        )
        with remat_lib.recording(paths) as found["recorder"]:
            model.apply({"params": {**params, "trunk": trunk}}, images, train=False)

    jax.eval_shape(trace, params)
    names = {jax.tree_util.keystr(path) for path in found["recorder"].leaves()}
    block0 = jax.tree_util.tree_leaves_with_path(params["trunk"]["blocks_0"])
    assert names == {"['trunk']['blocks_0']" + jax.tree_util.keystr(p) for p, _ in block0}
    assert len(names) == 12  # 4 kernels, 4 biases, 2 layer norms' scales and biases
    shapes = found["recorder"].shapes()
    assert shapes[(("trunk", "blocks_0"), ("attn", "qkv", "kernel"))] == (192, 576)


def test_a_resnet_called_twice_in_one_loss_trains_with_remat():
    # SimSiam and SwAV call the trunk once per view, the second with the running statistics
    # the first returned; flax's custom_vjp (the barrier) leaked them as tracers.
    images = jax.random.normal(jax.random.PRNGKey(1), (4, 16, 16, 3))
    grads = {}
    for remat in ("none", "full"):
        model = models.build_model(_config("resnet18", remat))
        variables = model.init(jax.random.PRNGKey(0), images[:1], train=False)

        def loss(params, variables=variables, model=model):
            stats = variables["batch_stats"]
            total = 0.0
            for view in (images, images[:, ::-1]):
                taps, updates = model.apply(
                    {"params": params, "batch_stats": stats},
                    view,
                    train=True,
                    mutable=["batch_stats"],
                )
                stats = updates["batch_stats"]
                total = total + jnp.sum(jnp.square(taps["avgpool"]))
            return total

        grads[remat] = jax.jit(jax.grad(loss))(variables["params"])
    assert _relative(grads["none"], grads["full"]) < 1e-5
