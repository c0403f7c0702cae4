"""Learning-rate schedules, LR scaling, weight-decay masks, and VISSL's LARC and LARS.

VISSL's composite schedules have their own file, tests/test_schedules.py; parameter groups
(per-prefix learning rates and weight decay) tests/test_param_groups.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import base
from jssl import optim


def _cfg(**overrides):
    c = base.get_base_config().optim
    for k, v in overrides.items():
        setattr(c, k, v)
    return c


def test_multistep_by_epoch_as_vissl_moco():
    c = _cfg(
        schedule="multistep",
        base_lr=0.03,
        base_lr_batch_size=256,
        milestones=(120, 160),
        update_interval="epoch",
    )
    s = optim.build_schedule(c, steps_per_epoch=10, num_epochs=200, global_batch=256)
    for epoch, lr in [(0, 0.03), (119, 0.03), (120, 0.003), (159, 0.003), (160, 0.0003)]:
        np.testing.assert_allclose(s(jnp.array(epoch * 10 + 5)), lr, rtol=1e-5)


def test_linear_scaling_rule():
    c = _cfg(schedule="constant", base_lr=0.1, base_lr_batch_size=256)
    s = optim.build_schedule(c, steps_per_epoch=1, num_epochs=1, global_batch=1024)
    np.testing.assert_allclose(s(0), 0.4, rtol=1e-6)
    c.base_lr_batch_size = 0
    s = optim.build_schedule(c, steps_per_epoch=1, num_epochs=1, global_batch=1024)
    np.testing.assert_allclose(s(0), 0.1, rtol=1e-6)


def test_cosine_with_warmup():
    c = _cfg(
        schedule="cosine",
        base_lr=1.0,
        base_lr_batch_size=0,
        warmup_epochs=1,
        update_interval="step",
    )
    s = optim.build_schedule(c, steps_per_epoch=10, num_epochs=11, global_batch=8)
    np.testing.assert_allclose(s(0), 0.0, atol=1e-7)
    np.testing.assert_allclose(s(5), 0.5, rtol=1e-5)
    np.testing.assert_allclose(s(10), 1.0, rtol=1e-5)  # peak right after warmup
    np.testing.assert_allclose(s(60), 0.5, rtol=1e-4)  # half-way through the decay
    np.testing.assert_allclose(s(110), 0.0, atol=1e-6)


def test_epoch_interval_holds_within_epoch():
    c = _cfg(schedule="cosine", base_lr=1.0, base_lr_batch_size=0, update_interval="epoch")
    s = optim.build_schedule(c, steps_per_epoch=10, num_epochs=4, global_batch=8)
    assert float(s(10)) == float(s(19)) and float(s(19)) > float(s(20))


def test_bad_schedule_names_are_clear():
    with pytest.raises(ValueError, match="optim.schedule"):
        optim.build_schedule(
            _cfg(schedule="cosin"), steps_per_epoch=1, num_epochs=1, global_batch=1
        )
    with pytest.raises(ValueError, match="optim.name"):
        optim.build_optimizer(_cfg(name="sdg"), {"w": jnp.ones(2)}, lambda s: 0.1)


def test_weight_decay_mask_follows_vissl_flags():
    params = {
        "conv1": {"kernel": 1},
        "bn1": {"scale": 1, "bias": 1},
        "head": {"Dense_0": {"kernel": 1, "bias": 1}},
        "layer1_0": {"downsample_bn": {"scale": 1}},
        "blocks_0": {"ls1": {"gamma": 1}, "fc1": {"kernel": 1}},  # a ViT block's LayerScale
    }
    mask = optim.weight_decay_mask(params, regularize_bn=False, regularize_bias=True)
    assert mask["conv1"]["kernel"] and mask["head"]["Dense_0"]["bias"]
    assert not mask["bn1"]["scale"] and not mask["layer1_0"]["downsample_bn"]["scale"]
    assert not mask["blocks_0"]["ls1"]["gamma"] and mask["blocks_0"]["fc1"]["kernel"]
    mask = optim.weight_decay_mask(params, regularize_bn=True, regularize_bias=False)
    assert mask["bn1"]["scale"] and not mask["head"]["Dense_0"]["bias"]
    assert not mask["bn1"]["bias"]  # VISSL: a norm's bias needs regularize_bias as well
    assert mask["blocks_0"]["ls1"]["gamma"]


@pytest.mark.parametrize("name", ["sgd", "larc", "lars", "adamw"])
def test_optimizers_step(name):
    c = _cfg(name=name, weight_decay=0.1)
    params = {"w": jnp.ones(3)}
    tx = optim.build_optimizer(c, params, lambda s: 0.1)
    updates, _ = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
    assert np.all(np.asarray(updates["w"]) < 0)


def test_sgd_weight_decay_is_coupled_like_pytorch():
    # PyTorch SGD: g + wd * p, then momentum; first step = -lr * (g + wd * p).
    c = _cfg(name="sgd", weight_decay=0.5, momentum=0.9, nesterov=False)
    params = {"w": jnp.array([2.0])}
    tx = optim.build_optimizer(c, params, lambda s: 0.1)
    updates, _ = tx.update({"w": jnp.array([1.0])}, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], [-0.1 * (1.0 + 0.5 * 2.0)], rtol=1e-6)


# --------------------------------------------------------------------------------------------
# LARC (apex/parallel/LARC.py as VISSL uses it) and LARS (vissl/optimizers/lars.py).
# One parameter p = [3, 4] (|p| = 5) with gradient g = [0.6, 0.8] (|g| = 1), weight decay 0.1,
# learning rate 0.5: g + wd * p = [0.9, 1.2].

P, G = [3.0, 4.0], [0.6, 0.8]


def _is_list(x):
    return isinstance(x, list)


def _step(name, params, grads, lr=0.5, **overrides):
    """The first update of ``optim.name`` (momentum starts from zero: buf = d)."""
    fields = dict(
        name=name,
        weight_decay=0.1,
        momentum=0.9,
        nesterov=False,
        lars_eta=0.001,
        larc_clip=False,
        larc_eps=1e-8,
        trust_ratio_exclude="none",
    )
    c = _cfg(**{**fields, **overrides})
    params = jax.tree.map(jnp.asarray, params, is_leaf=_is_list)
    tx = optim.build_optimizer(c, params, lambda s: lr)
    grads = jax.tree.map(jnp.asarray, grads, is_leaf=_is_list)
    updates, _ = tx.update(grads, tx.init(params), params)
    return jax.tree.map(np.asarray, updates)


def test_larc_scale_mode_by_hand():
    # ratio = 0.001 * 5 / (1 + 0.1 * 5 + 1e-8) = 1/300 (raw |g| plus wd |p| below the line);
    # update = -lr * ratio * (g + wd p) = -0.5 / 300 * [0.9, 1.2].
    np.testing.assert_allclose(_step("larc", {"w": P}, {"w": G})["w"], [-0.0015, -0.002], rtol=1e-6)


def test_larc_clip_mode_by_hand():
    # clip: ratio / lr = (1/300) / 0.5 = 1/150 < 1, so the step is -lr/150 (g + wd p),
    # twice the scale mode's; with trust_coefficient 1 the ratio 10/3 clips to 1: plain SGD.
    got = _step("larc", {"w": P}, {"w": G}, larc_clip=True)["w"]
    np.testing.assert_allclose(got, [-0.003, -0.004], rtol=1e-6)
    got = _step("larc", {"w": P}, {"w": G}, larc_clip=True, lars_eta=1.0)["w"]
    np.testing.assert_allclose(got, [-0.45, -0.6], rtol=1e-6)
    got = _step("larc", {"w": P}, {"w": G}, larc_clip=False, lars_eta=1.0)["w"]
    np.testing.assert_allclose(got, [-1.5, -2.0], rtol=1e-6)  # scale mode: lr * 10/3


def test_larc_zero_norms_leave_the_gradient_alone():
    # apex: with |p| == 0 or |g| == 0 neither the ratio nor the weight decay is applied.
    got = _step("larc", {"p0": [0.0, 0.0], "g0": P}, {"p0": G, "g0": [0.0, 0.0]})
    np.testing.assert_allclose(got["p0"], [-0.3, -0.4], rtol=1e-6)  # -lr * g
    np.testing.assert_allclose(got["g0"], [0.0, 0.0])  # not even decayed


def test_larc_weight_decay_mask_and_trust_ratio_exclusions():
    params = {"fc": {"kernel": [P], "bias": P}, "bn": {"scale": P}}
    grads = {"fc": {"kernel": [G], "bias": G}, "bn": {"scale": G}}
    # regularize_bn=False: the BN scale has wd 0 in the ratio too: 0.001 * 5 / 1 = 0.005.
    got = _step("larc", params, grads, regularize_bn=False)
    np.testing.assert_allclose(got["fc"]["kernel"], [[-0.0015, -0.002]], rtol=1e-6)
    np.testing.assert_allclose(got["bn"]["scale"], [-0.0015, -0.002], rtol=1e-6)
    # exclude_bias_and_norm: 1-D parameters skip the ratio but are still decayed.
    got = _step("larc", params, grads, trust_ratio_exclude="bias_and_norm")
    np.testing.assert_allclose(got["fc"]["kernel"], [[-0.0015, -0.002]], rtol=1e-6)
    np.testing.assert_allclose(got["fc"]["bias"], [-0.45, -0.6], rtol=1e-6)
    np.testing.assert_allclose(got["bn"]["scale"], [-0.45, -0.6], rtol=1e-6)
    # no_decay: what weight decay skips (here the biases) also skips the ratio.
    got = _step("larc", params, grads, trust_ratio_exclude="no_decay", regularize_bias=False)
    np.testing.assert_allclose(got["fc"]["bias"], [-0.3, -0.4], rtol=1e-6)
    np.testing.assert_allclose(got["bn"]["scale"], [-0.0015, -0.002], rtol=1e-6)


def _reference(kind, p, grads, lrs, *, wd, coef, momentum, clip=False, eps=1e-8):
    """apex LARC + torch SGD, or VISSL's _LARS, written out in float64 numpy."""
    p, buf = np.asarray(p, np.float64), None
    for g, lr in zip(grads, lrs, strict=True):
        g = np.asarray(g, np.float64)
        pn, gn = np.linalg.norm(p), np.linalg.norm(g)
        if kind == "larc":
            d = g
            if pn != 0 and gn != 0:
                r = coef * pn / (gn + pn * wd + eps)
                r = min(r / lr, 1.0) if clip else r
                d = (g + wd * p) * r
        else:
            d = g + wd * p
            dn = np.linalg.norm(d)
            d = d * (coef * pn / dn if pn > 0 and dn > 0 else 1.0)
        buf = d if buf is None else momentum * buf + d
        p = p - lr * buf
    return p


