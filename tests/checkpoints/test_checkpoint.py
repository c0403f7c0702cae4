"""Checkpoints: recovery end to end through ``jssl.engines.train.run`` (a newest checkpoint
truncated or overwritten with random bytes, every checkpoint corrupt, a partial save left by a
killed process; tests/checkpoints/test_corruption.py has more damages), then
``checkpoints.manager`` on its own with a tiny state: ``max_to_keep``, saves that fail (promptly,
without orbax's 5-minute hang at exit), and which restore failures may fall back.

One trained workdir (1 epoch of the "test" preset, checkpoints at steps 2 and 4) is made
once and copied into each end-to-end test, which then damages its copy and reruns the trainer.
"""

import errno
import glob
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from support.launch import enable_compilation_cache, prepare_shared_dirs
from support.runs import checkpoint_steps, load_checkpoint, make_config

from jssl.checkpoints import manager as checkpoint
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


def test_random_bytes_in_the_newest_checkpoint_fall_back_on_rerun(workdir, shared_dirs, caplog):
    # What a user met: the largest chunk file overwritten with as many random bytes. orbax
    # reports a zstd FAILED_PRECONDITION, which names no damage; reading the files back does.
    step_dir = os.path.join(checkpoint.checkpoint_dir(workdir), "4")
    chunks = glob.glob(os.path.join(step_dir, "state", "ocdbt.process_0", "d", "*"))
    largest = max(chunks, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.write(os.urandom(os.path.getsize(largest)))
    caplog.set_level(logging.INFO)
    summary = train.run(_config(shared_dirs), str(workdir))
    assert "Resumed from step 2 (epoch 0, batch 2)" in _messages(caplog)
    assert summary["step"] == 4 and checkpoint_steps(workdir) == [2, 4]
    moved = [d for d in os.listdir(os.path.dirname(step_dir)) if d.startswith("4.")]
    assert len(moved) == 1 and moved[0].startswith("4.unreadable"), moved


def test_every_checkpoint_corrupt_raises(workdir, shared_dirs):
    _corrupt(workdir, 2)
    _corrupt(workdir, 4)
    directory = checkpoint.checkpoint_dir(workdir)
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(directory)) as info:
        train.run(_config(shared_dirs), str(workdir))
    message = str(info.value)
    assert os.path.join(directory, "2") in message and os.path.join(directory, "4") in message


@pytest.mark.e2e
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


# --- checkpoints.manager on its own, with a tiny state -----------------------------------------


@flax.struct.dataclass
class _State:
    step: jax.Array
    w: jax.Array


def _state(step: int, shape=(4, 4)) -> _State:
    return _State(step=jnp.asarray(step, jnp.int32), w=jnp.full(shape, float(step)))


def _checkpoint_config(**overrides) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict(
        {"every_steps": 0, "max_to_keep": 3, "async_save": False, "allow_config_change": False}
    )
    config.update(overrides)
    return config


def _save_steps(manager, *steps: int) -> None:
    for step in steps:
        assert checkpoint.save(manager, _state(step), checkpoint.DataPosition(0, step))
    checkpoint.finish(manager)


def _entries(workdir) -> list[str]:
    return sorted(os.listdir(checkpoint.checkpoint_dir(workdir)))


@pytest.mark.parametrize("value", [-1, -3])
def test_check_config_refuses_a_negative_max_to_keep(value):
    with pytest.raises(ValueError, match=r"checkpoint\.max_to_keep=.*0 to keep all"):
        checkpoint.check_config(_checkpoint_config(max_to_keep=value))
    checkpoint.check_config(_checkpoint_config(max_to_keep=0))


def test_max_to_keep_zero_keeps_every_checkpoint_of_every_run(tmp_path):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=0, async_save=False)
    _save_steps(manager, 1, 2, 3)
    manager.close()
    # A resumed run with the same setting deletes none of the earlier run's checkpoints.
    manager, state, position, resumed = checkpoint.resume(
        str(tmp_path), _checkpoint_config(max_to_keep=0), _state(0)
    )
    assert resumed and int(state.step) == 3 and position == checkpoint.DataPosition(0, 3)
    _save_steps(manager, 4, 5)
    assert manager.all_steps() == [1, 2, 3, 4, 5]
    assert checkpoint.saved_steps(str(tmp_path)) == [1, 2, 3, 4, 5]
    manager.close()
    # A positive value still keeps only the newest ones.
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=2, async_save=False)
    _save_steps(manager, 6)
    assert manager.all_steps() == [5, 6]


