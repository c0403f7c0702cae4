"""Named loss terms with weights and ramps (jssl.methods.common.loss_weights / weighted_loss,
jssl.optim.schedules.ramp): the schedule's values, the weighted sum, the start-up checks, and a
short MoCo run whose ramped weight takes its scheduled values, is logged, and picks up at
the right value after a resume in the middle of the ramp."""

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from support.launch import scalar_values
from support.runs import make_config

from configs import base, dino, moco, swav
from jssl import methods
from jssl.engines import train
from jssl.methods import common
from jssl.optim import schedules


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
    config.method.name = "vicreg"
    base.loss_terms(config, invariance=25, covariance=1)
    # The term not given gets a field too: None, its default weight (1).
    assert dict(config.loss.weights) == {"invariance": 25.0, "covariance": 1.0, "variance": None}
    assert config.loss.ramps.covariance.kind == "constant"


def test_terms_of_a_config_are_one_mechanism_for_every_method():
    # Static TERMS and terms(config) both come back as LossTerms; parts name their family.
    assert methods.loss_terms(moco.get_config("test")) == (common.LossTerm("info_nce", "info_nce"),)
    config = swav.get_config("test")
    config.method.crops_for_assign = (1, 0, 2)
    assert methods.loss_terms(config) == tuple(
        common.LossTerm(f"swapped_prediction_crop{c}", "swapped_prediction", 1 / 3)
        for c in (1, 0, 2)
    )
    # A part the config does not declare (crops changed after loss_terms) weighs its share.
    weights = common.loss_weights(config, methods.loss_terms(config))(0)
    np.testing.assert_allclose([float(weights[t]) for t in sorted(weights)], [1 / 3] * 3)
    methods.check_config(config)


def test_loss_terms_declares_placeholders_for_the_parts_of_a_family():
    config = dino.get_config("test")
    assert dict(config.loss.weights) == {
        "cross_entropy": 1.0,
        "cross_entropy_crop0": None,
        "cross_entropy_crop1": None,
        "koleo": None,  # an optional term (jssl.methods.koleo), off until set
    }
    assert config.loss.ramps.cross_entropy_crop1.kind == "constant"
    assert config.loss.ramps.koleo.kind == "constant"
    # Fewer teacher crops on the command line: the unset part's fields are left alone, a
    # part set to a weight the method no longer has is refused.
    config.method.teacher_crops = 1
    config.data.augment.num_crops = (1, 3)
    config.data.augment.crop_sizes = (16, 8)
    config.data.augment.crop_scale = ((0.3, 1.0), (0.1, 0.3))
    config.data.augment.blur_prob = (0.0,)
    config.data.augment.solarize_prob = (0.0,)
    methods.check_config(config)
    config.loss.ramps.cross_entropy_crop1.kind = "linear"
    with pytest.raises(ValueError, match=r"loss.ramps names \['cross_entropy_crop1'\]"):
        methods.check_config(config)


def test_family_weights_multiply_and_exact_defaults():
    specs = common.crop_terms("ce", (0, 1))
    config = ml_collections.ConfigDict({"loss": {"weights": {"ce": 1.0}, "ramps": {}}})
    weights = common.loss_weights(config, specs)(0)
    assert [float(weights[t.name]) for t in specs] == [0.5, 0.5]
    terms = {"ce_crop0": jnp.array([1.0, 2.0]), "ce_crop1": jnp.array([3.0, 6.0])}
    value, per_example, metrics = common.weighted_loss(terms, weights, specs)
    np.testing.assert_array_equal(per_example, [2.0, 4.0])
    assert float(metrics["loss/ce"]) == 3.0 and float(metrics["loss/ce_weighted"]) == 3.0
    assert float(metrics["loss/ce_crop1_weighted"]) == 2.25
    reported = common.reported_terms(terms, specs)
    np.testing.assert_array_equal(reported["ce"], [2.0, 4.0])
    assert set(reported) == {"ce", "ce_crop0", "ce_crop1"}
    # A config saved before the split (only the family) or none at all: the shares.
    assert float(common.loss_weights(ml_collections.ConfigDict(), specs)(0)["ce_crop1"]) == 0.5


@pytest.mark.e2e
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
