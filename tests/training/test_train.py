"""End-to-end tests of the train engine: kill/resume parity, SIGTERM, non-finite losses, the
schedule of its periodic work, the test phase and max_steps, on the "test" preset of
configs/moco.py (16 px, tiny ResNet-18, 64 examples, 4 steps per epoch). Ctrl-C and other
failures: test_run_safety.py.

Kill and SIGTERM tests use real ``launch.py`` processes; the rest call
``jssl.engines.train.run`` in-process.
"""

import os
import re
import shutil
import signal

import jax
import numpy as np
import pytest
from support.launch import enable_compilation_cache, read_events, run_launch, scalar_values
from support.runs import (
    assert_states_close,
    checkpoint_steps,
    load_checkpoint,
    make_config,
    start_launch,
    wait_for_checkpoint,
)

from jssl.engines import train
from jssl.training.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.e2e  # the end-to-end tier (JSSL_E2E_TESTS=1)

# 2 epochs of 4 steps; a synchronous checkpoint every 2 steps, so steps 2 and 6 are
# mid-epoch ones (4 and 8 end an epoch).
RESUME_OVERRIDES = (
    "--config.num_epochs=2",
    "--config.checkpoint.every_steps=2",
    "--config.checkpoint.async_save=False",
    "--config.checkpoint.max_to_keep=10",
)
TOTAL_STEPS = 8


@pytest.fixture(scope="module")
def compilation_cache(shared_dirs):
    enable_compilation_cache(shared_dirs[1])


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


def test_sigterm_saves_exits_preempted_and_resumes(tmp_path, shared_dirs, reference_run):
    workdir = tmp_path / "preempted"
    process = start_launch(workdir, shared_dirs, *RESUME_OVERRIDES)
    wait_for_checkpoint(process, workdir, 2)
    process.send_signal(signal.SIGTERM)
    log, _ = process.communicate(timeout=120)
    # Not 0: a scheduler must not read a preempted run as finished.
    assert process.returncode == PREEMPTED_EXIT_CODE, log[-5000:]
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
    # The loss terms, averaged over the split and written per example: MoCo's one term at
    # weight 1 is the loss.
    term = scalar_values(tmp_path / "tensorboard", "test/loss/info_nce")[4]
    np.testing.assert_allclose(term, test_loss, rtol=1e-5)
    outputs = tmp_path / "eval" / "epoch_1"
    np.testing.assert_allclose(
        np.load(outputs / "term_info_nce.npy"), np.load(outputs / "per_example_loss.npy"), rtol=1e-6
    )


def test_logs_saves_and_tests_on_schedule(tmp_path, shared_dirs, compilation_cache):
    # 3 epochs of 4 steps; metrics and checkpoints every 3 steps, a test phase every 2 epochs.
    config = make_config(
        shared_dirs,
        num_epochs=3,
        log_every_steps=3,
        test_every_epochs=2,
        eval_outputs=False,
        **{
            "checkpoint.every_steps": 3,
            "checkpoint.max_to_keep": 0,
            "data.test_split": "test[:32]",
        },
    )
    assert train.run(config, str(tmp_path))["step"] == 12
    # Every 3 steps, and at the end of every epoch.
    assert checkpoint_steps(tmp_path) == [3, 4, 6, 8, 9, 12]
    for step in (3, 4, 9):
        assert load_checkpoint(tmp_path, step)[1] == {
            "epoch": step // 4,
            "step_in_epoch": step % 4,
        }
    logdir = tmp_path / "tensorboard"
    assert sorted(scalar_values(logdir, "loss")) == [3, 6, 9, 12]
    assert sorted(scalar_values(logdir, "steps_per_sec")) == [3, 6, 9, 12]
    assert sorted(scalar_values(logdir, "test/loss")) == [8]


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


def test_init_checkpoint_starts_training_from_weights_and_resume_wins(
    tmp_path, shared_dirs, compilation_cache, caplog
):
    source = tmp_path / "source"
    trained = train.run(make_config(shared_dirs, **{"debug.max_steps": 2}), str(source))
    # Another seed: a fresh init would be as far from the source as two random inits are.
    config = make_config(
        shared_dirs, seed=1, **{"init.checkpoint": str(source), "debug.max_steps": 1}
    )
    workdir = tmp_path / "warm"
    with caplog.at_level("INFO"):
        warm = train.run(config, str(workdir))
    assert "init.checkpoint" in caplog.text and "loaded" in caplog.text
    # One step away from the source's weights (random inits differ by ~1.4 in this measure).
    source_kernel = np.asarray(trained["state"].params["trunk"]["conv1"]["kernel"])
    warm_kernel = np.asarray(warm["state"].params["trunk"]["conv1"]["kernel"])
    distance = np.linalg.norm(warm_kernel - source_kernel) / np.linalg.norm(source_kernel)
    assert distance < 0.2, distance
    # A rerun resumes the workdir's own checkpoint, even with init.checkpoint still set.
    config.debug.max_steps = 2
    caplog.clear()
    with caplog.at_level("INFO"):
        assert train.run(config, str(workdir))["step"] == 2
    assert "Resumed from step 1" in caplog.text


def test_skip_corrupt_counts_replaced_examples_per_epoch(tmp_path, shared_dirs, compilation_cache):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(4):
        os.makedirs(tmp_path / "data" / "train" / f"class{c}")
        for i in range(16):
            pixels = rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "data" / "train" / f"class{c}" / f"{i}.png")
    for name in ("class1/3.png", "class2/7.png"):
        (tmp_path / "data" / "train" / name).write_bytes(b"not a png")
    config = make_config(
        shared_dirs,
        num_epochs=1,
        **{"data.source": "folder", "data.skip_corrupt": True, "data.cache": False},
    )
    config.data.data_dir = str(tmp_path / "data")
    assert train.run(config, str(tmp_path / "run"))["step"] == 4
    skipped = scalar_values(tmp_path / "run" / "tensorboard", "data/skipped_examples")
    assert skipped == {4: 2.0}
