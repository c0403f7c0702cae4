"""What keeps a workdir consistent across launches: one run at a time, one config.

* ``lock``: an exclusive ``fcntl.flock`` on ``workdir/.lock`` for the life of the run, so a
  second launch on the same workdir is refused instead of overwriting the first one's
  checkpoints. The kernel drops the lock when its process dies (even by SIGKILL), so a crashed
  run never leaves a stale lock; the pid and host written into the file only serve the
  messages. (flock works across hosts on NFS v4 and Lustre with flock enabled; on a file system
  without it the lock covers one host only.)
* ``open_run``: the lock, then jssl.checkpoints.run_config's check of the config; the
  config.json that a first launch wrote is removed when it fails before its first checkpoint,
  so a corrected rerun is not refused as a change of a run that never started.
* ``make_workdir``: a ``--workdir`` that is a file or cannot be created is refused, and so is a
  directory that holds files but none of a jssl workdir's own (``OWN_NAMES``).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections
from absl import logging

# flag_value, flags_to_match, recorded_config and same_value are re-exported: source_model and
# weights read them from here.
from jssl.checkpoints.run_config import (  # noqa: F401
    CONFIG_FILE,
    flag_value,
    flags_to_match,
    process_0_failed,
    record_config,
    recorded_config,
    same_value,
)

LOCK_FILE = ".lock"
# What a jssl workdir holds from its first launch on: the lock (kept even when that launch
# failed and removed its config.json again), the config and the checkpoints.
OWN_NAMES = (LOCK_FILE, CONFIG_FILE, "checkpoints")


@contextlib.contextmanager
def open_run(config: ml_collections.ConfigDict, workdir: str) -> Iterator[list[str]]:
    """What every engine that writes a workdir does first: take its lock for the whole run,
    then check (and on a first launch write) its config. Yields the recorded changes. When the
    body fails before a checkpoint exists, the config.json this launch wrote is removed again,
    so that a corrected rerun starts afresh."""
    from jssl.checkpoints import (
        manager as checkpoint,  # checkpoint does not import workdir; keep it that way
    )

    with lock(workdir):
        config_path = os.path.join(workdir, CONFIG_FILE)
        created = jax.process_index() == 0 and not os.path.exists(config_path)
        changes = record_config(
            config,
            workdir,
            resuming=bool(checkpoint.saved_steps(workdir)),
            force=config.checkpoint.allow_config_change,
        )
        logging.info("Resolved config:\n%s", config)
        try:
            yield changes
        except BaseException:
            # A run that fails before its first checkpoint (a start-up check of the engine, a
            # wrong init.checkpoint, Ctrl-C while compiling) leaves nothing to resume: the
            # config.json it wrote would only refuse the corrected rerun as a config change.
            # A config.json that was there before this launch is never removed.
            if created and not checkpoint.saved_steps(workdir):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(config_path)
                logging.info("Removed %s: the run failed before its first checkpoint.", config_path)
            raise


class WorkdirLockedError(RuntimeError):
    pass


@contextlib.contextmanager
def lock(workdir: str) -> Iterator[None]:
    """Holds the exclusive lock of ``workdir`` for the body; raises WorkdirLockedError at
    once if another process holds it. Only process 0 of a multi-process run locks (the
    others are part of the same run); they raise with it when it fails."""
    if jax.process_index() != 0:
        if process_0_failed(False):
            raise WorkdirLockedError(
                f"Process 0 could not lock the workdir {workdir} (see its log): another run "
                "uses it. Pass another --workdir or stop that run."
            )
        yield
        return
    path = os.path.join(os.path.abspath(workdir), LOCK_FILE)
    fd = -1
    try:
        make_workdir(workdir)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        _lock_exclusive(fd)
    except BaseException as e:
        process_0_failed(True)
        holder = _read_holder(fd) if fd >= 0 else {}
        if fd >= 0:
            os.close(fd)
        if isinstance(e, OSError) and e.errno in (errno.EWOULDBLOCK, errno.EACCES):
            raise WorkdirLockedError(_locked_message(workdir, path, holder)) from None
        raise
    process_0_failed(False)
    try:
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # releases the flock


def _lock_exclusive(fd: int, tries: int = 5, pause_s: float = 0.05) -> None:
    """``flock(LOCK_EX | LOCK_NB)``, tried again for a moment while it would block: a
    follower's ``lock_holder`` probe holds a shared lock for an instant, and a launch then must
    not be refused as if a run held the workdir. A run's own lock still refuses in 0.2 s."""
    for attempt in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES) or attempt == tries - 1:
                raise
            time.sleep(pause_s)


