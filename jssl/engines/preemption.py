"""SIGTERM handling for long runs: save once, on every process, at the same step, then exit
with a status that says "preempted, rerun to resume".

A scheduler delivers SIGTERM to the processes of a multi-host run at different moments. If
each process acted on its own flag, one could enter a checkpoint save (a collective) while
another enters the next train step (another collective), and both would hang. So the flag
only ever travels through the train step: each process feeds its own flag into the step
(``jssl.train_step.stop_flags``), the step returns its maximum over all devices as
``metrics["stop"]``, and the loop acts on that agreed value alone. The loop reads the flag
of the step before the one it just dispatched, so the check costs no extra host sync.
"""

from __future__ import annotations

import signal

from absl import logging

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry". launch.py
# exits with it when a run stopped on SIGTERM after saving its checkpoint; rerunning the
# same command resumes. 0 still means "finished", anything else a failure.
PREEMPTED_EXIT_CODE = 75


class Preemption:
    """Turns SIGTERM into a flag; ``requested`` is this process's view, not the agreed one."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> Preemption:
        def handler(signum, frame):
            logging.warning(
                "SIGTERM received: stopping at the step all processes agree on, saving a "
                "checkpoint and exiting with status %d.",
                PREEMPTED_EXIT_CODE,
            )
            self.requested = True

        try:
            self._previous = signal.signal(signal.SIGTERM, handler)
        except ValueError:  # not the main thread (e.g. called from a test thread)
            self._previous = None
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
