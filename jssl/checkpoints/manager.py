"""Checkpoints with orbax: save the TrainState and the data position, auto-resume.

Layout: ``workdir/checkpoints/<step>/{state,data}``. orbax writes each step to a temporary
directory and renames it when complete, so a process killed mid-save leaves the previous
checkpoints as they were and the partial one is never picked up. The resume order is written
down once, in ``restore_or_none``: the newest readable checkpoint in the workdir, older ones
only past checkpoints whose files are damaged (jssl.checkpoints.integrity; those are renamed
aside), else nothing (the caller then starts from ``init`` weights or from scratch). A save
that cannot be written stops the run at once with a ``CheckpointError`` naming the path and the
OS error, and never hangs: the directory is probed with a real write before every save
(``check_writable``), and orbax creates the step directories in the blocking part of ``save``,
not in a background thread that would wait 300 s for a signal that never comes
(``make_manager``). An error that ends the run while a save is in flight waits for that save
first (``closing``). More: docs/operations.md, "Checkpoints".
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from jssl.checkpoints.integrity import (
    Reads,
    agree,
    describe,
    diagnose,
    os_error_text,
    quiet_abandoned_reads,
)

# Re-exported: jssl.checkpoints.weights and the tests classify read errors through this module.
from jssl.checkpoints.integrity import is_corrupt as is_corrupt
from jssl.checkpoints.integrity import is_mismatch as is_mismatch


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """Where in the data a checkpoint was taken: the next batch to train on."""

    epoch: int = 0
    step_in_epoch: int = 0


class CheckpointError(RuntimeError):
    pass


# The items of a step directory: the TrainState (an orbax pytree) and the data position (JSON).
_ITEMS = {"pytrees": ("state",), "jsons": ("data",)}


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), "checkpoints")


def saved_steps(workdir: str) -> list[int]:
    """The steps of the complete checkpoints in ``workdir``, without opening orbax (cheap, at
    start-up). orbax's temporary ``<step>.orbax-checkpoint-tmp*`` directories of a killed save
    and the ``<step>.unreadable-*`` ones renamed aside are not steps."""
    try:
        names = os.listdir(checkpoint_dir(workdir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(name) for name in names if name.isdigit())


def check_config(checkpoint_config: Any) -> None:
    """Start-up check of ``config.checkpoint``; raises ValueError naming the field."""
    keep = checkpoint_config.max_to_keep
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError(
            f"checkpoint.max_to_keep={keep!r} must be an integer >= 0: the number of newest "
            "checkpoints to keep, or 0 to keep all of them. Set "
            "--config.checkpoint.max_to_keep=3 (the default) or 0."
        )
    every = checkpoint_config.every_steps
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(
            f"checkpoint.every_steps={every!r} must be an integer >= 0 (0: save only at the "
            "end of each epoch). Set --config.checkpoint.every_steps=<n>."
        )


def _orbax_max_to_keep(max_to_keep: int) -> int | None:
    """Our 0 ("keep all") is orbax's None; orbax would read 0 as "keep none" and delete
    every checkpoint, the ones of earlier runs in the workdir included."""
    if max_to_keep < 0:
        raise ValueError(
            f"checkpoint.max_to_keep={max_to_keep} must be >= 0 (0 keeps every checkpoint)."
        )
    return None if max_to_keep == 0 else max_to_keep


def make_manager(workdir: str, *, max_to_keep: int, async_save: bool) -> ocp.CheckpointManager:
    """The orbax manager of ``workdir/checkpoints``; ``max_to_keep=0`` keeps every step.

    orbax 0.12.8 creates a step's directory in a background thread by default, and the threads
    writing its items wait for a "directory created" signal with a 300 s timeout
    (``orbax/checkpoint/_src/futures/future.py`` ``_SignalingThread``, from
    ``multihost.coordination_timeout``): when the creation fails, those non-daemon threads keep
    the process alive for 5 minutes after the error. Created in the blocking part of ``save``
    instead, a failure raises from ``save`` itself; only the array writes stay asynchronous."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=_orbax_max_to_keep(max_to_keep),
        create=True,
        enable_async_checkpointing=async_save,
        # See the module docstring: a failed directory creation must raise in save(), not
        # leave background threads waiting 300 s for a signal that never comes.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
    )
    return ocp.CheckpointManager(
        checkpoint_dir(workdir), options=options, item_names=(*_ITEMS["pytrees"], *_ITEMS["jsons"])
    )


