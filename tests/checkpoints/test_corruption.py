"""A damaged newest checkpoint is renamed aside and the one before it is used, whatever the
damage: jssl.checkpoints.integrity decides by reading the files back, not by the error's
text. A read that fails for a storage reason stops the resume and touches nothing.

The damages are those a user met (random bytes over the largest chunk file, a deleted
``_METADATA``, a deleted ``ocdbt.process_0`` directory) and two more (a truncated chunk file,
a missing data-position file). They hit a small state of random arrays saved through
``checkpoints.manager``: enough arrays for orbax to lay its OCDBT files out as it does for a
TrainState. tests/checkpoints/test_checkpoint.py reruns the train engine on such a workdir.
Last, how read errors are told apart by their text (``storage_error``, ``is_corrupt``).
"""

import errno
import glob
import json
import logging
import os
import shutil

import flax
import jax
import jax.numpy as jnp
import ml_collections
import pytest

from jssl.checkpoints import integrity
from jssl.checkpoints import manager as checkpoint

# orbax's abandoned reads of a damaged checkpoint must not reach the user as tracebacks
# (they would show here as unraisable-exception warnings).
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


@flax.struct.dataclass
class _State:
    step: jax.Array
    params: dict


def _state(step: int) -> _State:
    # Random values: constant ones compress to a few bytes that orbax keeps elsewhere.
    keys = jax.random.split(jax.random.PRNGKey(step), 8)
    params = {f"w{i}": jax.random.normal(key, (64, 64)) for i, key in enumerate(keys)}
    return _State(step=jnp.asarray(step, jnp.int32), params=params)


def _config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        {"every_steps": 0, "max_to_keep": 3, "async_save": False, "allow_config_change": False}
    )


@pytest.fixture
def saved(tmp_path):
    """A workdir with the checkpoints of steps 1 and 2; returns (workdir, step 2's path)."""
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=3, async_save=False)
    for step in (1, 2):
        assert checkpoint.save(manager, _state(step), checkpoint.DataPosition(0, step))
    checkpoint.finish(manager)
    manager.close()
    return tmp_path, os.path.join(checkpoint.checkpoint_dir(tmp_path), "2")


def _largest_chunk(step_dir: str) -> str:
    chunks = glob.glob(os.path.join(step_dir, "state", "ocdbt.process_0", "d", "*"))
    return max(chunks, key=os.path.getsize)


def _random_bytes(step_dir: str) -> None:
    path = _largest_chunk(step_dir)
    with open(path, "r+b") as f:
        f.write(os.urandom(os.path.getsize(path)))


def _truncate(step_dir: str) -> None:
    path = _largest_chunk(step_dir)
    os.truncate(path, os.path.getsize(path) // 2)


DAMAGES = {
    "random_bytes_over_the_largest_chunk": _random_bytes,
    "no_state_metadata": lambda d: os.remove(os.path.join(d, "state", "_METADATA")),
    "no_ocdbt_dir": lambda d: shutil.rmtree(os.path.join(d, "state", "ocdbt.process_0")),
    "truncated_chunk": _truncate,
    "no_data_position": lambda d: os.remove(os.path.join(d, "data", "metadata")),
}


def _entries(workdir) -> list[str]:
    return sorted(os.listdir(checkpoint.checkpoint_dir(workdir)))


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_previous_one_used(
    saved, damage, caplog
):
    workdir, newest = saved
    DAMAGES[damage](newest)
    caplog.set_level(logging.INFO)
    manager, state, position, resumed = checkpoint.resume(str(workdir), _config(), _state(0))
    assert resumed and int(state.step) == 1 and position == checkpoint.DataPosition(0, 1)
    moved = [e for e in _entries(workdir) if e.startswith("2.unreadable-")]
    assert _entries(workdir) == ["1", *moved] and len(moved) == 1
    errors = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    assert f"Could not restore the checkpoint at {newest}: it is incomplete or corrupt" in errors
    # The step is trained and saved again in its place.
    assert checkpoint.save(manager, _state(2), checkpoint.DataPosition(0, 2))
    checkpoint.finish(manager)
    assert manager.all_steps() == [1, 2]
    manager.close()


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.EIO, os.strerror(errno.EIO)),
        # How tensorstore reports an EIO: FAILED_PRECONDITION, like a corrupt zstd frame.
        ValueError('FAILED_PRECONDITION: Error reading "w0": [OS error: Input/output error]'),
    ],
)
def test_a_storage_error_while_reading_back_touches_nothing(saved, monkeypatch, error):
    workdir, newest = saved
    _random_bytes(newest)  # the restore fails with a zstd error: the files are read back
    before = _entries(workdir)

    def failing_read(directory):
        raise error

    monkeypatch.setattr(integrity, "_read_pytree", failing_read)
    with pytest.raises(checkpoint.CheckpointError, match="not touched") as info:
        checkpoint.resume(str(workdir), _config(), _state(0))
    assert newest in str(info.value) and "retry" in str(info.value)
    assert _entries(workdir) == before