def test_resume_refuses_an_unwritable_checkpoint_dir(tmp_path):
    # A file where the directory should be fails for root too (permission bits do not).
    directory = checkpoint.checkpoint_dir(tmp_path)
    open(directory, "w").close()
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(directory)) as info:
        checkpoint.resume(str(tmp_path), _checkpoint_config(), _state(0))
    assert "Errno 20 ENOTDIR" in str(info.value)


def test_a_full_disk_is_reported_before_saving(tmp_path, monkeypatch):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=3, async_save=True)
    _save_steps(manager, 1)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(checkpoint.CheckpointError, match=r"ENOSPC.*No space left") as info:
        checkpoint.save(manager, _state(2), checkpoint.DataPosition())
    assert checkpoint.checkpoint_dir(tmp_path) in str(info.value)
    monkeypatch.undo()
    assert manager.all_steps() == [1]
    assert _entries(tmp_path) == ["1"]  # the probe file is gone too


# A subprocess, because the failure this guards against is a hang at interpreter exit:
# orbax threads that wait 300 s for the signal of a step directory that was never created.
_FAILED_SAVE = """
import os, shutil, sys, time
import jax, jax.numpy as jnp
sys.path[:0] = [{tests!r}, os.path.dirname({tests!r})]
from test_checkpoint import _state
from jssl.checkpoints import manager as checkpoint

check_writable = checkpoint.check_writable
for async_save, bypass_probe in [(a, b) for a in (True, False) for b in (False, True)]:
    workdir = os.path.join({tmp!r}, f"async{{int(async_save)}}-bypass{{int(bypass_probe)}}")
    manager = checkpoint.make_manager(workdir, max_to_keep=3, async_save=async_save)
    checkpoint.save(manager, _state(1), checkpoint.DataPosition())
    checkpoint.finish(manager)
    directory = checkpoint.checkpoint_dir(workdir)
    shutil.rmtree(directory)
    open(directory, "w").close()  # every write below it now fails, for root as well
    # With the probe bypassed, orbax's own failure must surface at once too.
    checkpoint.check_writable = (lambda d: None) if bypass_probe else check_writable
    start = time.perf_counter()
    try:
        checkpoint.save(manager, _state(2), checkpoint.DataPosition())
        checkpoint.finish(manager)
    except checkpoint.CheckpointError as e:
        print(f"RAISED after {{time.perf_counter() - start:.1f}} s: {{e}}", flush=True)
    else:
        print("NOT RAISED", flush=True)
"""


@pytest.mark.e2e
def test_a_failed_save_raises_at_once_and_the_process_exits(tmp_path):
    script = _FAILED_SAVE.format(tests=os.path.dirname(__file__), tmp=str(tmp_path))
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    raised = [line for line in result.stdout.splitlines() if line.startswith("RAISED")]
    assert len(raised) == 4, result.stdout + result.stderr[-3000:]
    runs = [f"async{a}-bypass{b}" for a in (1, 0) for b in (0, 1)]
    for run, line in zip(runs, raised, strict=True):
        directory = os.path.join(str(tmp_path), run, "checkpoints")
        assert directory in line and "Errno 20" in line and "Not a directory" in line, line
        assert float(line.split()[2]) < 5, line
    # The whole process, start-up included, is far from orbax's 300 s barrier timeout.
    assert elapsed < 60, (elapsed, result.stderr[-3000:])


def test_a_background_save_failure_surfaces_at_the_next_check(tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import atomicity

    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=3, async_save=True)
    _save_steps(manager, 1)

    async def fail(self, *args, **kwargs):  # the rename that commits the step, in background
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.get()))

    for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
        monkeypatch.setattr(cls, "finalize", fail)
    assert checkpoint.save(manager, _state(2), checkpoint.DataPosition())
    deadline = time.time() + 30
    with pytest.raises(checkpoint.CheckpointError, match="ENOSPC") as info:
        while time.time() < deadline:  # what a trainer does between steps
            checkpoint.check_for_errors(manager)
            time.sleep(0.05)
    assert checkpoint.checkpoint_dir(tmp_path) in str(info.value)
    assert "No space left on device" in str(info.value)
    monkeypatch.undo()
    # Raised once; the next save goes through (orbax does not raise the same error again).
    assert checkpoint.save(manager, _state(3), checkpoint.DataPosition())
    checkpoint.finish(manager)
    assert manager.all_steps() == [1, 3]


