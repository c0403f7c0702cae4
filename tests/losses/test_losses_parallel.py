"""SimCLR's gathered negatives, MoCo v3's gathered keys and SwAV's Sinkhorn sums: the same
global batch gives the same loss, gradients, per-example losses and codes without a mesh, on a
1-device mesh and on a 4-device mesh (tests/support/losses_parity.py in a subprocess with 4
forced CPU devices)."""

import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "support", "losses_parity.py")
LOSSES = ("simclr", "multicrop", "mocov3", "swav")
OUTPUTS = ("loss", "grad_w", "grad_prototypes", "per_example", "codes")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("losses") / "r.npz"
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    subprocess.run([sys.executable, SCRIPT, str(out)], env=env, check=True, cwd=ROOT, timeout=300)
    return dict(np.load(out))


@pytest.mark.parametrize("name", LOSSES)
def test_one_and_four_devices_match(results, name):
    assert int(results["devices"]) == 4
    for output in OUTPUTS:
        reference = results[f"{name}/plain/{output}"]
        for variant in ("one", "many"):
            # Only the float32 reduction order differs (seen: <= 1e-6 absolute).
            np.testing.assert_allclose(
                results[f"{name}/{variant}/{output}"],
                reference,
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"{name} {output} on the {variant}-device mesh",
            )
    metrics = [k for k in results if k.startswith(f"{name}/plain/metric/")]
    assert metrics
    for key in metrics:
        np.testing.assert_allclose(results[key.replace("/plain/", "/many/")], results[key], 1e-5)


@pytest.mark.parametrize("name", LOSSES)
def test_per_device_sums_would_differ(results, name):
    """The comparison above can fail: with negatives and Sinkhorn sums from each device's own
    quarter of the batch, loss and gradients move far beyond its tolerance."""
    assert np.abs(results[f"{name}/plain/grad_w"]).max() > 1e-2
    for output in ("loss", "grad_w"):
        difference = results[f"{name}/local/{output}"] - results[f"{name}/plain/{output}"]
        assert np.abs(difference).max() > 1e-2, (name, output)
    if name == "swav":
        assert np.abs(results["swav/plain/grad_prototypes"]).max() > 1e-2
        assert np.abs(results["swav/local/codes"] - results["swav/plain/codes"]).max() > 1e-2