def check_writable(directory: str) -> None:
    """Raises CheckpointError unless a file can really be written to ``directory``.

    A test write (created, filled, fsynced, removed) rather than ``os.access``: root ignores
    permission bits, and neither a read-only mount nor a full disk shows in them. Every
    process probes (each writes its own shards) and all of them raise together.
    """
    error = ""
    probe = os.path.join(directory, f".write_test.{socket.gethostname()}.{os.getpid()}")
    try:
        if not os.path.lexists(directory):  # (a file in its place then fails with ENOTDIR)
            os.makedirs(directory, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)  # a full disk may only report ENOSPC when the data is flushed
        finally:
            os.close(fd)
    except OSError as e:
        error = os_error_text(e)
    with contextlib.suppress(OSError):  # nothing to remove when it could not be created
        os.remove(probe)
    failed = _processes_failing(bool(error))
    if error:
        raise CheckpointError(
            f"Cannot write checkpoints to {directory}: {error}. Nothing was saved; the "
            "checkpoints already there are untouched. Free disk space or make the directory "
            "writable, then rerun the same command to resume from the last checkpoint (or "
            "pass another --workdir)."
        )
    if failed:
        raise CheckpointError(
            f"Process(es) {failed} cannot write checkpoints to {directory} (see their logs); "
            "stopping every process. Fix the storage and rerun to resume."
        )


def _processes_failing(failed: bool) -> list[int]:
    """The indices of the processes for which ``failed`` is True (every process calls this)."""
    if jax.process_count() == 1:
        return [0] if failed else []
    flags = multihost_utils.process_allgather(np.asarray(failed, np.int32))
    return [int(i) for i in np.flatnonzero(np.asarray(flags).reshape(-1))]


def resume(workdir: str, checkpoint_config: Any, state: Any):
    """The manager of ``workdir`` and the state to continue from: the newest readable
    checkpoint, or ``state`` itself (with a fresh data position) when there is none.

    Checks ``checkpoint_config`` and that the checkpoint directory is writable first, so a
    run that could never save stops before it trains. Returns
    (manager, state, position, resumed).
    """
    check_config(checkpoint_config)
    check_writable(checkpoint_dir(workdir))
    manager = make_manager(
        workdir,
        max_to_keep=checkpoint_config.max_to_keep,
        async_save=checkpoint_config.async_save,
    )
    try:
        restored = restore_or_none(manager, state)
    except BaseException:
        manager.close()  # its threads and open files go with the error, not with the process
        raise
    if restored is None:
        return manager, state, DataPosition(), False
    return manager, restored[0], restored[1], True


def save(
    manager: ocp.CheckpointManager, state: Any, position: DataPosition, *, force: bool = False
) -> bool:
    """Saves ``state`` and ``position`` at the state's step (never overwrites a step).

    Raises CheckpointError at once when the directory cannot be written or when an earlier
    asynchronous save failed; the write of the arrays itself may still be running when this
    returns (``checkpoint.async_save``): ``check_for_errors`` and ``finish`` surface its
    failure.
    """
    step = int(jax.device_get(state.step))
    directory = str(manager.directory)
    finish(manager)  # orbax's save would wait for the previous save anyway
    if step in manager.all_steps():
        return False
    check_writable(directory)
    try:
        saved = manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(dataclasses.asdict(position)),
            ),
            force=force,
        )
    except Exception as e:  # noqa: BLE001 - any failure to save ends the run, with its cause
        raise _save_error(os.path.join(directory, str(step)), e) from e
    if saved:
        logging.info(
            "Saving checkpoint of step %d (epoch %d, batch %d of the epoch).",
            step,
            position.epoch,
            position.step_in_epoch,
        )
    return saved


def check_for_errors(manager: ocp.CheckpointManager) -> None:
    """Raises CheckpointError if a finished background save failed; never blocks on a save
    that is still running. Cheap: call it between steps (e.g. at every log step)."""
    if manager.is_saving_in_progress():
        return
    finish(manager)


def finish(manager: ocp.CheckpointManager) -> None:
    """Waits for a background save and raises CheckpointError if it failed."""
    try:
        manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - the error of the background save, re-raised
        raise _save_error(str(manager.directory), e) from e


@contextlib.contextmanager
def closing(manager: ocp.CheckpointManager) -> Iterator[ocp.CheckpointManager]:
    """Closes ``manager`` when the block ends. When an error ends it, a background save
    still in flight is completed first, so that the error does not cost that checkpoint as
    well (orbax would leave it as ``<step>.orbax-checkpoint-tmp``, which resume ignores). A
    KeyboardInterrupt (a second Ctrl-C: "stop now") leaves at once."""
    try:
        yield manager
    except KeyboardInterrupt:
        raise
    except BaseException:
        try:
            finish(manager)
        except CheckpointError as save_error:  # the run's own error is the one to raise
            logging.error("%s", save_error)
        manager.close()
        raise
    manager.close()


def _save_error(path: str, e: BaseException) -> CheckpointError:
    return CheckpointError(
        f"Saving the checkpoint at {path} failed: {describe(e)}. Training stopped; the "
        "checkpoints already in the directory are untouched. Free disk space or make the "
        "directory writable, then rerun the same command to resume from the last complete "
        "checkpoint."
    )