def make_workdir(workdir: str) -> None:
    """Creates ``workdir`` (and its parents) unless it exists; an empty path, a path that is a
    file, or one that cannot be created raises an error saying what to pass instead."""
    if not workdir:
        raise ValueError("--workdir is empty: pass the directory of the run, e.g. runs/my_run.")
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise NotADirectoryError(
            f"--workdir={workdir} is an existing file, not a directory: pass the path of a "
            "directory (it is created if missing), e.g. --workdir=runs/my_run."
        )
    if os.path.isdir(workdir):
        check_is_own(workdir)
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise type(e)(
            e.errno,
            f"--workdir={workdir}: cannot create this directory ({e.strerror}: {e.filename}); "
            "pass a --workdir in a writable location whose parents are directories",
        ) from None


def lock_holder(workdir: str) -> dict[str, Any] | None:
    """Who holds ``workdir``'s lock (the pid, host, start and command it wrote; {} before it
    wrote them), or None when no process does: how a follower tells that its training is
    gone. The probe opens the lock file read-only (never creating it), asks for a shared lock
    without waiting, which fails while the run holds its exclusive one, and drops it at once;
    a launch that tries the lock in that instant tries again a moment later. Never call it on
    a workdir this process has locked: on NFS, closing any descriptor of a file drops all its
    locks."""
    path = os.path.join(os.path.abspath(workdir), LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None  # no run ever locked this workdir
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return _read_holder(fd)
        raise
    finally:
        os.close(fd)  # releases the probe's shared lock, if it got one
    return None


def check_is_own(workdir: str) -> None:
    """Refuses an existing ``workdir`` that holds files (hidden ones aside: ``.DS_Store``,
    ``.ipynb_checkpoints``) but none of ``OWN_NAMES``: a run there would write its config,
    checkpoints and results (a results.json of another tool included) beside them."""
    entries = os.listdir(workdir)
    if any(name in OWN_NAMES for name in entries):
        return
    visible = sorted(name for name in entries if not name.startswith("."))
    if not visible:
        return
    shown = ", ".join(visible[:5]) + (f" and {len(visible) - 5} more" if len(visible) > 5 else "")
    raise FileExistsError(
        f"--workdir={workdir} ({os.path.abspath(workdir)}) is a directory that holds other "
        f"files ({shown}) and is not a jssl workdir (no {CONFIG_FILE}, checkpoints/ or "
        f"{LOCK_FILE}): the run would write its files beside them. Pass a new or empty "
        "directory, e.g. --workdir=runs/my_run."
    )


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        return json.loads(os.pread(fd, 65536, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def _locked_message(workdir: str, path: str, holder: dict[str, Any]) -> str:
    who = (
        f"process {holder.get('pid', '?')} on host {holder.get('host', '?')}, started "
        f"{holder.get('started', '?')} ({holder.get('command', '?')})"
        if holder
        else "another process (it has not written its pid yet)"
    )
    return (
        f"The workdir {workdir} is in use by {who}: two runs in one workdir would overwrite "
        f"each other's checkpoints. Wait for that run to finish or stop it (the lock in {path} "
        "is released when its process ends, even if killed), or pass another --workdir."
    )
