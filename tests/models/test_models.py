"""Tests for jssl.models: ResNet trunks, MLP heads, the trunk+head model and its builders.

Kept cheap for a shared CPU: full-size ResNets are only shape-evaluated
(``jax.eval_shape``), real forwards use width 0.125-0.25 nets on 16-32px images.
"""

import os
import subprocess
import sys
import textwrap
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jssl.models import (
    MLPHead,
    ResNet,
    TrunkAndHead,
    build_model,
    build_trunk,
    default_config,
    trunk_feature_dim,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _key(seed: int = 0) -> jax.Array:
    # The "rbg" PRNG compiles far faster on CPU than threefry; init cost dominates these tests.
    return jax.random.key(seed, impl="rbg")


def _normal(seed: int, shape, scale: float = 1.0, shift: float = 0.0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(shift, scale, shape), jnp.float32)


def _count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _abstract_init(model, size=224):
    x = jnp.zeros((1, size, size, 3))
    return jax.eval_shape(lambda: model.init(_key(), x, train=False))


def _init(model, x):
    return model.init(_key(), x, train=False)


@pytest.mark.parametrize("depth,expected", [(50, 25_557_032), (18, 11_689_512)])
def test_param_count_matches_torchvision(depth, expected):
    variables = _abstract_init(ResNet(depth=depth, num_classes=1000))
    assert _count(variables["params"]) == expected


def test_unknown_depth_is_a_clear_error():
    with pytest.raises(ValueError, match="valid depths"):
        _abstract_init(ResNet(depth=42), size=32)


@pytest.mark.parametrize(
    "cifar_stem,size,spatial",
    [
        (False, 32, {"conv1": 16, "res2": 8, "res3": 4, "res4": 2, "res5": 1}),
        (True, 16, {"conv1": 16, "res2": 16, "res3": 8, "res4": 4, "res5": 2}),
    ],
)
def test_tap_names_and_shapes(cifar_stem, size, spatial):
    model = ResNet(depth=18, width_multiplier=0.125, cifar_stem=cifar_stem, num_classes=5)
    x = jnp.ones((2, size, size, 3))
    variables = _init(model, x)
    taps, _ = model.apply(variables, x, train=True, mutable=["batch_stats"])
    assert set(taps) == {"conv1", "conv1_relu", "res2", "res3", "res4", "res5", "avgpool", "logits"}
    widths = {"conv1": 8, "res2": 8, "res3": 16, "res4": 32, "res5": 64}
    for name, s in spatial.items():
        assert taps[name].shape == (2, s, s, widths[name]), name
    assert taps["conv1_relu"].shape == taps["conv1"].shape
    assert float(taps["conv1_relu"].min()) >= 0.0
    assert taps["avgpool"].shape == (2, 64)
    assert taps["logits"].shape == (2, 5)


def test_param_names_follow_torchvision():
    params = _abstract_init(ResNet(depth=50, width_multiplier=0.125, num_classes=10), 32)["params"]
    blocks = {"layer1": 3, "layer2": 4, "layer3": 6, "layer4": 3}
    expected = {"conv1", "bn1", "fc"} | {f"{s}_{i}" for s, n in blocks.items() for i in range(n)}
    assert set(params) == expected
    assert params["conv1"]["kernel"].shape == (7, 7, 3, 8)  # no "bias": convs are bias-free
    assert set(params["conv1"]) == {"kernel"}
    assert set(params["bn1"]) == {"scale", "bias"}
    convs = {"conv1", "bn1", "conv2", "bn2", "conv3", "bn3"}
    for stage in blocks:
        # Only the first block of each stage projects its shortcut (64 -> 256 or a stride).
        assert set(params[f"{stage}_0"]) == convs | {"downsample_conv", "downsample_bn"}
        assert set(params[f"{stage}_1"]) == convs
    # torchvision v1.5: the stride sits in the 3x3 conv, so conv1 is 1x1.
    assert params["layer2_0"]["conv1"]["kernel"].shape == (1, 1, 32, 16)
    assert params["layer2_0"]["conv2"]["kernel"].shape == (3, 3, 16, 16)
    assert params["fc"]["kernel"].shape == (256, 10)
    basic = _abstract_init(ResNet(depth=18, width_multiplier=0.125), 32)["params"]
    assert set(basic["layer1_0"]) == {"conv1", "bn1", "conv2", "bn2"}  # 8 -> 8, no projection
    assert "downsample_conv" in basic["layer2_0"]


def test_bfloat16_computes_in_bf16_with_float32_params_and_stats():
    model = ResNet(depth=18, width_multiplier=0.125, cifar_stem=True, dtype=jnp.bfloat16)
    x = _normal(1, (4, 16, 16, 3), scale=3.0, shift=5.0)
    variables = _init(model, x)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(variables["params"]))
    taps, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    assert all(t.dtype == jnp.bfloat16 for t in taps.values())
    stats = updates["batch_stats"]
    assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(stats))
    # The stem's statistics, computed in float32, match a float32 run closely
    # (bf16 reductions over 1024 values would be off by ~1e-2 relative).
    ref = ResNet(depth=18, width_multiplier=0.125, cifar_stem=True)
    _, ref_updates = ref.apply(variables, x, train=True, mutable=["batch_stats"])
    got, want = stats["bn1"]["mean"], ref_updates["batch_stats"]["bn1"]["mean"]
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("depth,last_bn", [(50, "bn3"), (18, "bn2")])
def test_zero_init_residual(depth, last_bn):
    def last_scales(zero):
        model = ResNet(depth=depth, width_multiplier=0.125, zero_init_residual=zero)
        params = _init(model, jnp.zeros((1, 32, 32, 3)))["params"]
        return [v[last_bn]["scale"] for k, v in params.items() if k.startswith("layer")]

    assert all(np.all(s == 0) for s in last_scales(True))
    assert all(np.all(s == 1) for s in last_scales(False))


