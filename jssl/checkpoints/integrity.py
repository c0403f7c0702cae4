"""What a checkpoint that fails to restore is: damaged, on a storage that failed, or whole.

The resume (``manager.restore_or_none``) and the weight import fall back to an older checkpoint
only past damaged ones. ``diagnose`` gives the verdict on one: a storage error that a retry of
the same read can fix (``storage_error``: an OS error other than a missing file, tensorstore's
``[OS error: ...]``, a "try again" or "not allowed" status), which stops the run and touches
nothing; damage that the error names plainly (``is_corrupt``: unparsable metadata, a missing
file, tensorstore's data-loss statuses); else what reading the files back finds
(``find_damage``: the metadata, then every array with it as the target), because tensorstore's
other damage reports (a corrupt zstd frame is ``FAILED_PRECONDITION``, as is an ``EIO``) are
too varied to list. ``agree`` makes every process act on the same verdict, and
``quiet_abandoned_reads`` keeps the tracebacks of the reads that orbax abandons after a failure
out of the log.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import inspect
import json
import os
import re
import sys
import time
from collections.abc import Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

# tensorstore reports damaged or missing files with these status codes at the start of the
# message of the ValueError orbax passes on (e.g. "DATA_LOSS: Error decoding b-tree node",
# "OUT_OF_RANGE: ... Byte range" of a truncated file, "NOT_FOUND: ... does not exist").
_CORRUPT_STATUSES = ("DATA_LOSS:", "OUT_OF_RANGE:", "NOT_FOUND:")
# Status codes of reads that a retry can fix (absl's "retry" and "not allowed" codes; remote
# kvstores report timeouts and outages with them).
_RETRY_STATUSES = re.compile(
    r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|ABORTED|CANCELLED|RESOURCE_EXHAUSTED|"
    r"PERMISSION_DENIED|UNAUTHENTICATED):"
)
# An absl status code at the start of a message, as tensorstore writes them.
_STATUS = re.compile(r"[A-Z][A-Z_]+: ")
# tensorstore appends strerror to the status of a failed system call
# (tensorstore/internal/os/error_code.cc, ``StatusFromOsError``).
_OS_ERROR = re.compile(r"\[OS error: ([^\]]*)\]")
# A missing file or directory is damage (a partial copy, a deleted file), not a storage fault.
_MISSING = (errno.ENOENT, errno.ENOTDIR)
# How long the end of a failed read waits for the reads it left behind: until none has
# finished for _QUIET_S, and at most _LINGER_S (local files take milliseconds).
_QUIET_S = 0.3
_LINGER_S = 5.0
# What orbax says when the saved tree does not fit the target: a config change, not damage.
_MISMATCH_MESSAGES = (
    "tree structures do not match",
    "is not compatible with the stored shape",
)


def chain(exc: BaseException | None):
    """``exc`` and its causes (``__cause__``, else ``__context__``), each once."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def os_error_text(e: OSError) -> str:
    name = errno.errorcode.get(e.errno, "") if e.errno is not None else ""
    where = f" ({e.filename})" if e.filename else ""
    return f"[Errno {e.errno} {name}] {e.strerror or e}{where}"


def describe(e: BaseException) -> str:
    """A one-line cause: errno and strerror from the first OSError in the chain, else the
    first status line of tensorstore's (orbax wraps it in a line about the array index)."""
    causes = list(chain(e))
    for cause in causes:
        if isinstance(cause, OSError) and cause.errno is not None:
            return f"{type(cause).__name__}: {os_error_text(cause)}"
    status = [c for c in causes if _STATUS.match(str(c))]
    cause = status[0] if status else e
    text = str(cause).splitlines()[0][:400] if str(cause) else ""
    return f"{type(cause).__name__}: {text}"


def storage_error(exc: BaseException) -> bool:
    """Whether a read failed for a reason that retrying the same read can fix: an OSError
    other than a missing file, tensorstore's ``[OS error: ...]`` of one, or a "try again" /
    "not allowed" status (``UNAVAILABLE``, ``PERMISSION_DENIED`` ...). Follows the chain."""
    missing = {os.strerror(code) for code in _MISSING}
    for cause in chain(exc):
        if isinstance(cause, OSError) and cause.errno is not None:
            if cause.errno not in _MISSING:
                return True
            continue
        text = str(cause)
        if _RETRY_STATUSES.search(text):
            return True
        if any(message not in missing for message in _OS_ERROR.findall(text)):
            return True
    return False


def is_corrupt(exc: BaseException) -> bool:
    """Whether the error itself shows that the files are incomplete or damaged, with no need
    to read them again: unparsable JSON metadata, a missing file (ENOENT), tensorstore's
    data-loss statuses (``DATA_LOSS``, ``OUT_OF_RANGE`` for truncated files, ``NOT_FOUND``).

    False for every other error, in particular other OSErrors (the storage failed, not the
    files) and a tree or shape mismatch (``is_mismatch``: the config changed); for those,
    ``find_damage`` decides. Follows ``__cause__``/``__context__``.
    """
    for cause in chain(exc):
        if isinstance(cause, json.JSONDecodeError | UnicodeDecodeError | EOFError):
            return True
        if isinstance(cause, FileNotFoundError):
            return True
        if isinstance(cause, OSError):
            return False
        if isinstance(cause, ValueError):
            if is_mismatch(cause):
                return False
            if str(cause).startswith(_CORRUPT_STATUSES):
                return True
    return False


