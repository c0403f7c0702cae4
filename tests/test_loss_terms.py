"""Named loss terms with weights and ramps (jssl.methods.common.loss_weights / weighted_loss,
jssl.schedules.ramp): the schedule's values, the weighted sum, the start-up checks, and a
short MoCo run whose ramped weight takes its scheduled values, is logged, and picks up at
the right value after a resume in the middle of the ramp."""

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from test_launch import scalar_values
from test_train import make_config, shared_dirs  # noqa: F401 (fixture)

from configs import base, moco
from jssl import methods, schedules
from jssl.engines import train
from jssl.methods import common


def test_ramps_hold_move_and_hold():
    linear = schedules.ramp("linear", 1.0, 3.0, 2, 6)
    assert [float(linear(s)) for s in range(9)] == [1, 1, 1, 1.5, 2, 2.5, 3, 3, 3]
    cosine = schedules.ramp("cosine", 0.0, 2.0, 0, 4)
    np.testing.assert_allclose(
        [float(cosine(s)) for s in range(6)],
        [0.0, 2 * (1 - np.cos(np.pi / 4)) / 2, 1.0, 2 * (1 - np.cos(3 * np.pi / 4)) / 2, 2, 2],
        rtol=1e-6,
    )
    step = schedules.ramp("linear", 5.0, 0.5, 3, 3)  # begin == end: a step at begin
    assert [float(step(s)) for s in range(5)] == [5, 5, 5, 0.5, 0.5]
    assert float(schedules.ramp("constant", 9.0, 0.25, 0, 10)(0)) == 0.25


def test_weighted_loss_is_the_mean_of_the_weighted_sum_and_logs_every_term():
    terms = {"a": jnp.array([1.0, 3.0]), "b": jnp.array([2.0, 2.0])}
    value, per_example, metrics = common.weighted_loss(terms, {"a": 0.5, "b": 2.0})
    np.testing.assert_allclose(per_example, [4.5, 5.5])
    assert float(value) == 5.0
    assert float(metrics["loss/a"]) == 2.0 and float(metrics["loss/a_weighted"]) == 1.0
    assert float(metrics["loss/b_weighted"]) == 4.0 and float(metrics["loss_weight/b"]) == 2.0


def test_weights_follow_the_config_in_epochs_or_steps():
    config = moco.get_config("test")
    config.loss.weights.info_nce = 2.0
    ramp = config.loss.ramps.info_nce
    ramp.kind, ramp.initial, ramp.begin, ramp.end = "linear", 0.0, 1.0, 2.0  # epochs
    weights_at = common.loss_weights(config, ("info_nce",), 10)
    assert [float(weights_at(s)["info_nce"]) for s in (0, 10, 15, 20, 99)] == [0, 0, 1, 2, 2]
    # Without an epoch length (evaluation engines) an epoch ramp reads as finished.
    assert float(common.loss_weights(config, ("info_nce",))(0)["info_nce"]) == 2.0
    ramp.unit = "steps"
    weights_at = common.loss_weights(config, ("info_nce",), 10)
    assert [float(weights_at(s)["info_nce"]) for s in (0, 1, 2, 3)] == [0, 0, 2, 2]
    # A config from before loss terms existed: weight 1.
    assert float(common.loss_weights(ml_collections.ConfigDict(), ("x",))(0)["x"]) == 1.0


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: setattr(c.loss.weights, "kl", 1.0), r"loss.weights names \['kl'\]"),
        (lambda c: setattr(c.loss.ramps.info_nce, "kind", "exp"), r"kind='exp' is not one of"),
        (lambda c: setattr(c.loss.ramps.info_nce, "unit", "iters"), r"unit='iters'"),
        (
            lambda c: c.loss.ramps.info_nce.update(kind="linear", begin=3.0, end=1.0),
            r"begin=3.0 and end=1.0 must satisfy",
        ),
    ],
)
def test_bad_loss_settings_name_the_field(edit, message):
    config = moco.get_config("test")
    edit(config)
    with pytest.raises(ValueError, match=message):
        methods.check_config(config)


def test_loss_terms_declares_weights_and_constant_ramps():
    config = base.get_base_config()
    base.loss_terms(config, invariance=25, covariance=1)
    assert dict(config.loss.weights) == {"invariance": 25.0, "covariance": 1.0}
    assert config.loss.ramps.covariance.kind == "constant"


def test_ramped_weight_is_applied_logged_and_resumed_mid_ramp(tmp_path, shared_dirs):  # noqa: F811
    overrides = {
        "log_every_steps": 1,
        "loss.weights.info_nce": 2.0,
        "loss.ramps.info_nce.kind": "linear",
        "loss.ramps.info_nce.initial": 0.5,
        "loss.ramps.info_nce.begin": 1.0,
        "loss.ramps.info_nce.end": 5.0,
        "loss.ramps.info_nce.unit": "steps",
        "num_epochs": 2,
    }
    expected = schedules.ramp("linear", 0.5, 2.0, 1, 5)
    train.run(make_config(shared_dirs, **overrides, **{"debug.max_steps": 3}), str(tmp_path))
    summary = train.run(make_config(shared_dirs, **overrides), str(tmp_path))  # resumes at 3
    assert summary["step"] == 8
    logdir = tmp_path / "tensorboard"
    weights = scalar_values(logdir, "loss_weight/info_nce")
    # Logged after the update of step s - 1, whose loss used the weight at step s - 1.
    assert sorted(weights) == list(range(1, 9))
    for step, value in weights.items():
        np.testing.assert_allclose(value, float(expected(step - 1)), rtol=1e-6, err_msg=step)
    raw = scalar_values(logdir, "loss/info_nce")
    weighted = scalar_values(logdir, "loss/info_nce_weighted")
    total = scalar_values(logdir, "loss")
    for step in weights:
        np.testing.assert_allclose(weighted[step], weights[step] * raw[step], rtol=1e-5)
        np.testing.assert_allclose(total[step], weighted[step], rtol=1e-5)
