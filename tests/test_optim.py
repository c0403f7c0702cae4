"""Learning-rate schedules, LR scaling and weight-decay masks."""

import jax.numpy as jnp
import numpy as np
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
    }
    mask = optim.weight_decay_mask(params, regularize_bn=False, regularize_bias=True)
    assert mask["conv1"]["kernel"] and mask["head"]["Dense_0"]["bias"]
    assert not mask["bn1"]["scale"] and not mask["layer1_0"]["downsample_bn"]["scale"]
    mask = optim.weight_decay_mask(params, regularize_bn=True, regularize_bias=False)
    assert mask["bn1"]["bias"] and not mask["head"]["Dense_0"]["bias"]


@pytest.mark.parametrize("name", ["sgd", "lars", "adamw"])
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
