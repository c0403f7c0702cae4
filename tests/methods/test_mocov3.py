"""MoCo v3: its loss on hand-computed cases and against a plain loop (keys get no gradient),
the momentum encoder in the real step (cosine momentum, updated after the step, no predictor),
the frozen patch projection, presets, start-up checks (1 vs 4 devices:
tests/training/test_parallel.py; the contract and a run end to end: test_contract*.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import mocov3
from jssl import data, losses, methods, parallel
from jssl.engines import train
from jssl.methods import mocov3 as mocov3_method
from jssl.training.step import make_train_step


def test_loss_hand_computed():
    # Two images, T = 0.5 (logits = 2 cos). Queries of view 1 match the keys of view 2 (cos 1
    # with the positive, 0 with the negative): ce = log(1 + e^-2). Queries of view 2 are
    # orthogonal to their positive key of view 1 and parallel to the other image's key:
    # ce = log(1 + e^2). Each image: 2T * (both) = log(1 + e^-2) + log(1 + e^2). Lengths do not
    # matter (the loss normalises).
    q1 = jnp.array([[3.0, 0.0], [0.0, 0.5]])
    q2 = jnp.array([[0.0, 2.0], [1.0, 0.0]])
    k1 = jnp.array([[1.0, 0.0], [0.0, 4.0]])
    k2 = jnp.array([[2.0, 0.0], [0.0, 1.0]])
    value, metrics, per_example = losses.mocov3_info_nce([q1, q2], [k1, k2], temperature=0.5)
    each = np.log1p(np.exp(-2.0)) + np.log1p(np.exp(2.0))
    np.testing.assert_allclose(per_example, [each, each], rtol=1e-6)
    assert float(value) == pytest.approx(each, rel=1e-6)
    assert float(metrics["contrastive_acc"]) == pytest.approx(0.5)  # view 1 right, view 2 wrong
    assert float(metrics["pos_similarity"]) == pytest.approx(0.5, abs=1e-6)  # (1 + 0) / 2
    assert float(metrics["neg_similarity"]) == pytest.approx(0.5, abs=1e-6)  # (0 + 1) / 2


def test_loss_matches_a_plain_loop_and_scales_by_two_t():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 5, 3)).astype(np.float32)
    k = rng.normal(size=(2, 5, 3)).astype(np.float32)
    for t in (0.2, 1.0):
        _, _, per_example = losses.mocov3_info_nce(q, k, temperature=t)
        unit = [x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k)]
        expected = np.zeros(5)
        for v in range(2):  # ctr(q1, k2) + ctr(q2, k1), each x 2T (moco/builder.py)
            for i in range(5):
                logits = unit[0][v, i] @ unit[1][1 - v].T / t
                expected[i] += 2 * t * (np.log(np.exp(logits).sum()) - logits[i])
        np.testing.assert_allclose(per_example, expected, rtol=1e-5)


def test_gradient_reaches_queries_only():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 4, 3)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 4, 3)), jnp.float32)
    grad_q, grad_k = jax.grad(
        lambda a, b: losses.mocov3_info_nce(a, b, temperature=0.2)[0], argnums=(0, 1)
    )(q, k)
    np.testing.assert_array_equal(grad_k, 0.0)  # the keys are a stop-gradient
    assert np.abs(np.asarray(grad_q)).min() > 0


def _setup(config, steps_per_epoch=4):
    mesh = parallel.make_mesh()
    method = methods.get(config, steps_per_epoch)
    tx, schedule = train.make_optimizer(config, method, steps_per_epoch)
    state = train.init_state(config, method, tx, mesh)
    return mesh, method, state, make_train_step(method, tx, schedule, mesh)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def test_step_updates_momentum_encoder_after_the_step_and_keeps_frozen_params(monkeypatch):
    """Two real steps: the momentum encoder is the EMA of the trunk and projector (no
    predictor) with the cosine momentum of the steps done, and ``method.freeze_patch_embed``
    holds the frozen parameters bit-identical through AdamW with weight decay 0.1 (the ViT
    recipe's optimizer) while the rest moves. Until the ViT trunk is in jssl the frozen prefix
    points at the ResNet's stem convolution, the patch projection's counterpart."""
    config = mocov3.get_config("test")
    config.optim.name = "adamw"
    config.optim.base_lr = 1e-2
    config.optim.weight_decay = 0.1
    config.optim.regularize_bn = config.optim.regularize_bias = True
    config.method.freeze_patch_embed = True
    monkeypatch.setattr(mocov3_method, "PATCH_EMBED", "trunk/conv1")
    mesh, method, state, step = _setup(config)
    assert method.frozen_params == (("trunk/conv1", mocov3_method.WHOLE_RUN),)
    assert "predictor" in state.params and "predictor" in state.batch_stats
    assert set(state.ema_params) == {"trunk", "head"}
    online = {k: v for k, v in state.params.items() if k != "predictor"}
    for a, b in zip(jax.tree.leaves(state.ema_params), jax.tree.leaves(online), strict=True):
        np.testing.assert_array_equal(a, b)  # the momentum encoder starts as a copy
    first = _host(state.params)

    total = config.num_epochs * 4
    for i in range(2):
        before = _host((state.ema_params, state.ema_batch_stats, state.params["predictor"]))
        batch = parallel.host_batch_to_global(data.synthetic_batch(config.data, 16, seed=i), mesh)
        state, metrics = step(state, batch)
        # After k optimizer steps: m(k) = 1 - (1 - 0.99) (cos(pi k / total) + 1) / 2
        # (main_moco.py adjust_moco_momentum at iteration k, before its forward).
        m = 1 - (1 - config.method.base_momentum) * (np.cos(np.pi * (i + 1) / total) + 1) / 2
        assert float(metrics["encoder_momentum"]) == pytest.approx(m, rel=1e-6)
        online = _host({k: v for k, v in state.params.items() if k != "predictor"})
        expected = jax.tree.map(lambda e, o, m=m: m * e + (1 - m) * o, before[0], online)
        for got, want in zip(
            jax.tree.leaves(_host(state.ema_params)), jax.tree.leaves(expected), strict=True
        ):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        # The momentum encoder's own train-mode forwards moved its BN statistics; the
        # predictor trained.
        moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), before[1], state.ema_batch_stats)
        assert max(jax.tree.leaves(moved)) > 0
        moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), before[2], state.params["predictor"])
        assert max(jax.tree.leaves(moved)) > 0

    trunk, first_trunk = _host(state.params["trunk"]), first["trunk"]
    np.testing.assert_array_equal(trunk["conv1"]["kernel"], first_trunk["conv1"]["kernel"])
    assert np.abs(trunk["bn1"]["scale"] - first_trunk["bn1"]["scale"]).max() > 0
    assert (
        np.abs(
            trunk["layer1_0"]["conv1"]["kernel"] - first_trunk["layer1_0"]["conv1"]["kernel"]
        ).max()
        > 0
    )


def test_presets_follow_the_reference():
    config = mocov3.get_config()  # ViT-S/16, CONFIG.md
    assert (config.model.trunk, config.model.patch_size) == ("vit_small", 16)
    assert config.model.head_dims == (384, 4096, 4096, 256)
    assert config.model.head_bn and config.model.head_last_bn and not config.model.head_bias
    m = config.method
    assert (m.temperature, m.base_momentum, m.final_momentum) == (0.2, 0.99, 1.0)
    assert m.predictor_dims == (256, 4096, 256) and m.predictor_last_bn and m.freeze_patch_embed
    o = config.optim
    assert (o.name, o.base_lr, o.weight_decay, o.betas) == ("adamw", 1.5e-4, 0.1, (0.9, 0.999))
    assert (o.warmup_epochs, config.num_epochs, config.data.batch_size) == (40, 300, 4096)
    assert config.data.augment.crop_scale == (0.08, 1.0)
    assert config.data.augment.blur_prob == (1.0, 0.1)
    assert config.data.augment.solarize_prob == (0.0, 0.2)
    assert dict(config.loss.weights) == {"info_nce": 1.0}
    assert mocov3.get_config("vit_base").model.head_dims == (768, 4096, 4096, 256)

    r50 = mocov3.get_config("resnet50")
    assert (r50.model.trunk, r50.model.head_dims) == ("resnet50", (2048, 4096, 256))
    assert r50.method.temperature == 1.0 and not r50.method.predictor_last_bn
    assert not r50.method.freeze_patch_embed and r50.model.trunk == "resnet50"
    o = r50.optim
    assert (o.name, o.base_lr, o.weight_decay, o.lars_eta, o.warmup_epochs) == (
        "lars",
        0.6,
        1e-6,
        0.001,
        10,
    )
    assert o.trust_ratio_exclude == "bias_and_norm" and not o.regularize_bn
    assert r50.num_epochs == 100 and r50.data.augment.crop_scale == (0.2, 1.0)
    vit_demo = mocov3.get_config("demo_vit")
    assert vit_demo.model.trunk == "vit_tiny" and vit_demo.data.source == "demo"
    assert vit_demo.knn.enabled and vit_demo.optim.name == "adamw"
    for preset in ("resnet50", "demo", "demo_vit", "test"):
        methods.check_config(mocov3.get_config(preset))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("data.augment.num_crops", (2, 2), r"num_crops=\(2, 2\): MoCo v3 takes exactly two"),
        ("method.temperature", 0.0, "temperature=0.0 must be positive"),
        ("method.base_momentum", 1.5, "base_momentum=1.5"),
        ("method.predictor_dims", (16, 32, 8), r"start and end with the projector's output"),
        ("method.freeze_patch_embed", True, r"freeze_patch_embed=True .*'resnet18' has none"),
    ],
)
def test_bad_settings_name_the_field(field, value, message):
    config = mocov3.get_config("test")
    config.update_from_flattened_dict({field: value})
    with pytest.raises(ValueError, match=message):
        methods.check_config(config)


def test_vit_patch_projection_frozen_for_the_whole_run():
    """The ViT recipe's ``freeze_patch_embed`` on a real ViT trunk: ``trunk/patch_embed`` must
    exist (the optimizer's freeze refuses a prefix that matches nothing) and stay bit-identical
    through AdamW's weight decay."""
    config = mocov3.get_config("test")
    config.model.trunk = "vit_tiny"
    config.model.vit_depth = 2  # compile in seconds
    config.model.patch_size = 4
    config.model.drop_path_rate = 0.0
    config.model.head_dims = (192, 32, 16)
    config.method.freeze_patch_embed = True
    config.method.predictor_last_bn = True
    config.optim.name = "adamw"
    config.optim.base_lr = 1e-2
    config.optim.weight_decay = 0.1
    methods.check_config(config)
    mesh, method, state, step = _setup(config)
    assert method.frozen_params == (("trunk/patch_embed", mocov3_method.WHOLE_RUN),)
    first = _host(state.params["trunk"])
    batch = parallel.host_batch_to_global(data.synthetic_batch(config.data, 16, seed=0), mesh)
    state, _ = step(state, batch)
    trunk = _host(state.params["trunk"])
    for got, want in zip(
        jax.tree.leaves(trunk["patch_embed"]), jax.tree.leaves(first["patch_embed"]), strict=True
    ):
        np.testing.assert_array_equal(got, want)
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), trunk, first)
    assert max(jax.tree.leaves(moved)) > 0
