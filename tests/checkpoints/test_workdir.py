"""The workdir lock (one run per workdir, released by a killed process) and the config
check on resume (first config kept, safe changes recorded, other changes refused)."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import jax
import pytest

from configs import moco
from jssl.checkpoints import run_config
from jssl.checkpoints import workdir as workdir_lib

_HOLD_LOCK = """
import sys, time
from jssl.checkpoints import workdir
with workdir.lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


def _hold_lock(path) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_HOLD_LOCK), str(path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_run_on_a_locked_workdir_is_refused_until_the_holder_dies(tmp_path):
    holder = _hold_lock(tmp_path)
    try:
        with pytest.raises(workdir_lib.WorkdirLockedError) as info:
            with workdir_lib.lock(str(tmp_path)):
                pass
        message = str(info.value)
        assert f"process {holder.pid} on host {socket.gethostname()}" in message
        assert str(tmp_path) in message and "--workdir" in message
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up: the kernel must release the lock
        holder.wait()
    with workdir_lib.lock(str(tmp_path)):
        with open(tmp_path / workdir_lib.LOCK_FILE) as f:
            assert json.load(f)["pid"] == os.getpid()


def test_the_lock_is_exclusive_within_one_process_and_released_on_exit(tmp_path):
    with workdir_lib.lock(str(tmp_path)):
        with pytest.raises(workdir_lib.WorkdirLockedError, match=f"process {os.getpid()}"):
            with workdir_lib.lock(str(tmp_path)):
                pass
    with pytest.raises(RuntimeError, match="boom"):
        with workdir_lib.lock(str(tmp_path)):
            raise RuntimeError("boom")
    with workdir_lib.lock(str(tmp_path)):  # released after the error too
        pass


def test_a_launch_during_a_followers_probe_is_not_refused(tmp_path):
    """A follower's lock_holder holds a shared lock for an instant; a launch then waits a
    moment instead of reporting the workdir as in use."""
    import fcntl
    import threading

    with workdir_lib.lock(str(tmp_path)):
        pass
    fd = os.open(tmp_path / workdir_lib.LOCK_FILE, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the probe, caught in its instant
    threading.Timer(0.08, os.close, (fd,)).start()
    with workdir_lib.lock(str(tmp_path)):
        pass
    assert workdir_lib.lock_holder(str(tmp_path)) is None


def test_only_process_0_of_a_run_takes_the_lock(tmp_path, monkeypatch):
    with workdir_lib.lock(str(tmp_path)):
        monkeypatch.setattr(jax, "process_index", lambda: 1)
        with workdir_lib.lock(str(tmp_path)):  # another process of the same run
            pass


def _config(**overrides):
    config = moco.get_config("test")
    config.update_from_flattened_dict(overrides)
    return config


def _changes(path) -> list:
    with open(path / run_config.CHANGES_FILE) as f:
        return json.load(f)


def test_the_first_config_is_kept_and_an_unchanged_one_passes(tmp_path):
    config = _config()
    assert run_config.record_config(config, str(tmp_path), resuming=False, force=False) == []
    saved = (tmp_path / "config.json").read_text()
    assert json.loads(saved)["data"]["batch_size"] == config.data.batch_size
    # Tuples come back from JSON as lists: still the same config.
    assert isinstance(config.data.augment.crop_scale, tuple)
    assert run_config.record_config(config, str(tmp_path), resuming=True, force=False) == []
    assert (tmp_path / "config.json").read_text() == saved
    assert not (tmp_path / run_config.CHANGES_FILE).exists()


def test_safe_changes_are_allowed_and_recorded_once(tmp_path):
    run_config.record_config(_config(), str(tmp_path), resuming=False, force=False)
    original = (tmp_path / "config.json").read_text()
    changed = _config(**{"log_every_steps": 7, "debug.max_steps": 3, "knn.k": 5})
    lines = run_config.record_config(changed, str(tmp_path), resuming=True, force=False)
    log_every = _config().log_every_steps
    assert f"log_every_steps: {log_every} -> 7" in lines
    assert any(line.startswith("debug.max_steps:") and line.endswith("-> 3") for line in lines)
    assert len(lines) == 3
    assert (tmp_path / "config.json").read_text() == original
    [entry] = _changes(tmp_path)
    assert entry["changes"]["log_every_steps"] == {"old": log_every, "new": 7}
    assert entry["resuming"] and not entry["forced"]
    # The next restart of the same command compares with the config in effect: no new entry.
    assert run_config.record_config(changed, str(tmp_path), resuming=True, force=False) == []
    assert len(_changes(tmp_path)) == 1


@pytest.mark.parametrize("resuming", [True, False])
def test_a_change_that_alters_the_run_is_refused_with_the_fields(tmp_path, resuming):
    run_config.record_config(_config(), str(tmp_path), resuming=False, force=False)
    original = (tmp_path / "config.json").read_text()
    changed = _config(**{"data.batch_size": 32, "optim.base_lr": 0.5, "log_every_steps": 7})
    with pytest.raises(run_config.ConfigChangedError) as info:
        run_config.record_config(changed, str(tmp_path), resuming=resuming, force=False)
    message = str(info.value)
    base = _config()
    assert f"data.batch_size: {base.data.batch_size} -> 32" in message
    assert f"optim.base_lr: {base.optim.base_lr} -> 0.5" in message
    assert "log_every_steps" not in message  # safe, so not among the refused fields
    assert str(tmp_path / "config.json") in message
    assert "--config.checkpoint.allow_config_change=True" in message and "--workdir" in message
    assert (tmp_path / "config.json").read_text() == original
    assert not (tmp_path / run_config.CHANGES_FILE).exists()


def test_a_forced_change_is_recorded_and_the_original_config_kept(tmp_path):
    run_config.record_config(_config(), str(tmp_path), resuming=False, force=False)
    original = (tmp_path / "config.json").read_text()
    changed = _config(**{"num_epochs": 9, "checkpoint.allow_config_change": True})
    lines = run_config.record_config(changed, str(tmp_path), resuming=True, force=True)
    assert any(line.startswith("num_epochs:") and line.endswith("-> 9") for line in lines)
    [entry] = _changes(tmp_path)
    assert entry["forced"] and entry["changes"]["num_epochs"]["new"] == 9
    assert (tmp_path / "config.json").read_text() == original
    # Once accepted, rerunning the same command does not need the flag again.
    again = _config(**{"num_epochs": 9})
    assert run_config.record_config(again, str(tmp_path), resuming=True, force=False) == [
        "checkpoint.allow_config_change: true -> false"
    ]


def test_only_process_0_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    run_config.record_config(_config(), str(tmp_path), resuming=False, force=False)
    assert not (tmp_path / "config.json").exists()


def test_safe_fields():
    for field in ("log_every_steps", "debug.max_steps", "knn.k", "checkpoint.max_to_keep"):
        assert run_config.is_safe(field), field
    for field in ("num_epochs", "seed", "data.batch_size", "model.trunk", "method.name"):
        assert not run_config.is_safe(field), field


def test_fields_of_another_jssl_version_are_recorded_not_refused(tmp_path):
    # A workdir written before optim.lr_scaling existed, and with a field since removed.
    old = json.loads(_config().to_json_best_effort())
    del old["optim"]["lr_scaling"]
    old["optim"]["retired_field"] = 1
    (tmp_path / "config.json").write_text(json.dumps(old))
    lines = run_config.record_config(_config(), str(tmp_path), resuming=True, force=False)
    assert sorted(lines) == [
        'optim.lr_scaling: <absent> -> "linear"',
        "optim.retired_field: 1 -> <absent>",
    ]


def test_a_scalar_probability_of_an_older_workdir_equals_its_one_group_tuple(tmp_path):
    # Before crop groups, augmentation probabilities were scalars; (p,) means the same run.
    old = json.loads(_config().to_json_best_effort())
    old["data"]["augment"]["blur_prob"] = old["data"]["augment"]["blur_prob"][0]
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert run_config.record_config(_config(), str(tmp_path), resuming=True, force=False) == []
    changed = _config()
    changed.data.augment.blur_prob = (0.9,)
    with pytest.raises(run_config.ConfigChangedError, match="data.augment.blur_prob"):
        run_config.record_config(changed, str(tmp_path), resuming=True, force=False)


class _StartUpError(RuntimeError):
    pass


def test_a_run_failing_before_its_first_checkpoint_leaves_no_config(tmp_path):
    # Else the corrected rerun would be refused as a change of a run that never started.
    with pytest.raises(_StartUpError):
        with workdir_lib.open_run(_config(), str(tmp_path)):
            assert (tmp_path / run_config.CONFIG_FILE).exists()
            raise _StartUpError("an engine's own start-up check")
    assert not (tmp_path / run_config.CONFIG_FILE).exists()
    with workdir_lib.open_run(_config(**{"data.batch_size": 32}), str(tmp_path)) as changes:
        assert changes == []


def test_a_config_json_of_an_earlier_launch_or_with_checkpoints_is_kept(tmp_path):
    # An earlier launch's config (a restart that fails again): never removed.
    run_config.record_config(_config(), str(tmp_path), resuming=False, force=False)
    original = (tmp_path / run_config.CONFIG_FILE).read_text()
    with pytest.raises(_StartUpError):
        with workdir_lib.open_run(_config(), str(tmp_path)):
            raise _StartUpError("again")
    assert (tmp_path / run_config.CONFIG_FILE).read_text() == original
    # A first launch that saved a checkpoint before failing: its config stays for the resume.
    other = tmp_path / "other"
    with pytest.raises(_StartUpError):
        with workdir_lib.open_run(_config(), str(other)):
            os.makedirs(other / "checkpoints" / "4")
            raise _StartUpError("after the first checkpoint")
    assert (other / run_config.CONFIG_FILE).exists()


def test_a_workdir_that_is_a_file_is_a_clear_error(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not a workdir")
    with pytest.raises(NotADirectoryError, match=r"--workdir=.*notes.txt is an existing file"):
        with workdir_lib.open_run(_config(), str(path)):
            pass
    with pytest.raises(OSError, match=r"--workdir=.*notes.txt/run: cannot create"):
        with workdir_lib.lock(str(path / "run")):
            pass
    assert path.read_text() == "not a workdir"
