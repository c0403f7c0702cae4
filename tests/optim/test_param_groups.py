"""Parameter groups (``optim.param_groups``): learning rates per parameter-path prefix, and a
group's own weight decay (VISSL ``head_optimizer_params``) in SGD, AdamW and LARC, with the
weight-decay mask and under a cosine weight-decay schedule."""

import jax
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


# --------------------------------------------------------------------------------------------
# Parameter groups (optim.param_groups): learning rates per parameter-path prefix.


def _model_params():
    return {
        "trunk": {"conv": {"kernel": jnp.ones(3)}, "layer4": {"kernel": jnp.ones(2)}},
        "head": {
            "fc0": {"kernel": jnp.ones(2), "bias": jnp.ones(2)},
            "bn0": {"scale": jnp.ones(2)},
        },
    }


def _grouped_updates(c, steps=3, schedule=lambda s: 0.1, global_batch=256):
    params = _model_params()
    tx = optim.build_grouped_optimizer(c, params, schedule, global_batch)
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    out = []
    for _ in range(steps):
        updates, state = tx.update(grads, state, params)
        out.append(jax.tree.map(np.asarray, updates))
    return out


def test_head_group_steps_ten_times_the_trunk():
    # SGD with momentum and coupled decay: every update of the head is 10x the trunk's
    # (PyTorch: the group's lr multiplies the momentum buffer), at every step.
    c = _cfg(name="sgd", momentum=0.9, weight_decay=0.0, param_groups=(("head", 10.0),))
    for updates in _grouped_updates(c):
        trunk = updates["trunk"]["conv"]["kernel"]
        np.testing.assert_allclose(updates["head"]["fc0"]["kernel"][0], 10 * trunk[0], rtol=1e-6)
    # Step 3 of SGD at lr 0.1 with momentum 0.9 and g = 1: -0.1 * (1 + 0.9 + 0.81).
    np.testing.assert_allclose(trunk, -0.1 * 2.71, rtol=1e-6)
    # Without groups: the same trunk update, and the head's is the trunk's.
    plain = _grouped_updates(_cfg(name="sgd", momentum=0.9, weight_decay=0.0))[-1]
    np.testing.assert_allclose(plain["trunk"]["conv"]["kernel"], trunk, rtol=1e-6)
    np.testing.assert_allclose(plain["head"]["fc0"]["kernel"], trunk[:2], rtol=1e-6)


def test_groups_keep_the_weight_decay_mask():
    # regularize_bn=False: the head's BN scale is not decayed inside the head group.
    c = _cfg(
        name="sgd",
        momentum=0.0,
        weight_decay=0.5,
        regularize_bn=False,
        param_groups=(("head", 2.0),),
    )
    updates = _grouped_updates(c, steps=1)[0]
    np.testing.assert_allclose(updates["head"]["bn0"]["scale"], -0.2 * 1.0, rtol=1e-6)
    np.testing.assert_allclose(updates["head"]["fc0"]["kernel"], -0.2 * 1.5, rtol=1e-6)
    np.testing.assert_allclose(updates["trunk"]["conv"]["kernel"], -0.1 * 1.5, rtol=1e-6)