@pytest.mark.parametrize("kind,clip", [("larc", False), ("larc", True), ("lars", False)])
def test_several_steps_with_a_changing_rate_match_pytorch_order(kind, clip):
    # Momentum sums the unscaled steps and the current rate multiplies the sum (torch SGD and
    # VISSL's _LARS), which differs from accumulating lr-scaled steps once the rate changes.
    rng = np.random.default_rng(0)
    p0 = rng.normal(size=(3, 4)).astype(np.float32)
    grads = rng.normal(size=(4, 3, 4)).astype(np.float32)
    lrs = [0.5, 0.3, 0.1, 2.0]
    c = _cfg(
        name=kind,
        weight_decay=0.1,
        momentum=0.9,
        nesterov=False,
        lars_eta=0.02,
        larc_clip=clip,
        larc_eps=1e-8,
        trust_ratio_exclude="none",
    )
    schedule = lambda s: jnp.asarray(lrs)[s]  # noqa: E731
    tx = optim.build_optimizer(c, {"w": p0}, schedule)

    @jax.jit
    def step(params, state, g):
        updates, state = tx.update({"w": g}, state, params)
        return optax.apply_updates(params, updates), state

    params, state = {"w": jnp.asarray(p0)}, tx.init({"w": p0})
    for g in grads:
        params, state = step(params, state, jnp.asarray(g))
    want = _reference(kind, p0, grads, lrs, wd=0.1, coef=0.02, momentum=0.9, clip=clip)
    np.testing.assert_allclose(params["w"], want, rtol=1e-5, atol=1e-6)


def test_bad_trust_ratio_exclude_names_the_field():
    with pytest.raises(ValueError, match="optim.trust_ratio_exclude"):
        _step("larc", {"w": P}, {"w": G}, trust_ratio_exclude="bias")