def _truncate_state(directory: str, step: int) -> None:
    for root, _, files in os.walk(os.path.join(directory, str(step), "state")):
        for name in files:
            os.truncate(os.path.join(root, name), 0)


def test_restore_falls_back_past_a_truncated_checkpoint_and_moves_it_aside(tmp_path, caplog):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=3, async_save=False)
    _save_steps(manager, 1, 2)
    directory = checkpoint.checkpoint_dir(tmp_path)
    _truncate_state(directory, 2)
    caplog.set_level(logging.INFO)
    state, position = checkpoint.restore_or_none(manager, _state(0))
    assert int(state.step) == 1 and position == checkpoint.DataPosition(0, 1)
    moved = [e for e in _entries(tmp_path) if e.startswith("2.unreadable-")]
    assert checkpoint.saved_steps(str(tmp_path)) == [1]
    assert _entries(tmp_path) == ["1", *moved] and len(moved) == 1
    errors = _messages(caplog, logging.ERROR)
    assert "incomplete or corrupt" in errors
    assert f"{os.path.join(directory, '2')} -> {os.path.join(directory, moved[0])}" in errors
    assert manager.all_steps() == [1]


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.EIO, os.strerror(errno.EIO)),
        PermissionError(errno.EACCES, os.strerror(errno.EACCES)),
    ],
)
def test_restore_does_not_fall_back_on_a_storage_error(tmp_path, monkeypatch, error):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=3, async_save=False)
    _save_steps(manager, 1, 2)
    before = _entries(tmp_path)
    restore = manager.restore

    def flaky(step, *args, **kwargs):
        if step == 2:
            raise ValueError("reading failed") from error  # as orbax wraps some causes
        return restore(step, *args, **kwargs)

    monkeypatch.setattr(manager, "restore", flaky)
    with pytest.raises(checkpoint.CheckpointError, match="not touched") as info:
        checkpoint.restore_or_none(manager, _state(0))
    assert os.path.join(checkpoint.checkpoint_dir(tmp_path), "2") in str(info.value)
    assert f"Errno {error.errno}" in str(info.value) and "retry" in str(info.value)
    assert _entries(tmp_path) == before


@pytest.mark.parametrize("target", [_state(0, shape=(4, 5)), {"step": 0, "v": jnp.zeros(3)}])
def test_restore_under_a_changed_model_says_so_and_moves_nothing(tmp_path, target):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=3, async_save=False)
    _save_steps(manager, 1, 2)
    before = _entries(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="config differs") as info:
        checkpoint.restore_or_none(manager, target)
    manager.close()
    assert "Nothing was moved" in str(info.value)
    assert _entries(tmp_path) == before


def test_resume_closes_its_manager_when_the_restore_fails(tmp_path, monkeypatch):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=3, async_save=False)
    _save_steps(manager, 1)
    manager.close()
    closed = []
    close = type(manager).close
    monkeypatch.setattr(type(manager), "close", lambda self: closed.append(self) or close(self))
    with pytest.raises(checkpoint.CheckpointError, match="config differs"):
        checkpoint.resume(str(tmp_path), _checkpoint_config(), _state(0, shape=(4, 5)))
    assert len(closed) == 1  # no orbax threads left behind the error


def test_orbax_info_records_are_dropped_from_the_run_log_but_not_warnings():
    from absl import logging as absl_logging

    from jssl import engines

    handler = absl_logging.get_absl_handler()
    before = list(handler.filters)
    engines.quiet_orbax_info_logs()
    try:

        def record(path, level):
            return logging.LogRecord("absl", level, path, 1, "message", None, None)

        orbax_file = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "x.py")
        assert not handler.filter(record(orbax_file, logging.INFO))
        assert handler.filter(record(orbax_file, logging.WARNING))
        assert handler.filter(record(os.path.join(os.sep, "jssl", "train.py"), logging.INFO))
        absl_logging.set_verbosity(absl_logging.DEBUG)  # --verbosity=1 shows everything
        assert handler.filter(record(orbax_file, logging.INFO))
    finally:
        absl_logging.set_verbosity(absl_logging.INFO)
        handler.filters[:] = before