def is_mismatch(exc: BaseException) -> bool:
    """Whether a restore failed because the saved tree or shapes differ from the target's:
    the model (or another part of the state) was configured differently when it was saved."""
    return any(
        isinstance(cause, ValueError) and any(m in str(cause) for m in _MISMATCH_MESSAGES)
        for cause in chain(exc)
    )


def find_damage(step_dir: str, *, pytrees: tuple[str, ...], jsons: tuple[str, ...]) -> str:
    """What is damaged in the checkpoint at ``step_dir``, read on its own: its ``jsons``
    items parsed, its ``pytrees`` items' metadata read and every array of them read into host
    memory with that metadata as the target. "" when all of it reads back whole.

    A read that fails for a storage reason (``storage_error``) is re-raised: it says nothing
    about the files. Reads everything once, so call it only on a checkpoint that failed.
    """
    # The error is freed inside the block, so that the echoes of the reads it abandoned are
    # finalized there.
    with quiet_abandoned_reads() as reads:
        try:
            for name in jsons:
                handler = ocp.JsonCheckpointHandler()
                try:
                    handler.restore(epath.Path(step_dir) / name)
                finally:
                    handler.close()
            for name in pytrees:
                _read_pytree(os.path.join(step_dir, name))
        except Exception as e:  # noqa: BLE001 - any failure to read back whole is damage
            reads.failed = True
            if storage_error(e):
                raise
            return describe(e)
    return ""


def _read_pytree(directory: str) -> None:
    """Reads every array of the orbax pytree at ``directory`` as numpy, on this host only (no
    device memory, no shardings: the saved ``_sharding`` file need not fit this run)."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        metadata = handler.metadata(epath.Path(directory))
        tree = getattr(metadata, "tree", metadata)
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        handler.restore(
            epath.Path(directory), args=ocp.args.PyTreeRestore(restore_args=restore_args)
        )
    finally:
        handler.close()


class Reads:
    """What ``quiet_abandoned_reads`` knows of the reads in its block."""

    def __init__(self):
        self.failed = False  # set by the caller when a read in the block raised
        self.echoes = 0  # the echoes dropped so far


@contextlib.contextmanager
def quiet_abandoned_reads() -> Iterator[Reads]:
    """Drops the echoes of failed reads while checkpoints are read in the block.

    After the first array that fails, orbax leaves its other reads behind: their coroutines
    are finalized later with the same error, and tensorstore's callbacks meet an event loop
    that is closed by then. Python prints each as an "Exception ignored" traceback (dozens
    for one damaged checkpoint) although the failure itself is reported, once. These go
    through ``sys.unraisablehook``; others still reach the previous hook. After a failure
    (``Reads.failed``, or an error leaving the block) the block's end waits for the reads
    left behind, until no echo has come for ``_QUIET_S`` (at most ``_LINGER_S``).
    """
    previous = sys.unraisablehook
    reads = Reads()

    def hook(unraisable) -> None:
        error = unraisable.exc_value
        closed_loop = isinstance(error, RuntimeError) and "Event loop is closed" in str(error)
        if closed_loop or inspect.iscoroutine(unraisable.object):
            reads.echoes += 1
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield reads
    except BaseException:
        reads.failed = True
        raise
    finally:
        deadline = time.monotonic() + _LINGER_S
        while True:
            seen = reads.echoes
            gc.collect()  # finalizes the abandoned coroutines now, under this hook
            if not reads.failed or time.monotonic() > deadline:
                break
            time.sleep(_QUIET_S)
            if reads.echoes == seen:
                break
        sys.unraisablehook = previous


# How a checkpoint that failed to restore failed, from the mildest to the gravest; every
# process acts on the gravest of all processes' verdicts (``agree``).
_VERDICTS = ("ok", "damaged", "storage", "mismatch", "whole")


def diagnose(
    path: str, error: Exception, *, pytrees: tuple[str, ...], jsons: tuple[str, ...]
) -> tuple[str, str]:
    """(verdict, reason) of the checkpoint at ``path`` whose restore raised ``error``: a
    storage error, damage the error names, else what reading the files back finds (see
    ``find_damage``; ``pytrees`` and ``jsons`` name the step's items)."""
    if storage_error(error):
        return "storage", describe(error)
    if is_corrupt(error):
        return "damaged", describe(error)
    logging.warning("Restoring %s failed (%s); reading its files back.", path, describe(error))
    try:
        damage = find_damage(path, pytrees=pytrees, jsons=jsons)
    except Exception as e:  # noqa: BLE001 - find_damage raises only storage errors
        return "storage", describe(e)
    if damage:
        return "damaged", damage
    return ("mismatch" if is_mismatch(error) else "whole"), describe(error)


def agree(verdict: str) -> tuple[str, list[int]]:
    """The verdict every process acts on (the gravest one) and the processes that hold it,
    so that all of them restore the same step or all of them stop."""
    if jax.process_count() == 1:
        return verdict, [0]
    codes = multihost_utils.process_allgather(np.int32(_VERDICTS.index(verdict)))
    codes = np.asarray(codes).reshape(-1)
    gravest = int(codes.max())
    return _VERDICTS[gravest], [int(i) for i in np.flatnonzero(codes == gravest)]
