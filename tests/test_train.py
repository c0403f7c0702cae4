"""End-to-end tests of the train engine: kill/resume parity, SIGTERM, non-finite losses, the
test phase and max_steps, on the "test" preset of configs/moco.py (16 px, tiny ResNet-18,
64 examples, 4 steps per epoch).

Kill and SIGTERM tests use real ``launch.py`` processes; the rest call
``jssl.engines.train.run`` in-process.
"""

import os
import re
import shutil
import signal
import subprocess
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from test_launch import (
    REPO,
    enable_compilation_cache,
    launch_args,
    launch_env,
    prepare_shared_dirs,
    read_events,
    run_launch,
    scalar_values,
)

from configs import moco
from jssl import checkpoint
from jssl.engines import train

# 2 epochs of 4 steps; a synchronous checkpoint every 2 steps, so steps 2 and 6 are
# mid-epoch ones (4 and 8 end an epoch).
RESUME_OVERRIDES = (
    "--config.num_epochs=2",
    "--config.checkpoint.every_steps=2",
    "--config.checkpoint.async_save=False",
    "--config.checkpoint.max_to_keep=10",
)
TOTAL_STEPS = 8


@pytest.fixture(scope="session")
def shared_dirs(tmp_path_factory):
    return prepare_shared_dirs(tmp_path_factory)


@pytest.fixture(scope="module")
def compilation_cache(shared_dirs):
    enable_compilation_cache(shared_dirs[1])


def make_config(shared_dirs, **overrides):
    config = moco.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.checkpoint.async_save = False
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for name in parents:
            node = node[name]
        node[leaf] = value
    return config


def checkpoint_steps(workdir) -> list[int]:
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        return []
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def load_checkpoint(workdir, step: int | None = None) -> tuple[dict, dict]:
    """(state as a dict of arrays, data position) of a checkpoint, without a target."""
    manager = ocp.CheckpointManager(
        checkpoint.checkpoint_dir(workdir), item_names=("state", "data")
    )
    step = manager.latest_step() if step is None else step
    restored = manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore()),
    )
    manager.close()
    return jax.device_get(restored["state"]), restored["data"]


def assert_states_close(actual: dict, expected: dict) -> None:
    for name in ("params", "batch_stats", "ema_params", "ema_batch_stats", "method_state"):
        flat_a = jax.tree_util.tree_leaves_with_path(actual[name])
        flat_e = jax.tree_util.tree_leaves_with_path(expected[name])
        assert [p for p, _ in flat_a] == [p for p, _ in flat_e]
        for (path, a), (_, e) in zip(flat_a, flat_e, strict=True):
            np.testing.assert_allclose(
                a, e, rtol=1e-5, atol=1e-7, err_msg=f"{name}{jax.tree_util.keystr(path)}"
            )
    assert int(actual["step"]) == int(expected["step"])