def test_constant_group_skips_the_schedule_and_longest_prefix_wins():
    # Warmup from 0: the scheduled groups do not move at step 0, the constant group moves at
    # multiplier x peak (0.1 * 512 / 256 = 0.2) at every step; "trunk/layer4" beats "trunk".
    c = _cfg(
        name="sgd",
        momentum=0.0,
        weight_decay=0.0,
        schedule="cosine",
        base_lr=0.1,
        warmup_epochs=1,
        param_groups=(("trunk", 3.0), ("trunk/layer4", 0.5, "constant")),
    )
    schedule = optim.build_schedule(c, steps_per_epoch=2, num_epochs=3, global_batch=512)
    updates = _grouped_updates(c, steps=3, schedule=schedule, global_batch=512)
    for step, u in enumerate(updates):
        np.testing.assert_allclose(u["trunk"]["layer4"]["kernel"], -0.5 * 0.2, rtol=1e-6)
        lr = float(schedule(step))
        np.testing.assert_allclose(u["trunk"]["conv"]["kernel"], -3 * lr, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(u["head"]["fc0"]["kernel"], -lr, rtol=1e-6, atol=1e-9)
    assert float(schedule(0)) == 0.0 and float(schedule(2)) > 0.1


def test_no_groups_is_the_plain_optimizer():
    # Same state structure as before groups existed, so older checkpoints restore.
    params = _model_params()
    plain = optim.build_optimizer(_cfg(), params, lambda s: 0.1).init(params)
    grouped = optim.build_grouped_optimizer(_cfg(), params, lambda s: 0.1, 256).init(params)
    assert jax.tree.structure(plain) == jax.tree.structure(grouped)


@pytest.mark.parametrize(
    "groups, match",
    [
        ((("heads", 2.0),), "prefix 'heads' matches no parameter"),
        ((("head", -1.0),), "multiplier >= 0"),
        ((("head", 1.0, "fixed"),), "schedule one of"),
        ((("head", 1.0), ("head", 2.0)), "names a prefix twice"),
        (("head",), "optim.param_groups entry"),
    ],
)
def test_bad_param_groups_name_the_field(groups, match):
    with pytest.raises(ValueError, match=match):
        optim.build_grouped_optimizer(
            _cfg(param_groups=groups), _model_params(), lambda s: 0.1, 256
        )


# --------------------------------------------------------------------------------------------
# A group's own weight decay (VISSL head_optimizer_params.use_different_wd / weight_decay)


def test_param_group_entries_with_a_weight_decay():
    groups = optim.param_groups(
        _cfg(param_groups=(("head", 1.0, 1e-6), ("trunk", 2.0, "constant", 0), ("x", 3.0)))
    )
    assert groups == (
        optim.ParamGroup("head", 1.0, "schedule", 1e-6),
        optim.ParamGroup("trunk", 2.0, "constant", 0.0),
        optim.ParamGroup("x", 3.0, "schedule", None),
    )
    for bad in (("head", 1.0, -1e-4), ("head", 1.0, 1e-4, "constant"), ("head", 1.0, "x", 0.1)):
        with pytest.raises(ValueError, match="weight_decay >= 0"):
            optim.param_groups(_cfg(param_groups=(bad,)))


def test_group_weight_decay_replaces_the_runs_and_keeps_the_mask():
    # SGD, g = 1, p = 1, lr 0.1: the head decays by 0.1 (biases too: regularize_bias), its BN
    # scale not at all (regularize_bn False), the trunk by the run's 0.5.
    c = _cfg(
        name="sgd",
        momentum=0.0,
        weight_decay=0.5,
        regularize_bn=False,
        param_groups=(("head", 2.0, 0.1),),
    )
    updates = _grouped_updates(c, steps=1)[0]
    np.testing.assert_allclose(updates["head"]["fc0"]["kernel"], -0.2 * 1.1, rtol=1e-6)
    np.testing.assert_allclose(updates["head"]["fc0"]["bias"], -0.2 * 1.1, rtol=1e-6)
    np.testing.assert_allclose(updates["head"]["bn0"]["scale"], -0.2 * 1.0, rtol=1e-6)
    np.testing.assert_allclose(updates["trunk"]["conv"]["kernel"], -0.1 * 1.5, rtol=1e-6)
    # A head weight decay of 0: the head's update is the plain gradient step.
    c.param_groups = (("head", 1.0, 0.0),)
    updates = _grouped_updates(c, steps=1)[0]
    np.testing.assert_allclose(updates["head"]["fc0"]["kernel"], -0.1, rtol=1e-6)
    np.testing.assert_allclose(updates["trunk"]["layer4"]["kernel"], -0.15, rtol=1e-6)


def test_group_weight_decay_in_adamw_and_larc():
    params = _model_params()
    grads = jax.tree.map(lambda p: 0.3 * jnp.ones_like(p), params)

    def first_update(c, params=params, grads=grads):
        tx = optim.build_grouped_optimizer(c, params, lambda s: 0.1, 256)
        return jax.tree.map(np.asarray, tx.update(grads, tx.init(params), params)[0])

    # AdamW: decoupled, lr x wd x p on top of Adam's first step (-lr sign(g)).
    adamw = _cfg(name="adamw", weight_decay=0.05, param_groups=(("head", 1.0, 0.4),))
    u = first_update(adamw)
    np.testing.assert_allclose(u["head"]["fc0"]["kernel"], -0.1 * (1 + 0.4), rtol=1e-5)
    np.testing.assert_allclose(u["trunk"]["conv"]["kernel"], -0.1 * (1 + 0.05), rtol=1e-5)
    # LARC: the group's decay enters the trust ratio, as LARC built with it alone (gradients
    # not parallel to the weights, else the decay cancels out of the ratio).
    grads = jax.tree.map(lambda p: jnp.linspace(-0.3, 0.5, p.size).reshape(p.shape), params)
    larc = _cfg(name="larc", weight_decay=1e-4, param_groups=(("head", 1.0, 0.2),))
    u = first_update(larc, grads=grads)
    head = {"head": params["head"]}
    alone = _cfg(name="larc", weight_decay=0.2)
    want = optim.build_optimizer(alone, head, lambda s: 0.1)
    want = want.update({"head": grads["head"]}, want.init(head), head)[0]
    np.testing.assert_allclose(u["head"]["fc0"]["kernel"], want["head"]["fc0"]["kernel"], 1e-6)
    trunk_only = optim.build_optimizer(_cfg(name="larc", weight_decay=0.2), params, lambda s: 0.1)
    other = trunk_only.update(grads, trunk_only.init(params), params)[0]
    assert not np.allclose(u["trunk"]["conv"]["kernel"], other["trunk"]["conv"]["kernel"])


def test_group_weight_decay_is_constant_under_a_cosine_schedule():
    # The run's decay follows the cosine 0.5 -> 0.1 over 4 steps; the head keeps 0.2.
    c = _cfg(
        name="sgd",
        momentum=0.0,
        weight_decay=0.5,
        weight_decay_schedule="cosine",
        weight_decay_end=0.1,
        update_interval="step",
        param_groups=(("head", 1.0, 0.2),),
    )
    params = _model_params()
    tx = optim.build_grouped_optimizer(
        c, params, lambda s: 0.1, 256, steps_per_epoch=2, num_epochs=2
    )
    state = tx.init(params)
    grads = jax.tree.map(jnp.zeros_like, params)  # the update is the decay alone
    schedule = optim.weight_decay_schedule(c, 2, 2)
    for step in range(4):
        updates, state = tx.update(grads, state, params)
        np.testing.assert_allclose(updates["head"]["fc0"]["kernel"], -0.1 * 0.2, rtol=1e-6)
        trunk_decay = float(schedule(step))
        np.testing.assert_allclose(
            updates["trunk"]["conv"]["kernel"], -0.1 * trunk_decay, rtol=1e-5
        )
    assert float(schedule(0)) == 0.5 and float(schedule(3)) < 0.2