def test_a_whole_checkpoint_that_fails_to_restore_is_not_moved(saved, monkeypatch):
    workdir, newest = saved
    before = _entries(workdir)
    restore = checkpoint.ocp.CheckpointManager.restore

    def flaky(self, step, *args, **kwargs):
        if step == 2:
            raise RuntimeError("an error that says nothing about the files")
        return restore(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "restore", flaky)
    with pytest.raises(checkpoint.CheckpointError, match="read back whole") as info:
        checkpoint.resume(str(workdir), _config(), _state(0))
    assert newest in str(info.value) and "not touched" in str(info.value)
    assert _entries(workdir) == before


def test_find_damage_reads_a_whole_checkpoint_back_and_names_the_damage(saved):
    _, newest = saved
    items = {"pytrees": ("state",), "jsons": ("data",)}
    assert integrity.find_damage(newest, **items) == ""
    _random_bytes(newest)
    assert "ZSTD" in integrity.find_damage(newest, **items)


def test_storage_errors_are_the_ones_a_retry_can_fix():
    def chained(error, cause):
        error.__cause__ = cause
        return error

    assert integrity.storage_error(OSError(errno.EIO, "Input/output error"))
    assert integrity.storage_error(chained(ValueError("x"), PermissionError(errno.EACCES, "")))
    assert integrity.storage_error(ValueError("UNAVAILABLE: try again"))
    assert integrity.storage_error(ValueError("PERMISSION_DENIED: Error opening file"))
    assert integrity.storage_error(
        ValueError("FAILED_PRECONDITION: x [OS error: Stale file handle]")
    )
    # A missing file is damage, as is anything that names no failed system call.
    assert not integrity.storage_error(FileNotFoundError(errno.ENOENT, "No such file"))
    missing = "NOT_FOUND: Error reading x [OS error: No such file or directory]"
    assert not integrity.storage_error(ValueError(missing))
    zstd = "FAILED_PRECONDITION: ZSTD_decompressStream() failed: Unknown frame descriptor"
    assert not integrity.storage_error(ValueError(zstd))
    assert not integrity.storage_error(ValueError("pytree structure error: different types"))


def test_is_corrupt_tells_damage_from_storage_errors_and_config_changes():
    def chained(error, cause):
        error.__cause__ = cause
        return error

    assert checkpoint.is_corrupt(json.JSONDecodeError("Expecting value", "", 0))
    assert checkpoint.is_corrupt(FileNotFoundError(errno.ENOENT, "No such file"))
    assert checkpoint.is_corrupt(ValueError("DATA_LOSS: Error decoding b-tree node"))
    assert checkpoint.is_corrupt(ValueError("OUT_OF_RANGE: Error reading Byte range [0, 9)"))
    assert checkpoint.is_corrupt(chained(RuntimeError("wrapped"), ValueError("NOT_FOUND: x")))
    assert not checkpoint.is_corrupt(OSError(errno.EIO, "Input/output error"))
    assert not checkpoint.is_corrupt(chained(ValueError("x"), PermissionError(errno.EACCES, "")))
    assert not checkpoint.is_corrupt(ValueError("UNAVAILABLE: try again"))
    assert not checkpoint.is_corrupt(RuntimeError("anything else"))
    mismatch = ValueError("Requested shape: (4, 5) is not compatible with the stored shape")
    assert checkpoint.is_mismatch(mismatch) and not checkpoint.is_corrupt(mismatch)
