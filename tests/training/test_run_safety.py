"""What the train engine does when a run goes wrong, on the "test" preset of configs/moco.py
(4 steps per epoch): Ctrl-C, a state that turns non-finite behind a finite loss, a split that
is missing, and an error in the periodic work while a checkpoint is being saved.

Ctrl-C and the error during a save use real processes (what is left on disk when the process
ends is the point); the rest call ``jssl.engines.train.run`` in-process.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from support.launch import REPO, enable_compilation_cache, launch_env
from support.runs import (
    checkpoint_steps,
    load_checkpoint,
    make_config,
    start_launch,
    wait_for_checkpoint,
)

from jssl.engines import train
from jssl.training import preemption

pytestmark = pytest.mark.e2e  # the end-to-end tier (JSSL_E2E_TESTS=1)


@pytest.fixture(scope="module")
def compilation_cache(shared_dirs):
    enable_compilation_cache(shared_dirs[1])


def _entries(workdir) -> list[str]:
    return sorted(os.listdir(os.path.join(workdir, "checkpoints")))


def test_ctrl_c_saves_at_an_agreed_step_and_exits_75(tmp_path, shared_dirs):
    workdir = tmp_path / "interrupted"
    process = start_launch(
        workdir,
        shared_dirs,
        "--config.num_epochs=2",
        "--config.checkpoint.every_steps=2",
        "--config.checkpoint.async_save=False",
    )
    wait_for_checkpoint(process, workdir, 2)
    process.send_signal(signal.SIGINT)
    log, _ = process.communicate(timeout=120)
    assert process.returncode == preemption.PREEMPTED_EXIT_CODE, log[-5000:]
    assert "Ctrl-C (SIGINT) received" in log and "Press Ctrl-C again" in log, log[-5000:]
    match = re.search(
        r"Stopped by Ctrl-C \(SIGINT\) at step (\d+) after saving a checkpoint; "
        r"rerun the same command to resume",
        log,
    )
    assert match, log[-5000:]
    assert "KeyboardInterrupt" not in log and "Traceback" not in log, log[-5000:]
    stopped = int(match.group(1))
    # Every save completed: no orbax-checkpoint-tmp directory is left.
    assert _entries(workdir) == [str(s) for s in checkpoint_steps(workdir)]
    assert checkpoint_steps(workdir)[-1] == stopped
    state, position = load_checkpoint(workdir, stopped)
    assert int(state["step"]) == stopped
    assert (position["epoch"], position["step_in_epoch"]) == divmod(stopped, 4)


def test_a_second_ctrl_c_stops_at_once():
    before = signal.getsignal(signal.SIGINT)
    with preemption.Preemption() as stop_request:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # Python runs the handler between two bytecodes of this thread
        assert stop_request.requested and stop_request.signal_name == "Ctrl-C (SIGINT)"
        with pytest.raises(KeyboardInterrupt, match="Ctrl-C pressed twice"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_non_finite_state_is_never_saved(tmp_path, shared_dirs, compilation_cache):
    # At this learning rate the loss and gradients stay finite for the epoch while the
    # batch-norm running variances overflow; the step's own check does not see them.
    config = make_config(
        shared_dirs, num_epochs=1, **{"optim.base_lr": 1e6, "checkpoint.every_steps": 1}
    )
    with pytest.raises(train.NonFiniteLossError, match=r"non-finite at step (\d+)") as info:
        train.run(config, str(tmp_path))
    message = str(info.value)
    bad_step = int(re.search(r"at step (\d+)", message).group(1))
    saved = checkpoint_steps(tmp_path)
    assert saved and max(saved) < bad_step, (saved, message)
    for step in saved:
        state, _ = load_checkpoint(tmp_path, step)
        for path, leaf in jax.tree_util.tree_leaves_with_path(state):
            assert np.all(np.isfinite(leaf)), f"checkpoint {step}: {jax.tree_util.keystr(path)}"
    # The message names what is non-finite and the checkpoint to go back to.
    assert "batch_stats" in message, message
    assert f"the newest checkpoint, step {max(saved)} in " in message, message


def _image_folder(root, splits=("train",)) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in splits:
        for c in range(4):
            os.makedirs(root / split / f"class{c}")
            for i in range(16):
                pixels = rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / f"class{c}" / f"{i}.png")


@pytest.mark.parametrize(
    "overrides, field",
    [({"test_every_epochs": 1}, "data.test_split"), ({"knn.enabled": True}, "knn.test_split")],
)
def test_a_missing_split_stops_the_run_before_the_first_step(
    tmp_path, shared_dirs, overrides, field
):
    _image_folder(tmp_path / "data")  # train/ only
    config = make_config(shared_dirs, num_epochs=1, **{"data.source": "folder", **overrides})
    config.data.data_dir = str(tmp_path / "data")
    config.knn.train_split = "train"
    off = "test_every_epochs=0" if "test_every_epochs" in overrides else "knn.enabled=False"
    with pytest.raises(ValueError, match=rf"{re.escape(field)}='test' cannot be read") as info:
        train.run(config, str(tmp_path / "run"))
    assert "available: ['train']" in str(info.value) and f"--config.{off}" in str(info.value)
    assert checkpoint_steps(tmp_path / "run") == []


# The test phase fails right after the end-of-epoch checkpoint of step 4 started saving in the
# background; the process then ends. A subprocess, since what matters is what is on disk then.
_FAILING_TEST_PHASE = """
import sys
sys.path.insert(0, {tests!r})
from support.runs import make_config
from jssl.engines import train
from jssl.evaluation import monitor

def failing_test_phase(*args, **kwargs):
    raise RuntimeError("the test phase failed")

monitor.test_phase = failing_test_phase
config = make_config(({data!r}, {cache!r}), num_epochs=1, test_every_epochs=1)
config.checkpoint.async_save = True
train.run(config, {workdir!r})
"""


def test_an_error_in_periodic_work_lets_the_save_in_flight_complete(tmp_path, shared_dirs):
    data_dir, cache_dir = shared_dirs
    workdir = tmp_path / "run"
    script = _FAILING_TEST_PHASE.format(
        tests=os.path.dirname(os.path.dirname(__file__)),
        data=data_dir,
        cache=cache_dir,
        workdir=str(workdir),
    )
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=REPO,
        env=launch_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode != 0
    assert "RuntimeError: the test phase failed" in result.stderr, result.stderr[-5000:]
    assert _entries(workdir) == ["4"]  # not 4.orbax-checkpoint-tmp
    _, position = load_checkpoint(workdir, 4)
    assert position == {"epoch": 1, "step_in_epoch": 0}
