"""VICReg: its terms on hand-computed cases, the loss and gradient on 1 vs 4 devices
(tests/support/decorrelation_parity.py), the train step on 1 vs 4 devices
(tests/training/test_parallel.py), presets and start-up checks. The contract and a run end to
end: test_contract*.py."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from configs import vicreg
from jssl import losses, methods

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _terms(x, y):
    terms, metrics = losses.vicreg_terms(jnp.asarray(x), jnp.asarray(y))
    return {k: np.asarray(v) for k, v in terms.items()}, metrics


def test_invariance_and_variance_by_hand():
    # x: 4 images, feature means 0, unbiased variances 8 / 3 (std > 1: no hinge), no
    # covariance. y = x / 2: variances 2 / 3, std sqrt(2/3 + 1e-4) < 1 on both features.
    x = np.array([[2.0, 0.0], [0.0, 2.0], [-2.0, 0.0], [0.0, -2.0]])
    terms, metrics = _terms(x, x / 2)
    np.testing.assert_allclose(terms["invariance"], [0.5, 0.5, 0.5, 0.5], rtol=1e-6)
    hinge_y = 1.0 - np.sqrt(2.0 / 3.0 + 1e-4)
    np.testing.assert_allclose(terms["variance"], (0.0 + hinge_y) / 2, rtol=1e-5)
    np.testing.assert_allclose(terms["covariance"], 0.0, atol=1e-7)
    expected_std = (np.sqrt(8 / 3) + np.sqrt(2 / 3)) / 2
    assert float(metrics["embedding_std"]) == pytest.approx(expected_std, rel=1e-5)


def test_covariance_by_hand():
    # x = [[1, 1], [-1, -1]]: covariance [[2, 2], [2, 2]] (N - 1 = 1); c(x) = (4 + 4) / 2 = 4
    # per view, both views identical: 8. Variances 2: no hinge.
    x = np.array([[1.0, 1.0], [-1.0, -1.0]])
    terms, _ = _terms(x, x)
    np.testing.assert_allclose(terms["covariance"], 8.0, rtol=1e-6)
    np.testing.assert_allclose(terms["invariance"], 0.0, atol=1e-7)
    np.testing.assert_allclose(terms["variance"], 0.0, atol=1e-7)


def test_collapse_costs_the_whole_hinge():
    x = np.ones((4, 3))  # every image the same embedding: std = sqrt(eps) = 0.01
    terms, metrics = _terms(x, x)
    np.testing.assert_allclose(terms["variance"], 1.0 - 0.01, rtol=1e-6)
    assert float(metrics["embedding_std"]) == 0.0


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity") / "r.npz"
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    script = os.path.join(ROOT, "tests", "support", "decorrelation_parity.py")
    subprocess.run([sys.executable, script, "vicreg", str(out)], env=env, check=True, cwd=ROOT)
    return dict(np.load(out))


def test_loss_and_gradient_do_not_depend_on_the_device_count(parity):
    assert int(parity["devices"]) == 4
    keys = [k for k in parity if k.startswith("joint/plain/")]
    assert "joint/plain/grad_w" in keys and len(keys) > 4
    for key in keys:
        for variant in ("one", "many"):
            np.testing.assert_allclose(
                parity[key.replace("/plain/", f"/{variant}/")], parity[key], rtol=1e-5, atol=1e-6
            )
    # Every term is active, and per-device statistics would move loss and gradient.
    for term in ("invariance", "variance", "covariance"):
        assert float(parity[f"joint/plain/metric/loss/{term}"]) > 1e-2, term
    for output in ("loss", "grad_w"):
        moved = parity[f"joint/local/{output}"] - parity[f"joint/plain/{output}"]
        assert np.abs(moved).max() > 1e-2, output


def test_presets_follow_the_paper():
    config = vicreg.get_config()
    assert dict(config.loss.weights) == {"invariance": 25.0, "variance": 25.0, "covariance": 1.0}
    assert config.model.head_dims == (2048, 8192, 8192, 8192) and config.model.head_bn
    assert config.optim.name == "lars" and config.optim.trust_ratio_exclude == "bias_and_norm"
    assert config.optim.base_lr == 0.2 and config.optim.weight_decay == 1e-6
    assert config.data.batch_size == 2048 and config.num_epochs == 1000
    assert config.optim.warmup_epochs == 10 and config.optim.final_lr_fraction == 0.001


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("data.augment.num_crops", (2, 1), r"num_crops=\(2, 1\).*exactly two views"),
        ("loss.weights.variance", -25.0, "variance=-25.0 must be >= 0"),
        ("method.std_target", 0.0, "method.std_target=0.0 must be positive"),
        ("method.std_eps", 0.0, "method.std_eps=0.0 must be positive"),
    ],
)
def test_bad_settings_name_the_field(field, value, message):
    config = vicreg.get_config("test")
    config.update_from_flattened_dict({field: value})
    with pytest.raises(ValueError, match=message):
        methods.check_config(config)
