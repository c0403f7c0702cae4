"""The multi-process training loop, end to end: two local ``launch.py`` processes over the gloo
CPU collectives train, checkpoint, get SIGTERM (one process first), stop together at the
same step, resume, and end with the parameters of an uninterrupted single-process run of the
same global batch (1 process x 2 devices against 2 processes x 1 device), on tf.data and on
grain.

The recipe is MoCo v2's own head at T 0.1 (as tests/step_parity.py): the demo's BN projector
amplifies float rounding, which would hide a real difference behind a loose tolerance.
"""

import os
import re
import signal
import socket
import subprocess
import time

import pytest
from support.launch import REPO, launch_args, launch_env, prepare_shared_dirs
from support.runs import assert_states_close, checkpoint_steps, load_checkpoint

from jssl.training.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.e2e  # the end-to-end tier (JSSL_E2E_TESTS=1)

EPOCHS, STEPS_PER_EPOCH = 3, 4
TOTAL = EPOCHS * STEPS_PER_EPOCH
OVERRIDES = (
    f"--config.num_epochs={EPOCHS}",
    "--config.model.head_bn=False",
    "--config.model.head_last_bn=False",
    "--config.method.temperature=0.1",
    "--config.optim.base_lr=0.06",
    "--config.checkpoint.every_steps=2",
    "--config.checkpoint.async_save=False",
    "--config.checkpoint.max_to_keep=0",
)


@pytest.fixture(scope="module")
def shared_dirs(tmp_path_factory):
    return prepare_shared_dirs(tmp_path_factory)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(cache_dir: str, devices: int) -> dict:
    env = launch_env(cache_dir)
    env["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    )
    return env


def _start_pair(workdir, shared_dirs, loader: str) -> list[subprocess.Popen]:
    data_dir, cache_dir = shared_dirs
    port = _free_port()
    return [
        subprocess.Popen(
            launch_args(workdir, data_dir, *OVERRIDES, f"--config.data.loader={loader}")
            + [f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}"],
            cwd=REPO,
            env=_env(cache_dir, 1),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]


def _finish(processes, timeout=240) -> list[str]:
    logs = []
    for p in processes:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in processes:
                q.kill()
            pytest.fail("a process of the pair hung (collectives out of step?)")
    return logs


# grain: each process's worker process makes its rows; a stop must close them, and the resumed
# pair must read on from the same batch.
@pytest.mark.parametrize("loader", ["tf", "grain"])
def test_two_processes_preempted_and_resumed_match_one_process(tmp_path, shared_dirs, loader):
    data_dir, cache_dir = shared_dirs
    reference = tmp_path / "reference"
    result = subprocess.run(
        launch_args(reference, data_dir, *OVERRIDES, f"--config.data.loader={loader}"),
        cwd=REPO,
        env=_env(cache_dir, 2),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    expected = load_checkpoint(reference, TOTAL)[0]

    workdir = tmp_path / "pair"
    processes = _start_pair(workdir, shared_dirs, loader)
    first = os.path.join(workdir, "checkpoints", "2")
    deadline = time.monotonic() + 240
    while not os.path.isdir(first):
        if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
            logs = _finish([p for p in processes if p.poll() is not None] or processes, 5)
            pytest.fail("no checkpoint of step 2:\n" + "\n".join(log[-3000:] for log in logs))
        time.sleep(0.01)
    # The scheduler's signal reaches the hosts at different moments.
    processes[1].send_signal(signal.SIGTERM)
    time.sleep(0.3)
    if processes[0].poll() is None:
        processes[0].send_signal(signal.SIGTERM)
    logs = _finish(processes)
    for p, log in zip(processes, logs, strict=True):
        assert p.returncode == PREEMPTED_EXIT_CODE, log[-5000:]
    stopped = [int(re.search(r"Stopped by SIGTERM at step (\d+)", log).group(1)) for log in logs]
    assert stopped[0] == stopped[1] and 2 <= stopped[0] < TOTAL, stopped
    assert checkpoint_steps(workdir)[-1] == stopped[0]

    logs = _finish(_start_pair(workdir, shared_dirs, loader))
    assert all(f"Resumed from step {stopped[0]} " in log for log in logs), logs[0][-5000:]
    assert_states_close(load_checkpoint(workdir, TOTAL)[0], expected)