def restore_or_none(manager: ocp.CheckpointManager, target: Any) -> tuple[Any, DataPosition] | None:
    """Restores the newest readable checkpoint onto ``target``'s structure and shardings.

    A checkpoint that fails is skipped for the next older one only when its files are
    damaged: the error says so itself (``is_corrupt``), or the checkpoint does not read back
    whole on its own (``integrity.find_damage``). The skipped ones are then renamed aside
    (``_move_aside``) and both are logged as errors. Any other failure raises a
    CheckpointError without touching a file: a read that failed for a storage reason (retry),
    a whole checkpoint that does not fit the target (the config changed). If checkpoints
    exist but all are damaged, this raises rather than silently training from scratch.
    """
    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
        return None
    with quiet_abandoned_reads() as reads:
        return _restore_newest(manager, steps, target, reads)


def _restore_newest(manager: ocp.CheckpointManager, steps: list[int], target: Any, reads: Reads):
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    damaged = []
    for step in steps:
        path = os.path.join(manager.directory, str(step))
        error, restored = None, None
        try:
            restored = manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:  # noqa: BLE001 - diagnosed below; only damage falls back
            error = e
            reads.failed = True
        verdict, reason = ("ok", "") if error is None else diagnose(path, error, **_ITEMS)
        verdict, failed = agree(verdict)
        if verdict == "ok":
            if damaged:
                _move_aside(manager, [s for s, _ in damaged])
            return restored["state"], DataPosition(**restored["data"])
        if verdict == "damaged":
            logging.error(
                "Could not restore the checkpoint at %s: it is incomplete or corrupt (%s); "
                "trying the next older one.",
                path,
                reason or "it read back whole on this process, not on the others",
            )
            damaged.append((step, f"  {path}: {reason or 'damaged on another process'}"))
            continue
        failure = _read_error(path, verdict, reason, failed)
        if verdict == "whole":
            raise failure from error  # unexplained: orbax's traceback is worth reading
        # The message names the cause. Dropping the error frees orbax's abandoned reads now,
        # under quiet_abandoned_reads, rather than as tracebacks when the process exits.
        del error
        raise failure
    raise CheckpointError(
        f"None of the checkpoints in {manager.directory} could be restored; every one is "
        "incomplete or corrupt:\n" + "\n".join(line for _, line in damaged) + "\n"
        "Nothing was moved. Move them out of the directory to start over, or use a new "
        "--workdir."
    )


def _read_error(path: str, verdict: str, reason: str, failed: list[int]) -> CheckpointError:
    if jax.process_index() not in failed:
        return CheckpointError(
            f"Process(es) {failed} could not read the checkpoint at {path} (see their logs). "
            "Nothing was moved or deleted. Check the storage and rerun the same command."
        )
    if verdict == "mismatch":
        return CheckpointError(
            f"The checkpoint at {path} does not fit the state this config builds ({reason}): "
            "the config differs from the one that wrote it (model, method, probe ...). Nothing "
            "was moved or deleted. Resume with the workdir's original config (its config.json) "
            "or use a new --workdir."
        )
    if verdict == "storage":
        return CheckpointError(
            f"Reading the checkpoint at {path} failed ({reason}): an error of the storage, "
            "not of the files, so the checkpoint was not touched and no older one was used. "
            "Check the storage (disk, permissions, mount) and retry (rerun the same command)."
        )
    return CheckpointError(
        f"Restoring the checkpoint at {path} failed ({reason}), yet its files read back "
        "whole on their own: the config may differ from the one that wrote it, or the read "
        "failed for a passing reason. The checkpoint was not touched and no older one was "
        "used. Rerun the same command; if this repeats, resume with the workdir's original "
        "config (its config.json) or use a new --workdir."
    )


def _move_aside(manager: ocp.CheckpointManager, unreadable: list[int]) -> None:
    """Renames corrupt checkpoints to ``<step>.unreadable-<time>``, which orbax ignores.

    Left in place, the run resumed from an older step would skip saving those steps again
    (``save`` never overwrites) and the next restart would meet the same corrupt files.
    """
    suffix = f"unreadable-{int(time.time())}"
    moves = [
        (os.path.join(manager.directory, str(s)), os.path.join(manager.directory, f"{s}.{suffix}"))
        for s in unreadable
    ]
    if jax.process_index() == 0:
        for old, new in moves:
            os.rename(old, new)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jssl_checkpoint_move_aside")
    manager.reload()
    logging.error(
        "Resumed from step %d, OLDER than the newest checkpoint: the newer checkpoints were "
        "incomplete or corrupt and were renamed aside:\n%s\nTheir steps will be trained "
        "again. Delete the renamed directories once inspected.",
        manager.latest_step(),
        "\n".join(f"  {old} -> {new}" for old, new in moves),
    )
