"""Tests for jssl.models.cpu_ops: the convolutions and the stem max-pool that the ResNet trains
with on XLA's CPU backend, each against lax's / flax's own operation.

Tiny maps and widths; exact comparisons where the operation adds the same products in the same
order, tolerances where it reorders them.
"""

import functools
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_models import _init, _key, _normal

from jssl.models import ResNet
from jssl.models import resnet as resnet_module
from jssl.models.cpu_ops import cpu_convolution, cpu_max_pool

# The ResNet takes these operations on XLA's CPU backend alone (elsewhere lax's: test_models'
# test_resnet_keeps_lax_operations_off_the_cpu_backend), and the ResNet tests below read its
# CPU program; another backend's convolutions need not add the products in the same order.
pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="XLA's CPU backend's operations"
)


@pytest.mark.parametrize(
    "size,stride,padding,kernel",
    [
        (7, 1, "SAME", (1, 1)),
        (7, 2, "SAME", (1, 1)),  # odd size, strided: torchvision's downsample
        (8, 2, ((0, 0), (0, 0)), (1, 1)),
        (8, 1, "SAME", (3, 3)),  # stride 1: gradients as convolutions in the forward layout
        (9, 1, ((0, 2), (2, 0)), (3, 3)),  # ... with uneven padding
        (8, 2, ((1, 1), (1, 1)), (3, 3)),  # a strided 3x3: its input gradient by phases
        (7, 2, ((1, 1), (1, 1)), (3, 3)),  # ... with one row and column fewer than 2x output
        (8, 2, "SAME", (3, 3)),  # padded (0, 1): lax's convolution
    ],
)
def test_cpu_convolution_is_the_convolution(size, stride, padding, kernel):
    x = _normal(0, (3, size, size, 8))
    w = _normal(1, kernel + (8, 5), scale=0.3)
    kwargs = dict(
        dimension_numbers=jax.lax.conv_dimension_numbers(
            x.shape, w.shape, ("NHWC", "HWIO", "NHWC")
        ),
        lhs_dilation=(1, 1),
        rhs_dilation=(1, 1),
        feature_group_count=1,
    )

    def loss(conv, x, w):
        y = conv(x, w, (stride, stride), padding, **kwargs)
        return jnp.sum(jnp.sin(y)), y

    got, got_y = jax.grad(lambda *a: loss(cpu_convolution, *a), (0, 1), has_aux=True)(x, w)
    want, want_y = jax.grad(
        lambda *a: loss(jax.lax.conv_general_dilated, *a), (0, 1), has_aux=True
    )(x, w)
    assert got_y.shape == want_y.shape
    np.testing.assert_allclose(got_y, want_y, rtol=1e-5, atol=1e-5)
    for g, h in zip(got, want, strict=True):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-5)
    ops = str(jax.make_jaxpr(lambda x, w: loss(cpu_convolution, x, w))(x, w))
    assert ("dot_general" in ops) == (kernel == (1, 1))
    assert " sign " in ops  # the input computed once (see cpu_convolution)
    phases = stride == 2 and kernel == (3, 3) and padding != "SAME"
    assert ("custom_vjp_call" in ops) == (phases or (stride == 1 and kernel != (1, 1)))
    if kernel != (1, 1):  # lax's convolution of the same input: the division by 1 is exact
        np.testing.assert_array_equal(got_y, want_y)
        np.testing.assert_array_equal(got[1], want[1])  # the weight gradient is lax's too
        if not phases:  # the phases add the same products in another order
            np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("height,width", [(2, 2), (1, 1), (1, 2), (2, 1)])
def test_3x3_convolution_of_a_tiny_map_is_one_matmul(height, width, training):
    # XLA's CPU backend ran these as a generic loop (2.4 s for ResNet-18's 2x2 stage at batch
    # 384); every output pixel sees every input pixel, so one dense matmul computes them.
    x = _normal(0, (3, height, width, 8))
    w = _normal(1, (3, 3, 8, 5), scale=0.3)
    pad = ((1, 1), (1, 1))
    dn = jax.lax.conv_dimension_numbers(x.shape, w.shape, ("NHWC", "HWIO", "NHWC"))

    def loss(conv, x, w):
        y = conv(x, w, (1, 1), pad, dimension_numbers=dn)
        return jnp.sum(jnp.sin(y)), y

    ours = functools.partial(cpu_convolution, training=training)
    got, got_y = jax.grad(lambda *a: loss(ours, *a), (0, 1), has_aux=True)(x, w)
    want, want_y = jax.grad(
        lambda *a: loss(jax.lax.conv_general_dilated, *a), (0, 1), has_aux=True
    )(x, w)
    np.testing.assert_allclose(got_y, want_y, rtol=1e-5, atol=1e-5)
    for g, h in zip(got, want, strict=True):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-5)
    ops = str(jax.make_jaxpr(lambda x, w: loss(ours, x, w))(x, w))
    assert "dot_general" in ops and "conv_general_dilated" not in ops
    # a 3x3 map keeps lax's convolution
    x3 = _normal(0, (3, 3, 3, 8))
    ops = str(jax.make_jaxpr(lambda x, w: loss(ours, x, w))(x3, w))
    assert "dot_general" not in ops and "conv_general_dilated" in ops