def start_launch(workdir, shared_dirs, *overrides: str) -> subprocess.Popen:
    data_dir, cache_dir = shared_dirs
    return subprocess.Popen(
        launch_args(workdir, data_dir, *overrides),
        cwd=REPO,
        env=launch_env(cache_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_checkpoint(process: subprocess.Popen, workdir, step: int, timeout: float = 180):
    """Polls until ``checkpoints/<step>`` exists (orbax renames it there once complete)."""
    path = os.path.join(workdir, "checkpoints", str(step))
    deadline = time.monotonic() + timeout
    while not os.path.isdir(path):
        if process.poll() is not None:
            pytest.fail(
                f"launch.py exited ({process.returncode}) before step {step}:\n"
                + process.stdout.read()[-5000:]
            )
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no checkpoint {path} after {timeout} s")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, shared_dirs):
    """A run of RESUME_OVERRIDES that was never interrupted: its final checkpoint."""
    workdir = tmp_path_factory.mktemp("reference")
    result = run_launch(workdir, shared_dirs, *RESUME_OVERRIDES)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    assert checkpoint_steps(workdir)[-1] == TOTAL_STEPS
    return load_checkpoint(workdir, TOTAL_STEPS)[0]


def _resumed_from(log: str) -> tuple[int, int, int]:
    match = re.search(r"Resumed from step (\d+) \(epoch (\d+), batch (\d+)\)", log)
    assert match, log[-5000:]
    return tuple(int(g) for g in match.groups())


def test_sigkill_mid_epoch_then_resume_matches_uninterrupted(tmp_path, shared_dirs, reference_run):
    workdir = tmp_path / "killed"
    process = start_launch(workdir, shared_dirs, *RESUME_OVERRIDES)
    wait_for_checkpoint(process, workdir, 2)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    process.stdout.close()
    assert process.returncode == -signal.SIGKILL
    saved = checkpoint_steps(workdir)
    assert 2 in saved and saved[-1] < TOTAL_STEPS, saved
    # The kill lands within a poll of step 2's checkpoint, long before step 4's synchronous
    # save completes; should a loaded machine have let it finish, drop it, so that the resume
    # below is always from the middle of an epoch (what a kill right after step 2 leaves).
    for step in saved:
        if step > 2:
            shutil.rmtree(os.path.join(workdir, "checkpoints", str(step)))

    result = run_launch(workdir, shared_dirs, *RESUME_OVERRIDES)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    step, epoch, batch = _resumed_from(log)
    assert (step, epoch, batch) == (2, 0, 2)
    final, position = load_checkpoint(workdir, TOTAL_STEPS)
    assert position == {"epoch": 2, "step_in_epoch": 0}
    assert_states_close(final, reference_run)


def test_sigterm_saves_exits_zero_and_resumes(tmp_path, shared_dirs, reference_run):
    workdir = tmp_path / "preempted"
    process = start_launch(workdir, shared_dirs, *RESUME_OVERRIDES)
    wait_for_checkpoint(process, workdir, 2)
    process.send_signal(signal.SIGTERM)
    log, _ = process.communicate(timeout=120)
    assert process.returncode == 0, log[-5000:]
    match = re.search(r"Stopped by SIGTERM at step (\d+)", log)
    assert match, log[-5000:]
    stopped = int(match.group(1))
    assert 2 <= stopped < TOTAL_STEPS
    assert checkpoint_steps(workdir)[-1] == stopped
    state, position = load_checkpoint(workdir, stopped)
    assert int(state["step"]) == stopped
    assert (position["epoch"], position["step_in_epoch"]) == divmod(stopped, 4)

    result = run_launch(workdir, shared_dirs, *RESUME_OVERRIDES)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    assert _resumed_from(log)[0] == stopped
    assert_states_close(load_checkpoint(workdir, TOTAL_STEPS)[0], reference_run)


def test_non_finite_loss_stops_and_keeps_finite_checkpoints(
    tmp_path, shared_dirs, compilation_cache
):
    config = make_config(
        shared_dirs, **{"optim.base_lr": 1e30, "checkpoint.every_steps": 1, "num_epochs": 1}
    )
    with pytest.raises(train.NonFiniteLossError, match=r"non-finite at step \d+") as info:
        train.run(config, str(tmp_path))
    bad_step = int(re.search(r"at step (\d+)", str(info.value)).group(1))
    saved = checkpoint_steps(tmp_path)
    assert saved and max(saved) <= bad_step, (saved, bad_step)
    for step in saved:
        state, _ = load_checkpoint(tmp_path, step)
        for leaf in jax.tree.leaves(state):
            assert np.all(np.isfinite(leaf)), f"non-finite values in checkpoint {step}"
        assert int(state["nonfinite_step"]) == -1


def test_test_phase_writes_validation_loss(tmp_path, shared_dirs, compilation_cache):
    # A slice of the test split keeps the test phase short (its default is all 2000).
    config = make_config(
        shared_dirs, num_epochs=1, test_every_epochs=1, **{"data.test_split": "test[:160]"}
    )
    summary = train.run(config, str(tmp_path))
    assert summary["step"] == 4
    events = read_events(tmp_path / "tensorboard")
    assert events.get("test/loss") == {4: "scalars"}, sorted(events)
    test_loss = scalar_values(tmp_path / "tensorboard", "test/loss")[4]
    assert np.isfinite(test_loss) and test_loss > 0


def test_max_steps_stops_mid_epoch_with_a_checkpoint(tmp_path, shared_dirs, compilation_cache):
    config = make_config(shared_dirs, **{"debug.max_steps": 3})
    summary = train.run(config, str(tmp_path))
    assert summary["step"] == 3 and int(summary["state"].step) == 3
    assert checkpoint_steps(tmp_path) == [3]
    state, position = load_checkpoint(tmp_path)
    assert position == {"epoch": 0, "step_in_epoch": 3}
    np.testing.assert_allclose(
        state["params"]["head"]["fc1"]["kernel"],
        np.asarray(summary["state"].params["head"]["fc1"]["kernel"]),
    )
    # Rerunning a finished max_steps run trains nothing more.
    assert train.run(config, str(tmp_path))["step"] == 3
