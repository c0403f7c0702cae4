"""engine=verify (jssl.engines.verify) on MoCo's test preset with a one-block ViT: on 4 devices,
heads without batch norm, the state split, the block recomputed (gathering its own split
parameters) and 2 micro-batches pass against one device and across a save and restore; heads
with per-device batch norm (model.sync_bn=False) fail with exit status 1 and the cause named;
bad verify fields and several processes are refused.

Both 4-device runs share one subprocess (this file run as a script), so they pay for one start
of Python, JAX and TensorFlow."""

import json
import os
import re
import subprocess
import sys

import jax
import pytest

pytestmark = pytest.mark.e2e  # the end-to-end tier (JSSL_E2E_TESTS=1)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICES = 4


def _config(data_dir: str, case: str):
    """MoCo's test preset on a one-block ViT: heads without batch norm (``bn_free``: nothing
    depends on how the batch is split; the state split 4 ways, 2 micro-batches), or with
    per-device batch norm (``per_device_bn``: its statistics depend on the device count)."""
    from configs import moco

    config = moco.get_config("test")
    config.engine = "verify"
    config.data.data_dir = data_dir
    config.checkpoint.async_save = False
    m = config.model
    m.trunk, m.vit_depth, m.patch_size, m.image_size = "vit_tiny", 1, 8, 16
    m.head_dims = (192, 32, 16)
    if case == "bn_free":
        m.head_bn = m.head_last_bn = False
        config.parallel.shard_params = True
        config.parallel.shard_min_size = 1024  # every kernel split 4 ways
        config.optim.accumulation_steps = 2
        m.remat = "full"  # the block gathers its split kernels itself (jssl.models.remat)
        config.verify.steps = 4
    else:
        assert case == "per_device_bn" and m.head_bn and not m.sync_bn
        config.verify.steps = 2
    return config


def _main(out: str, data_dir: str, workdir: str) -> None:
    """On DEVICES devices: each case through jssl.engines.run, as launch.py runs it."""
    from absl import logging

    from jssl import engines

    logging.set_verbosity(logging.INFO)  # the report's log lines, as launch.py shows them
    assert jax.device_count() == DEVICES
    results = {}
    for case in ("bn_free", "per_device_bn"):
        report = engines.run(_config(data_dir, case), os.path.join(workdir, case))
        results[case] = dict(report, exit_status=engines.exit_status(report))
    with open(out, "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def reports(shared_dirs, tmp_path_factory):
    base = tmp_path_factory.mktemp("verify")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    devices = f"--xla_force_host_platform_device_count={DEVICES}"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {devices}"  # after conftest's -O0 flags
    env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir or shared_dirs[1]
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # as the session's other tests
    command = [sys.executable, __file__, str(base / "out.json"), shared_dirs[0], str(base)]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    with open(base / "out.json") as f:
        results = json.load(f)
    for case, report in results.items():  # the report returned is the one written
        with open(base / case / "verify.json") as f:
            assert json.load(f)["verdict"] == report["verdict"]
    return results, done.stderr


def test_split_state_and_micro_batches_match_one_device(reports):
    report = reports[0]["bn_free"]
    assert report["devices"] == DEVICES and report["shard_params"]
    assert report["accumulation_steps"] == 2
    assert report["verdict"] == "pass" and report["exit_status"] == 0, report["message"]
    rows = report["rows"]
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]
    assert rows[0]["one_device"]["state"]["rel"] == 0  # the same initial state on 1 device
    losses = [row["loss"]["as_given"] for row in rows[1:]]
    assert len(set(losses)) == 4  # the steps train: each compares a new state
    for row in rows[1:]:
        assert abs(row["loss"]["one_device"] - row["loss"]["as_given"]) < 1e-4
        assert row["one_device"]["state"]["excess"] <= 1
    # C joins after its restore at step 2 and trains steps 3 and 4 itself.
    assert "resumed" not in rows[1] and rows[2]["loss"]["resumed"] is None
    assert [row["loss"]["resumed"] for row in rows[3:]] == losses[2:]
    assert "verify PASSED" in reports[1]
    # The block's 4 kernels (qkv, projection, MLP) in the online and the momentum encoder
    # reach it split; the patch embedding and the head's kernels are gathered before.
    gathered = re.findall(r"gathered block by block \(model.remat\): (\d+) of (\d+)", reports[1])
    assert gathered and all(int(n) == 8 < int(of) for n, of in gathered), gathered


def test_per_device_batch_norm_fails_and_names_the_cause(reports):
    report = reports[0]["per_device_bn"]
    assert report["verdict"] == "fail" and not report["passed"]
    assert report["exit_status"] == 1  # launch.py exits with it
    worst = report["worst"]["one_device"]
    assert worst["first_failing_step"] == 1
    assert worst["loss"]["rel"] > 1e-3  # per-device statistics of 4 examples, not rounding
    assert "loss" in report["rows"][1]["one_device"]["beyond"]
    # The resumed run is the same program on the same devices: it continues exactly.
    assert report["worst"]["resumed"]["first_failing_step"] is None
    assert any("model.sync_bn=False" in note for note in report["expected_differences"])
    assert "model.sync_bn=False" in report["message"]
    assert "verify FAILED" in reports[1]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("verify.steps", 1, "verify.steps=1 must be an integer >= 2"),
        ("verify.steps", 0, "verify.steps=0 must be an integer >= 2"),
        ("verify.rtol", -1e-3, "verify.rtol=-0.001 must be a number >= 0"),
    ],
)
def test_bad_fields_are_refused(shared_dirs, field, value, message):
    from jssl.engines import verify

    config = _config(shared_dirs[0], "per_device_bn")
    group, name = field.split(".")
    config[group][name] = value
    with pytest.raises(ValueError, match=message):
        verify.validate(config)


def test_more_steps_than_the_run_are_refused(shared_dirs, tmp_path):
    from jssl.engines import verify

    config = _config(shared_dirs[0], "per_device_bn")
    config.verify.steps = 9  # the test preset: 2 epochs of 4 steps
    with pytest.raises(ValueError, match="verify.steps=9 is more than the config's 8 steps"):
        verify.run(config, str(tmp_path))


def test_several_processes_are_refused(shared_dirs, monkeypatch):
    from jssl.engines import verify

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="runs in one process, not 2: run it on one host"):
        verify.validate(_config(shared_dirs[0], "per_device_bn"))


if __name__ == "__main__":
    _main(*sys.argv[1:])