def test_strided_3x3_input_gradient_by_phases_in_bfloat16():
    # bf16 mixed precision hands the convolution bf16 inputs and kernels; the phases must give
    # a bf16 gradient of lax's values (to bf16 rounding of the differently ordered sums).
    x = _normal(0, (2, 10, 10, 16)).astype(jnp.bfloat16)
    w = _normal(1, (3, 3, 16, 8), scale=0.2).astype(jnp.bfloat16)
    dy = _normal(2, (2, 5, 5, 8)).astype(jnp.bfloat16)
    args = ((2, 2), ((1, 1), (1, 1)))
    dn = jax.lax.conv_dimension_numbers(x.shape, w.shape, ("NHWC", "HWIO", "NHWC"))

    def grads(conv):
        y, vjp = jax.vjp(lambda x, w: conv(x, w, *args, dimension_numbers=dn), x, w)
        return vjp(dy)

    got, want = grads(cpu_convolution), grads(jax.lax.conv_general_dilated)
    for g, h in zip(got, want, strict=True):
        assert g.dtype == h.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.float32(g), np.float32(h), rtol=2e-2, atol=2e-2)


def test_resnet50_trains_its_1x1_convolutions_as_matmuls_on_cpu():
    model = ResNet(depth=50, width_multiplier=0.125)
    x = jnp.zeros((1, 64, 64, 3))  # stage 4 at 2x2 pixels
    variables = jax.eval_shape(lambda: model.init(_key(), x, train=False))
    ops = str(jax.make_jaxpr(lambda v: model.apply(v, x, train=False))(variables))
    # Evaluation keeps lax's convolutions (see cpu_convolution), no inputs divided, but for
    # stage 4's two stride-1 3x3 convolutions of a 2x2 map: matmuls (_small_conv3x3).
    assert (ops.count("dot_general"), ops.count("conv_general_dilated")) == (2, 51)
    assert " sign " not in ops
    ops = str(
        jax.make_jaxpr(lambda v: model.apply(v, x, train=True, mutable=["batch_stats"]))(variables)
    )
    # 16 bottlenecks x 2 pointwise convs + 4 downsamples + those two; 14 3x3 convs + the stem
    assert (ops.count("dot_general"), ops.count("conv_general_dilated")) == (38, 15)
    assert ops.count(" sign ") == 53


def _lax_max_pool(x):
    return nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("height,width", [(8, 8), (7, 7), (6, 9), (1, 2)])
def test_cpu_max_pool_is_the_max_pool_with_its_gradient(height, width, dtype):
    # A ReLU'd map on a coarse grid: half the values are 0 and many windows hold tied maxima,
    # so the test sees which tap each gradient goes to. Small integer gradients add exactly in
    # any order, so the comparison is exact.
    rng = np.random.default_rng(0)
    x = jnp.asarray(np.maximum(rng.integers(-4, 5, (2, height, width, 3)), 0) / 4, dtype)
    y = cpu_max_pool(x)
    np.testing.assert_array_equal(y, _lax_max_pool(x))
    assert y.dtype == dtype
    dy = jnp.asarray(rng.integers(1, 8, y.shape), dtype)
    got = jax.vjp(cpu_max_pool, x)[1](dy)[0]
    want = jax.vjp(_lax_max_pool, x)[1](dy)[0]
    assert got.dtype == dtype and got.shape == x.shape
    np.testing.assert_array_equal(got, want)
    # and under jit, as the train step runs it
    np.testing.assert_array_equal(jax.jit(jax.vjp(cpu_max_pool, x)[1])(dy)[0], want)


def test_cpu_max_pool_propagates_nan_and_minus_infinity():
    x = np.zeros((1, 4, 4, 2), np.float32)
    x[0, 1, 1, 0] = np.nan
    x[..., 1] = -np.inf
    np.testing.assert_array_equal(cpu_max_pool(jnp.asarray(x)), _lax_max_pool(jnp.asarray(x)))


@pytest.mark.parametrize("train", [True, False])
def test_resnet_trains_its_stem_max_pool_through_cpu_max_pool(train):
    model = ResNet(depth=18, width_multiplier=0.125)  # the stem of every depth
    x = _normal(0, (2, 32, 32, 3))
    variables = _init(model, x)

    def loss(params, pool):
        v = {"params": params, "batch_stats": variables["batch_stats"]}
        with mock.patch.object(resnet_module, "cpu_max_pool", pool):
            out, _ = model.apply(v, x, train=train, mutable=["batch_stats"])
        return jnp.sum(jnp.sin(out["res2"])), out["res5"]

    ops = str(jax.make_jaxpr(lambda p: loss(p, cpu_max_pool))(variables["params"]))
    assert ("custom_vjp_call" in ops) == train  # evaluation keeps flax's max_pool
    if train:
        (got, got_y), (want, want_y) = (
            jax.jit(jax.grad(functools.partial(loss, pool=pool), has_aux=True))(variables["params"])
            for pool in (cpu_max_pool, _lax_max_pool)
        )
        np.testing.assert_array_equal(got_y, want_y)
        for g, h in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-6)
