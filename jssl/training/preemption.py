"""Stop requests for long runs (SIGTERM, a first Ctrl-C): save once, on every process, at the
same step, then exit with a status that says "stopped, rerun to resume" (75).

A scheduler delivers SIGTERM to the processes of a multi-host run at different moments; if each
acted on its own flag, one could enter a checkpoint save (a collective) while another enters
the next train step (another collective), and both would hang. So in training the flag travels
through the step: each process feeds its own in (``jssl.training.step.stop_flags``), the step
returns their maximum over all devices as ``metrics["stop"]``, and the loop acts on that agreed
value alone, read one step late so that the check costs no extra host sync. Loops with no step
agree through one collective (``agreed``); engines with nothing to save stop where they are
(``stop_at_once``). A second Ctrl-C stops at once, without saving. An engine run by another
(evaluators of the evaluate engine or of training) enters its own ``Preemption`` inside the
caller's, and a request reaches both. More: docs/operations.md, "Preemption and exit codes".
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry". The launcher
# exits with it when a run stopped on SIGTERM (or a first Ctrl-C) after saving its
# checkpoint; rerunning the same command resumes. 0 still means "finished", anything else a
# failure.
PREEMPTED_EXIT_CODE = 75

_NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C (SIGINT)"}
_ACTIVE: list[Preemption] = []  # the entered contexts, outermost first


class Preemption:
    """Turns SIGTERM and a first Ctrl-C into a flag; ``requested`` is this process's view,
    not the agreed one, and ``signal_name`` says which signal asked ("" before any)."""

    def __init__(self):
        self.requested = False
        self.signal_name = ""
        self._interrupts = 0  # Ctrl-Cs so far
        self._previous: dict[int, object] = {}

    def _stop_after_saving(self, signum, frame) -> None:
        again = ""
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt(
                    "Ctrl-C pressed twice: stopped at once, without saving the current step. "
                    "The checkpoints saved before stay; rerun the same command to resume."
                )
            again = " Press Ctrl-C again to stop at once, without saving."
        logging.warning(
            "%s received: stopping at the step all processes agree on, saving what is done "
            "and exiting with status %d; rerun the same command to resume.%s",
            _NAMES[signum],
            PREEMPTED_EXIT_CODE,
            again,
        )
        self.requested = True
        self.signal_name = self.signal_name or _NAMES[signum]

    def __enter__(self) -> Preemption:
        if _ACTIVE:
            self._take(_ACTIVE[-1])
        _ACTIVE.append(self)
        for signum in _NAMES:
            try:
                self._previous[signum] = signal.signal(signum, self._stop_after_saving)
            except ValueError:  # not the main thread (e.g. called from a test thread)
                pass
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        _ACTIVE.remove(self)
        if _ACTIVE:
            _ACTIVE[-1]._take(self)

    def _take(self, other: Preemption) -> None:
        """Adopts ``other``'s request (and its Ctrl-C count: a second one stops at once)."""
        self.requested = self.requested or other.requested
        self.signal_name = self.signal_name or other.signal_name
        self._interrupts = max(self._interrupts, other._interrupts)


class StopNow(BaseException):
    """SIGTERM or a first Ctrl-C in an engine that keeps nothing it could save part of (kNN,
    the SVMs, k-means, the test loss, verify, export): raised where the engine is, before it
    has written its results, so a rerun starts it again. A BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` of the engine takes it for a failure."""


@contextlib.contextmanager
def stop_at_once() -> Iterator[None]:
    """Inside it, SIGTERM and a first Ctrl-C raise ``StopNow``; inside another engine's
    ``Preemption`` (an evaluator run by evaluate or by training) it changes nothing: that
    engine stops after this one, as it has agreed with the other processes."""
    if _ACTIVE:
        yield
        return

    def stop(signum, frame) -> None:
        raise StopNow(
            f"{_NAMES[signum]} received: stopped before writing any result; exit status "
            f"{PREEMPTED_EXIT_CODE}. Rerun the same command to run it again."
        )

    previous = {}
    for signum in _NAMES:
        try:
            previous[signum] = signal.signal(signum, stop)
        except ValueError:  # not the main thread
            pass
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def agreed(requested: bool) -> bool:
    """Whether any process asked to stop, the same answer on every process: for loops with no
    step to carry the flag (``process_allgather``, a collective: every process calls it at
    the same point of the loop; free on one process)."""
    if jax.process_count() == 1:
        return requested
    return bool(np.max(multihost_utils.process_allgather(np.int32(requested))))


def stop_agreed() -> bool:
    """``agreed`` for the innermost Preemption entered (False outside any): for engines run
    by another engine, between two pieces of work (every process calls it at the same point)."""
    return agreed(bool(_ACTIVE) and _ACTIVE[-1].requested)


def requested_here() -> bool:
    """This process's own view of the innermost Preemption's request (no collective): for
    cutting a wait short, the agreed decision then taken by ``stop_agreed``."""
    return bool(_ACTIVE) and _ACTIVE[-1].requested
