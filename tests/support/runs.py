"""Helpers of the train-engine tests: configs of the "test" preset, reading checkpoints back,
comparing states, and ``launch.py`` processes that are killed mid-run."""

import json
import os
import subprocess
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import moco
from jssl.checkpoints import manager as checkpoint
from support.launch import REPO, launch_args, launch_env


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


def tiny_trained_workdir(tmp_path_factory) -> str:
    """The workdir of a one-epoch run of the tiny MoCo preset on 32 demo examples (a
    checkpoint for the evaluation tests to read)."""
    from jssl import engines
    from support.launch import prepare_shared_dirs

    config = moco.get_config("test")
    config.data.data_dir = prepare_shared_dirs(tmp_path_factory)[0]
    config.num_epochs, config.data.train_subset = 1, 32
    config.checkpoint.async_save = False
    workdir = str(tmp_path_factory.mktemp("trained"))
    engines.run(config, workdir)
    return workdir


def checkpoint_steps(workdir) -> list[int]:
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        return []
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def load_checkpoint(workdir, step: int | None = None) -> tuple[dict, dict]:
    """(state as a dict of arrays, data position) of a checkpoint, onto this process's first
    device whatever topology wrote it (tests compare runs saved on 1 and on 2 devices)."""
    step = checkpoint_steps(workdir)[-1] if step is None else step
    step_dir = os.path.join(checkpoint.checkpoint_dir(workdir), str(step))
    checkpointer = ocp.StandardCheckpointer()
    metadata = checkpointer.metadata(os.path.join(step_dir, "state")).item_metadata
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata
    )
    state = checkpointer.restore(os.path.join(step_dir, "state"), target)
    checkpointer.close()
    with open(os.path.join(step_dir, "data", "metadata")) as f:
        position = json.load(f)
    return jax.device_get(state), position


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
