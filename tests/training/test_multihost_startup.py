"""A multi-process run that cannot start stops promptly, saying why: one process's failure
stops every process with a line naming it and its error (jssl.process.stop_together), and a
process that never connects stops the others after --initialization_timeout, naming what they
waited for (jssl.parallel.initialize). Without them, both cases hung for jax's 300 s and then
aborted with a C++ stack dump saying only "another task died"."""

import subprocess
import sys
import time

import pytest
from support.launch import REPO, free_port, launch_args, launch_env, prepare_shared_dirs

pytestmark = pytest.mark.e2e  # the end-to-end tier (JSSL_E2E_TESTS=1)

# Far below jax's 300 s; the processes start (imports, demo data) well within it.
STARTED_WITHIN_S = 150


@pytest.fixture(scope="module")
def shared_dirs(tmp_path_factory):
    return prepare_shared_dirs(tmp_path_factory)


def _start(args_of_each: list[list[str]], logs, env=None) -> list[subprocess.Popen]:
    processes = []
    for args, log in zip(args_of_each, logs, strict=True):
        with open(log, "w") as out:
            processes.append(
                subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
            )
    return processes


def _exit_times(processes, timeout_s: float) -> list[float]:
    """When each process exited (monotonic seconds); fails the test, killing them, when one
    is still running after ``timeout_s``."""
    deadline, ended = time.monotonic() + timeout_s, [None] * len(processes)
    while None in ended:
        for i, p in enumerate(processes):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic()
        if time.monotonic() > deadline:
            for p in processes:
                p.kill()
            pytest.fail(f"still running after {timeout_s} s: processes {ended}")
        time.sleep(0.05)
    return ended


def _multihost(port: int, process_id: int, *more: str) -> list[str]:
    return [
        f"--coordinator_address=localhost:{port}",
        "--num_processes=2",
        f"--process_id={process_id}",
        *more,
    ]


def test_a_process_failing_at_start_up_stops_both_naming_it(tmp_path, shared_dirs):
    data_dir, cache_dir = shared_dirs
    port, workdir = free_port(), tmp_path / "run"
    # Process 1 reads an image folder that does not exist.
    missing = ("--config.data.source=folder", f"--config.data.data_dir={tmp_path / 'missing'}")
    args = [
        launch_args(workdir, data_dir, *_multihost(port, 0)),
        launch_args(workdir, data_dir, *missing, *_multihost(port, 1)),
    ]
    logs = [tmp_path / "log0", tmp_path / "log1"]
    processes = _start(args, logs, env=launch_env(cache_dir))
    ended = _exit_times(processes, STARTED_WITHIN_S)
    out = [log.read_text() for log in logs]
    assert [p.returncode for p in processes] == [1, 1], out[0][-3000:] + out[1][-3000:]
    assert "Process 1 of 2 failed: FileNotFoundError: Image folder" in out[0], out[0][-3000:]
    assert "Process 0 stops too" in out[0]
    assert "Process 1 of 2 failed: FileNotFoundError" in out[1], out[1][-3000:]
    # Process 0 waited in a collective for process 1: it stops within seconds of it.
    assert ended[0] - ended[1] < 20


def test_a_process_that_never_connects_names_it_and_the_timeout_flag(tmp_path, shared_dirs):
    data_dir, cache_dir = shared_dirs
    port = free_port()
    args = launch_args(
        tmp_path / "run", data_dir, *_multihost(port, 0, "--initialization_timeout=2")
    )
    (process,) = _start([args], [tmp_path / "log0"], env=launch_env(cache_dir))
    _exit_times([process], STARTED_WITHIN_S)
    out = (tmp_path / "log0").read_text()
    assert process.returncode == 1, out[-3000:]
    assert "Process 0 waited 2 s (--initialization_timeout) for all 2 processes" in out, out
    assert f"coordinator at localhost:{port}, and process 1 did not" in out
    assert "raise --initialization_timeout" in out and "Check failure" not in out


# A process of a two-process run: connects (with a 2 s deadline), gathers once, then process
# ``argv[3]`` fails while the other waits in a second gather.
_CHILD = """
import sys
import numpy as np
from jax.experimental import multihost_utils
from jssl import parallel, process
port, me, failing = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
parallel.initialize(f"localhost:{port}", 2, me, initialization_timeout=2)
with process.stop_together(poll_s=0.2):
    multihost_utils.process_allgather(np.int32(me))
    if me == failing:
        raise RuntimeError("disk full")
    multihost_utils.process_allgather(np.int32(me))
"""


def _child(port: int, me: int, failing: int) -> list[str]:
    return [sys.executable, "-c", _CHILD, str(port), str(me), str(failing)]


def test_the_coordinators_failure_in_a_run_stops_the_other_process(tmp_path):
    port = free_port()
    logs = [tmp_path / "log0", tmp_path / "log1"]
    processes = _start([_child(port, 0, 0), _child(port, 1, 0)], logs)
    _exit_times(processes, 60)
    out = [log.read_text() for log in logs]
    assert [p.returncode for p in processes] == [1, 1], out
    assert "Process 0 of 2 failed: RuntimeError: disk full. Process 1 stops too" in out[1], out[1]
    assert "RuntimeError: disk full" in out[0], out[0]


def test_a_process_with_no_coordinator_says_nothing_answers(tmp_path):
    port = free_port()
    (process,) = _start([_child(port, 1, -1)], [tmp_path / "log1"])
    _exit_times([process], 60)
    out = (tmp_path / "log1").read_text()
    assert process.returncode == 1, out
    assert f"Nothing answers at localhost:{port}: process 0, which runs the coordinator" in out
