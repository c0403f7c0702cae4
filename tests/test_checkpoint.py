"""Checkpoint recovery, end to end through ``jssl.engines.train.run``: a corrupt newest
checkpoint, every checkpoint corrupt, and a partial save left by a killed process.

One trained workdir (1 epoch of the "test" preset, checkpoints at steps 2 and 4) is made
once and copied into each test, which then damages its copy and reruns the trainer.
"""

import logging
import os
import re
import shutil

import jax
import numpy as np
import pytest
from test_launch import enable_compilation_cache, prepare_shared_dirs
from test_train import checkpoint_steps, load_checkpoint, make_config

from jssl import checkpoint
from jssl.engines import train


@pytest.fixture(scope="session")
def shared_dirs(tmp_path_factory):
    return prepare_shared_dirs(tmp_path_factory)


def _config(shared_dirs, num_epochs: int = 1):
    return make_config(shared_dirs, num_epochs=num_epochs, **{"checkpoint.every_steps": 2})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_dirs):
    enable_compilation_cache(shared_dirs[1])
    workdir = tmp_path_factory.mktemp("trained")
    train.run(_config(shared_dirs), str(workdir))
    assert checkpoint_steps(workdir) == [2, 4]
    return workdir


@pytest.fixture
def workdir(tmp_path, trained):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _corrupt(workdir, step: int) -> str:
    """Truncates every file of the saved TrainState of ``step``; returns the step's path."""
    path = os.path.join(checkpoint.checkpoint_dir(workdir), str(step))
    for root, _, files in os.walk(os.path.join(path, "state")):
        for name in files:
            with open(os.path.join(root, name), "r+b") as f:
                f.truncate(0)
    return path


def _messages(caplog, level=logging.INFO) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= level)


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(workdir, shared_dirs, caplog):
    caplog.set_level(logging.INFO)
    corrupt_path = _corrupt(workdir, 4)
    summary = train.run(_config(shared_dirs), str(workdir))

    errors = _messages(caplog, logging.ERROR)
    assert f"Could not restore the checkpoint at {corrupt_path}" in errors, errors
    assert "Resumed from step 2 (epoch 0, batch 2)" in _messages(caplog)
    assert summary["step"] == 4
    # The corrupt step was moved aside and the retrained step 4 saved in its place.
    moved = [d for d in os.listdir(os.path.dirname(corrupt_path)) if d.startswith("4.")]
    assert len(moved) == 1 and moved[0].startswith("4.unreadable"), moved
    state, position = load_checkpoint(workdir, 4)
    assert position == {"epoch": 1, "step_in_epoch": 0}
    np.testing.assert_array_equal(
        state["params"]["head"]["fc1"]["kernel"],
        jax.device_get(summary["state"].params["head"]["fc1"]["kernel"]),
    )


def test_every_checkpoint_corrupt_raises(workdir, shared_dirs):
    _corrupt(workdir, 2)
    _corrupt(workdir, 4)
    directory = checkpoint.checkpoint_dir(workdir)
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(directory)) as info:
        train.run(_config(shared_dirs), str(workdir))
    message = str(info.value)
    assert os.path.join(directory, "2") in message and os.path.join(directory, "4") in message


def test_partial_save_of_a_killed_process_is_ignored(workdir, shared_dirs, caplog):
    caplog.set_level(logging.INFO)
    directory = checkpoint.checkpoint_dir(workdir)
    # What a process killed while saving leaves: orbax's temporary directories, never renamed
    # to their step (this orbax names them "<step>.orbax-checkpoint-tmp", others add a suffix).
    for name in ("6.orbax-checkpoint-tmp", "10.orbax-checkpoint-tmp-1234567890"):
        partial = os.path.join(directory, name)
        shutil.copytree(os.path.join(directory, "4"), partial)
        os.remove(os.path.join(partial, "commit_success.txt"))
        for root, _, files in os.walk(os.path.join(partial, "state")):
            for file in files:
                os.truncate(os.path.join(root, file), 0)

    summary = train.run(_config(shared_dirs, num_epochs=2), str(workdir))
    assert "Resumed from step 4 (epoch 1, batch 0)" in _messages(caplog)
    assert not _messages(caplog, logging.ERROR)
    assert summary["step"] == 8
    assert {6, 8} <= set(checkpoint_steps(workdir))
    state, _ = load_checkpoint(workdir, 6)
    assert int(state["step"]) == 6
