"""BYOL: its loss on hand-computed cases (the target gets no gradient), the target's EMA in
the real step (cosine momentum, updated after the step, no predictor), presets, start-up
checks (its step's wiring on 1 vs 4 devices: MoCo v3's in tests/training/test_parallel.py; the
contract: test_contract.py; a run end to end: test_contract_runs.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import byol
from jssl import data, losses, methods, parallel
from jssl.engines import train
from jssl.methods import common
from jssl.training.step import make_train_step


def test_regression_loss_hand_computed():
    # Example 0: view 1 predicts [1, 0] against view 2's target [0, 3] (orthogonal: 2 - 0);
    # view 2 predicts [2, 2] against view 1's target [1, 1] (parallel: 0). Example 1: opposite
    # (2 + 2 = 4) and 60 degrees (2 - 2 * 0.5 = 1). Scales do not matter.
    predictions = jnp.array([[[1.0, 0.0], [0.0, -5.0]], [[2.0, 2.0], [1.0, 0.0]]])
    targets = jnp.array([[[1.0, 1.0], [0.5, np.sqrt(3) / 2]], [[0.0, 3.0], [0.0, 2.0]]])
    value, metrics, per_example = losses.byol_loss(predictions, targets)
    np.testing.assert_allclose(per_example, [2.0 + 0.0, 4.0 + 1.0], atol=1e-6)
    assert float(value) == pytest.approx(3.5, abs=1e-6)
    assert float(metrics["cosine"]) == pytest.approx((0.0 + 1.0 - 1.0 + 0.5) / 4, abs=1e-6)


def test_regression_gradient_reaches_predictions_only():
    predictions = jnp.array([[[1.0, 0.0]], [[2.0, 0.0]]])
    targets = jnp.array([[[0.0, 1.0]], [[0.0, 4.0]]])
    grad_p, grad_z = jax.grad(lambda p, z: losses.byol_loss(p, z)[0], argnums=(0, 1))(
        predictions, targets
    )
    np.testing.assert_array_equal(grad_z, 0.0)  # the target is a stop-gradient
    # d(2 - 2 cos(p, z))/dp = -2 (z/|z| - cos p/|p|) / |p|; here cos = 0.
    np.testing.assert_allclose(grad_p[0, 0], [0.0, -2.0], atol=1e-6)
    np.testing.assert_allclose(grad_p[1, 0], [0.0, -1.0], atol=1e-6)


def test_cosine_momentum_schedule():
    total = 10
    values = [float(common.cosine_momentum(k, total, 0.996)) for k in (0, 5, 10, 12)]
    np.testing.assert_allclose(values, [0.996, 0.998, 1.0, 1.0], atol=1e-7)


def test_target_is_the_ema_of_online_after_the_step_and_has_no_predictor():
    config = byol.get_config("test")
    steps_per_epoch = 4
    mesh = parallel.make_mesh()
    method = methods.get(config, steps_per_epoch)
    tx, schedule = train.make_optimizer(config, method, steps_per_epoch)
    state = train.init_state(config, method, tx, mesh)
    step = make_train_step(method, tx, schedule, mesh)

    assert "predictor" in state.params and "predictor" in state.batch_stats
    assert set(state.ema_params) == {"trunk", "head"}
    for a, b in zip(
        jax.tree.leaves(state.ema_params),
        jax.tree.leaves({k: v for k, v in state.params.items() if k != "predictor"}),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)  # the target starts as a copy

    def host(tree):
        return jax.tree.map(np.asarray, tree)

    total = config.num_epochs * steps_per_epoch
    for i in range(2):
        before = host((state.ema_params, state.ema_batch_stats, state.params["predictor"]))
        batch = parallel.host_batch_to_global(data.synthetic_batch(config.data, 16, seed=i), mesh)
        state, metrics = step(state, batch)
        # After k optimizer steps the target takes tau(k) (VISSL's hook at iteration k).
        tau = 1 - (1 - config.method.base_momentum) * (np.cos(np.pi * (i + 1) / total) + 1) / 2
        assert float(metrics["target_momentum"]) == pytest.approx(tau, rel=1e-6)
        online = host({k: v for k, v in state.params.items() if k != "predictor"})
        expected = jax.tree.map(lambda t, o, m=tau: m * t + (1 - m) * o, before[0], online)
        for got, want in zip(
            jax.tree.leaves(host(state.ema_params)), jax.tree.leaves(expected), strict=True
        ):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        # The target's own train-mode forward moved its BN statistics; the predictor trained.
        moved = jax.tree.map(
            lambda a, b: np.abs(a - b).max(), before[1], host(state.ema_batch_stats)
        )
        assert max(jax.tree.leaves(moved)) > 0
        moved = jax.tree.map(
            lambda a, b: np.abs(a - b).max(), before[2], host(state.params["predictor"])
        )
        assert max(jax.tree.leaves(moved)) > 0


def test_presets_follow_the_paper_and_vissl():
    config = byol.get_config()
    assert config.data.augment.num_crops == (1, 1)
    assert config.data.augment.blur_prob == (1.0, 0.1)
    assert config.data.augment.solarize_prob == (0.0, 0.2)
    assert config.model.head_dims == (2048, 4096, 256) and config.model.head_bn
    assert config.method.predictor_dims == (256, 4096, 256) and config.method.predictor_bn
    assert config.method.base_momentum == 0.996 and config.num_epochs == 300
    o = config.optim
    assert (o.name, o.trust_ratio_exclude, o.base_lr, o.weight_decay) == (
        "lars",
        "bias_and_norm",
        0.2,
        1.5e-6,
    )
    assert not o.regularize_bn and not o.regularize_bias and o.warmup_epochs == 10
    assert dict(config.loss.weights) == {"regression": 1.0}
    for preset in ("demo", "test"):
        methods.check_config(byol.get_config(preset))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("data.augment.num_crops", (2, 2), r"num_crops=\(2, 2\): BYOL takes exactly two"),
        ("method.predictor_dims", (32, 32, 16), r"predictor_dims=\(32, 32, 16\).*head_dims"),
        ("method.predictor_dims", (16, 32, 8), r"start and end with the projector's output"),
        ("method.base_momentum", 1.5, "base_momentum=1.5"),
        ("model.head_dims", (), "needs a projector head"),
    ],
)
def test_bad_settings_name_the_field(field, value, message):
    config = byol.get_config("test")
    config.update_from_flattened_dict({field: value})
    with pytest.raises(ValueError, match=message):
        methods.check_config(config)
