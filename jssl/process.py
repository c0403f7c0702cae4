"""Process set-up shared by every way of starting jssl (``jssl`` / ``launch.py``, and
``jssl.train`` from Python): CPU XLA flags before JAX starts its backends, TensorFlow (when
installed, for tf.data) kept off the accelerators, orbax's per-save INFO lines out of the log,
the import-time objects frozen out of Python's garbage collector, and, in a multi-process run,
one process's failure stopping every process (``stop_together``)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

from absl import logging


def configure() -> None:
    """What must happen before JAX initialises its backends: jssl's CPU XLA flags (harmless on
    GPU/TPU hosts) and quiet TensorFlow C++ logs."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from jssl import parallel

    parallel.configure_cpu_defaults()


def hide_accelerators_from_tensorflow() -> None:
    """tf.data only runs input pipelines; keep TensorFlow off the GPUs JAX uses. A no-op where
    TensorFlow is not installed (jssl's core and the demo data need none)."""
    try:
        import tensorflow as tf
    except ImportError:
        return
    tf.config.set_visible_devices([], "GPU")


def freeze_imports() -> None:
    """Quiets orbax's INFO records and freezes the objects the imports made (TensorFlow, JAX,
    flax, orbax: ~440k of them): they live as long as the process, and frozen, Python's full
    collections stop rescanning them, which took 0.2 s of the 0.9 s it takes to trace
    ResNet-18's MoCo step on 2 CPU cores (benchmarks/train_step.py)."""
    from jssl import engines

    engines.quiet_orbax_info_logs()
    gc.freeze()


# Keys of jax.distributed's key-value store: a failed process's error, and each other
# process's word that it read it (process 0 hosts the store, which ends with it).
_FAILED = "jssl/failed/"
_SEEN = "jssl/failure_seen/"


@dataclasses.dataclass(frozen=True)
class _Peers:
    """This process's place in a multi-process run: jax.distributed's client, its index, the
    number of processes."""

    client: Any
    me: int
    count: int

    def failures(self) -> dict[int, str]:
        """{process id: error} of the other processes that failed so far."""
        found = _by_process(self.client.key_value_dir_get(_FAILED))
        return {pid: error for pid, error in found.items() if pid != self.me}

    def seen(self) -> set[int]:
        """The processes that read another's error."""
        return set(_by_process(self.client.key_value_dir_get(_SEEN)))


def _by_process(entries: list[tuple[str, str]]) -> dict[int, str]:
    """``[("jssl/failed/1", v), ...]`` of the key-value store as ``{1: v, ...}``."""
    return {int(key.rsplit("/", 1)[-1]): value for key, value in entries}


@contextlib.contextmanager
def stop_together(poll_s: float = 1.0, wait_s: float = 10.0) -> Iterator[None]:
    """In a multi-process run, an error on one process stops them all within about ``poll_s``
    seconds, each exiting with status 1 and a line naming the process that failed and why;
    in a single process, nothing.

    Without it the failing process would print its error and wait in jax.distributed's
    shutdown for the others, and they in their next collective for it, until both abort
    minutes later (jax's 300 s timeouts) with a C++ stack dump. Here the failing process
    writes its error into jax.distributed's key-value store and leaves at once (process 0,
    which hosts the store, after the others read it or ``wait_s``); a thread of every other
    process reads the store every ``poll_s`` and stops its process on the first error."""
    from jax._src import distributed  # its state, read without starting the backends

    state = distributed.global_state
    if state.client is None or state.num_processes < 2:
        yield
        return
    peers = _Peers(state.client, state.process_id, state.num_processes)
    done = threading.Event()
    watcher = threading.Thread(
        target=_watch, args=(peers, done, poll_s), name="jssl-stop-together", daemon=True
    )
    watcher.start()
    try:
        yield
    except (Exception, KeyboardInterrupt) as error:
        done.set()
        _fail(peers, error, wait_s)
    finally:
        done.set()
        watcher.join(timeout=poll_s + 5)


def _leave(message: str) -> None:
    """Logs ``message`` and ends the process with status 1 at once: Python's exit would run
    jax.distributed's shutdown, which waits for every process, blocked ones included."""
    logging.error("%s", message)
    logging.flush()
    os._exit(1)


def _fail(peers: _Peers, error: BaseException, wait_s: float) -> None:
    """Reports this process's ``error`` to the others and leaves."""
    me, count = peers.me, peers.count
    traceback.print_exception(error)
    reason = f"{type(error).__name__}: {str(error).rstrip('.')}"[:4000]
    try:
        earlier = peers.failures()
        peers.client.key_value_set(f"{_FAILED}{me}", reason, allow_overwrite=True)
    except Exception as e:  # the coordinator is gone too: nothing to tell
        _leave(f"Process {me} of {count} failed ({reason}), and could not tell the others: {e}")
    if me == 0:
        _wait_until_read(peers, time.monotonic() + wait_s)
    if earlier:  # this error is likely a consequence (a collective's peer gone)
        pid = min(earlier)
        _leave(
            f"Process {pid} of {count} failed: {earlier[pid]}. Process {me} stops too (its own "
            f"error came after: {reason})."
        )
    _leave(f"Process {me} of {count} failed: {reason}. The other processes stop too.")


def _wait_until_read(peers: _Peers, deadline: float) -> None:
    """Until every other process has read the error (or failed itself), or ``deadline``."""
    others = set(range(peers.count)) - {peers.me}
    while time.monotonic() < deadline:
        try:
            if peers.seen() | set(peers.failures()) >= others:
                return
        except Exception:
            return
        time.sleep(0.05)


def _watch(peers: _Peers, done: threading.Event, poll_s: float, lost_after_s: float = 10.0):
    """The thread of ``stop_together``: stops this process when another one has failed, or
    when the key-value store has not answered for ``lost_after_s`` (process 0 is gone)."""
    me, count = peers.me, peers.count
    answered = time.monotonic()
    while not done.wait(poll_s):
        try:
            failed = peers.failures()
        except Exception as e:
            if time.monotonic() - answered > lost_after_s and not done.is_set():
                _leave(
                    f"Process {me} of {count}: the coordinator (process 0) has not answered for "
                    f"{lost_after_s:.0f} s ({e}); process 0 has stopped or cannot be reached. "
                    "See its log; this process stops too."
                )
            continue
        answered = time.monotonic()
        if failed and not done.is_set():
            pid = min(failed)
            with contextlib.suppress(Exception):
                peers.client.key_value_set(f"{_SEEN}{me}", "1", allow_overwrite=True)
            _leave(
                f"Process {pid} of {count} failed: {failed[pid]}. Process {me} stops too "
                f"(see process {pid}'s log for where it failed)."
            )
