"""Barlow Twins: its terms on hand-computed cases, the config weights giving VISSL's loss, the
loss and gradient on 1 vs 4 devices (tests/support/decorrelation_parity.py) and the train step
on 1 vs 4 devices (tests/training/test_parallel.py), presets and start-up checks. The contract:
test_contract.py; a run end to end: test_contract_runs.py."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from configs import barlow_twins
from jssl import losses, methods
from jssl.methods import barlow_twins as barlow_method
from jssl.methods import common

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Two images, two features. Per view: feature means 0, biased variances 1 and 4 (view 1),
# 9 and 1 (view 2); both views together: variances 5 and 2.5.
VIEW1 = jnp.array([[1.0, 2.0], [-1.0, -2.0]])
VIEW2 = jnp.array([[3.0, -1.0], [-3.0, 1.0]])


def _terms(view1, view2, joint):
    terms, metrics = losses.barlow_twins_terms(view1, view2, normalize_jointly=joint, eps=0.0)
    return {k: np.asarray(v) for k, v in terms.items()}, metrics


def test_terms_per_view_statistics_by_hand():
    # Standardised: a = [[1, 1], [-1, -1]], b = [[1, -1], [-1, 1]]; C = a^T b / 2 =
    # [[1, -1], [1, -1]]: invariance (1 - 1)^2 + (1 + 1)^2 = 4, redundancy 1 + 1 = 2.
    terms, metrics = _terms(VIEW1, VIEW2, joint=False)
    np.testing.assert_allclose(terms["invariance"], [4.0, 4.0], rtol=1e-6)
    np.testing.assert_allclose(terms["redundancy_reduction"], [2.0, 2.0], rtol=1e-6)
    assert float(metrics["cross_corr_diagonal"]) == pytest.approx(0.0, abs=1e-6)


def test_terms_joint_statistics_by_hand():
    # VISSL: one mean and variance over both views (5 and 2.5 per feature). C_00 = 3 / 5,
    # C_11 = -2 / 2.5, C_01 = -1 / sqrt(12.5), C_10 = 6 / sqrt(12.5).
    terms, _ = _terms(VIEW1, VIEW2, joint=True)
    np.testing.assert_allclose(terms["invariance"], 0.4**2 + 1.8**2, rtol=1e-5)
    np.testing.assert_allclose(terms["redundancy_reduction"], (1 + 36) / 12.5, rtol=1e-5)


def test_identical_decorrelated_views_cost_nothing():
    z = jnp.array([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])  # C = identity
    # Per-view statistics remove each view's scale and shift; joint ones only the common.
    for joint, other in ((True, 3.0 * z + 2.0), (False, 3.0 * z + 2.0), (True, z)):
        terms, _ = _terms(z, other, joint)
        if joint and other is not z:
            assert float(terms["invariance"][0]) > 0.1
            continue
        np.testing.assert_allclose(terms["invariance"], 0.0, atol=1e-6)
        np.testing.assert_allclose(terms["redundancy_reduction"], 0.0, atol=1e-6)


def test_config_weights_give_vissls_loss():
    # VISSL: scale_loss * (on_diag + lambda_ * off_diag), scale_loss 0.024, lambda_ 0.0051.
    config = barlow_twins.get_config()
    terms, _ = losses.barlow_twins_terms(VIEW1, VIEW2, eps=0.0)
    weights = common.loss_weights(config, barlow_method.TERMS)(jnp.asarray(0))
    value, _, _ = common.weighted_loss(terms, weights)
    expected = 0.024 * (0.4**2 + 1.8**2 + 0.0051 * (1 + 36) / 12.5)
    assert float(value) == pytest.approx(expected, rel=1e-5)


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity") / "r.npz"
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    script = os.path.join(ROOT, "tests", "support", "decorrelation_parity.py")
    subprocess.run(
        [sys.executable, script, "barlow_twins", str(out)], env=env, check=True, cwd=ROOT
    )
    return dict(np.load(out))


@pytest.mark.parametrize("stats", ["joint", "per_view"])
def test_loss_and_gradient_do_not_depend_on_the_device_count(parity, stats):
    assert int(parity["devices"]) == 4
    keys = [k for k in parity if k.startswith(f"{stats}/plain/")]
    assert f"{stats}/plain/grad_w" in keys and len(keys) > 4
    for key in keys:
        for variant in ("one", "many"):
            np.testing.assert_allclose(
                parity[key.replace("/plain/", f"/{variant}/")], parity[key], rtol=1e-5, atol=1e-6
            )
    # The comparison can fail: per-device statistics and correlations move loss and gradient.
    assert np.abs(parity[f"{stats}/plain/grad_w"]).max() > 1e-2
    for output in ("loss", "grad_w"):
        moved = parity[f"{stats}/local/{output}"] - parity[f"{stats}/plain/{output}"]
        assert np.abs(moved).max() > 1e-2, output


def test_presets_follow_vissl():
    config = barlow_twins.get_config()
    assert config.model.head_dims == (2048, 8192, 8192, 8192)
    assert config.model.head_bn and not config.model.head_last_bn and not config.model.head_bias
    assert config.loss.weights.invariance == 0.024
    assert config.loss.weights.redundancy_reduction == pytest.approx(0.024 * 0.0051)
    assert config.optim.name == "larc" and config.data.batch_size == 2048
    assert config.optim.weight_decay == 1.5e-6 and not config.optim.regularize_bn
    assert config.data.augment.blur_prob == (1.0, 0.1)
    assert config.data.augment.solarize_prob == (0.0, 0.2)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("data.augment.num_crops", (2, 2), r"num_crops=\(2, 2\).*exactly two views"),
        ("loss.weights.redundancy_reduction", -0.1, "redundancy_reduction=-0.1 must be >= 0"),
        ("model.head_dims", (), "needs a projector"),
    ],
)
def test_bad_settings_name_the_field(field, value, message):
    config = barlow_twins.get_config("test")
    config.update_from_flattened_dict({field: value})
    with pytest.raises(ValueError, match=message):
        methods.check_config(config)