def test_eval_mode_uses_running_averages():
    model = ResNet(depth=18, width_multiplier=0.125, cifar_stem=True)
    x = _normal(2, (4, 16, 16, 3))
    variables = _init(model, x)
    # Eval needs no mutable collection and treats each sample independently.
    full = model.apply(variables, x, train=False)
    single = model.apply(variables, x[:1], train=False)
    np.testing.assert_allclose(full["avgpool"][:1], single["avgpool"], rtol=1e-5, atol=1e-5)
    # ... and depends on the stored statistics.
    stats = jax.tree.map(lambda s: s + 1.0, variables["batch_stats"])
    shifted = model.apply({**variables, "batch_stats": stats}, x, train=False)
    assert not np.allclose(full["conv1_relu"], shifted["conv1_relu"])
    # Train mode updates the running averages with momentum 0.9.
    _, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    conv1 = model.apply(variables, x, train=False)["conv1"]
    batch_mean = conv1.mean(axis=(0, 1, 2))
    np.testing.assert_allclose(updates["batch_stats"]["bn1"]["mean"], 0.1 * batch_mean, atol=1e-5)


_SYNC_BN_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from jssl.models import ResNet
    assert jax.device_count() == 4, jax.devices()
    x = jnp.asarray(np.random.default_rng(0).normal(1.0, 2.0, (8, 16, 16, 3)), jnp.float32)
    kw = dict(depth=18, width_multiplier=0.125, cifar_stem=True)
    ref_model, sync_model = ResNet(**kw), ResNet(**kw, bn_axis_name="data")
    variables = ref_model.init(jax.random.key(1, impl="rbg"), x, train=False)
    want, want_up = ref_model.apply(variables, x, train=True, mutable=["batch_stats"])
    mesh = Mesh(np.array(jax.devices()), ("data",))
    def step(v, xs):
        taps, up = sync_model.apply(v, xs, train=True, mutable=["batch_stats"])
        return taps["avgpool"], up
    got, got_up = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P("data"), P())))(variables, x)
    np.testing.assert_allclose(got, want["avgpool"], rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves(got_up), jax.tree.leaves(want_up)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # Without the named axis each shard normalises by its own statistics: different.
    local = jax.jit(jax.shard_map(
        lambda v, xs: ref_model.apply(v, xs, train=True, mutable=["batch_stats"])[0]["avgpool"],
        mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")))(variables, x)
    assert not np.allclose(local, want["avgpool"], atol=1e-4)
    print("SYNC_BN_OK")
    """
)


def test_sync_bn_under_shard_map_equals_full_batch_bn():
    # A subprocess, because the host device count is fixed when jax first initialises
    # and other test modules may already have done so in this process.
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", _SYNC_BN_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and "SYNC_BN_OK" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize(
    "kwargs,names",
    [
        ({}, {"fc0", "fc1"}),
        ({"use_bn": True}, {"fc0", "bn0", "fc1"}),
        ({"use_bn": True, "last_bn": True}, {"fc0", "bn0", "fc1"}),
    ],
)
def test_mlp_head_shapes_and_layers(kwargs, names):
    head = MLPHead(dims=(16, 32, 8), **kwargs)
    x = _normal(0, (4, 16))
    variables = head.init(_key(), x, train=False)
    assert set(variables["params"]) == names
    out, _ = head.apply(variables, x, train=True, mutable=["batch_stats"])
    assert out.shape == (4, 8)
    if kwargs.get("last_bn"):
        # Non-affine output BN by default (Barlow Twins): zero mean, unit variance.
        assert "bn1" not in variables["params"] and "bn1" in variables["batch_stats"]
        np.testing.assert_allclose(out.mean(0), 0.0, atol=1e-5)


def test_mlp_head_checks_input_dim():
    head = MLPHead(dims=(16, 8))
    with pytest.raises(ValueError, match="expects inputs with 16 features"):
        head.init(_key(), jnp.zeros((2, 12)))


def test_build_model_from_config():
    cfg = default_config()
    cfg.trunk = "resnet18"
    cfg.width_multiplier = 0.125
    cfg.cifar_stem = True
    cfg.head_dims = (64, 32, 16)
    cfg.head_bn = True
    assert trunk_feature_dim(cfg) == 64
    model = build_model(cfg, bn_axis_name=None)
    assert isinstance(model, TrunkAndHead)
    x = jnp.ones((2, 16, 16, 3))
    variables = _init(model, x)
    assert set(variables["params"]) == {"trunk", "head"}
    out, _ = model.apply(variables, x, train=True, mutable=["batch_stats"])
    assert out["head"].shape == (2, 16) and out["avgpool"].shape == (2, 64)

    cfg.head_dims = ()
    no_head = build_model(cfg)
    assert no_head.head is None
    assert "head" not in no_head.apply(_init(no_head, x), x, train=False)


def test_builders_validate_config():
    cfg = default_config()
    assert trunk_feature_dim(cfg) == 2048
    cfg.trunk = "resnet18"
    assert trunk_feature_dim(cfg) == 512
    with pytest.raises(ValueError, match=r"model.head_dims=\(512, 512, 128\)"):
        build_model(cfg)  # default head starts at 2048
    cfg.trunk = "resnet51"
    with pytest.raises(ValueError, match="valid trunks.*resnet50"):
        build_trunk(cfg)
    cfg.trunk, cfg.dtype = "resnet50", "bfloat16"
    trunk = build_trunk(cfg, bn_axis_name="data", num_classes=10)
    assert trunk.dtype == jnp.bfloat16 and trunk.bn_axis_name == "data" and trunk.num_classes == 10


def test_resnet_keeps_lax_operations_off_the_cpu_backend():
    # GPUs and TPUs train the ResNet with lax's convolutions and flax's max-pool: only XLA's
    # CPU backend takes jssl/models/cpu_ops.py's (tests/models/test_cpu_ops.py).
    model = ResNet(depth=50, width_multiplier=0.125)
    x = jnp.zeros((1, 64, 64, 3))
    with mock.patch.object(jax, "default_backend", return_value="gpu"):
        variables = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))
        ops = str(
            jax.make_jaxpr(lambda v: model.apply(v, x, train=True, mutable=["batch_stats"]))(
                variables
            )
        )
    # 16 bottlenecks x 3 convolutions, 4 downsamples and the stem, all lax's.
    assert (ops.count("dot_general"), ops.count("conv_general_dilated")) == (0, 53)
    assert " sign " not in ops and "custom_vjp_call" not in ops
