"""Host batches put on the devices ahead of the step that trains on them, and the time the
loop still waits for them.

``DevicePrefetch`` pulls (epoch, index, host batch) from an iterator in a background thread and
copies each batch onto the devices there, ``ahead`` batches before the loop asks for it, so that
reading, decoding and copying overlap the step. flax's ``jax_utils.prefetch_to_device`` and
big_vision's ``input_pipeline.prefetch_iterator`` keep batches ahead in the caller's thread,
which overlaps the copy but not the iterator's own Python work (a caller's loader, the
pipeline's hand-over); the thread here overlaps both. What the loop waits for in spite of it is
``waited``, and ``interval_scalars`` / ``DataWaitAlarm`` turn that into the ``perf/`` scalars
and the warning of docs/operations.md "Feeding the accelerator".
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from absl import logging

AHEAD = 2  # batches on the devices before the step asks for them: one to hide a slow batch
JOIN_SECONDS = 10.0  # how long ``close`` waits for a thread busy inside the iterator
WARN_FRACTION = 0.1  # more of a log interval than this spent waiting for data: the warning
WARN_EVERY_SECONDS = 600.0  # at most one warning per this many seconds of a run

_END = object()  # the iterator is exhausted


@dataclasses.dataclass(frozen=True)
class _Failure:
    """An exception of the thread, handed to the loop at the batch it was raised for."""

    error: BaseException


class DevicePrefetch:
    """Iterates (epoch, index, host batch, device batch) in the order of ``batches``, where the
    device batch is ``to_devices(host batch)``, made in a daemon thread at most ``ahead`` batches
    before it is asked for. An exception of the iterator or of ``to_devices`` is raised by
    ``next`` at the batch it was raised for, with its own type and traceback. ``close`` (also
    on leaving a ``with``) stops the thread; ``waited`` is the seconds ``next`` has blocked."""

    def __init__(
        self,
        batches: Iterator[tuple[int, int, dict]],
        to_devices: Callable[[dict], Any],
        *,
        ahead: int = AHEAD,
    ):
        if ahead < 1:
            raise ValueError(f"ahead={ahead} must be at least 1 batch.")
        self.waited = 0.0
        self._batches = batches
        self._to_devices = to_devices
        self._ready: queue.Queue = queue.Queue()
        self._free_slots = threading.Semaphore(ahead)  # taken before a batch is read
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._fill, name="jssl-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self) -> DevicePrefetch:
        return self

    def __next__(self) -> tuple[int, int, dict, Any]:
        if self._done:
            raise StopIteration
        start = time.perf_counter()
        item = self._ready.get()
        self.waited += time.perf_counter() - start
        if item is _END or isinstance(item, _Failure):
            self._done = True
            if item is _END:
                raise StopIteration
            raise item.error
        self._free_slots.release()
        return item

    def _fill(self) -> None:
        """The thread: reads and copies a batch whenever fewer than ``ahead`` wait."""
        try:
            while True:
                self._free_slots.acquire()
                if self._stop.is_set():
                    return
                item = next(self._batches, _END)
                if item is _END:
                    self._ready.put(_END)
                    return
                epoch, index, host_batch = item
                self._ready.put((epoch, index, host_batch, self._to_devices(host_batch)))
        except BaseException as error:  # everything reaches the loop, which decides
            self._ready.put(_Failure(error))

    def close(self) -> None:
        """Stops the thread and drops the batches it made ahead. A thread still inside the
        iterator after ``JOIN_SECONDS`` is left to finish on its own (a daemon: it does not
        keep the process alive)."""
        self._done = True
        self._stop.set()
        self._free_slots.release()  # wakes a thread waiting for a slot
        self._thread.join(JOIN_SECONDS)
        if self._thread.is_alive():
            logging.warning(
                "The batch iterator did not return within %.0f s of the run's end; its thread "
                "is left to finish in the background.",
                JOIN_SECONDS,
            )
        while not self._ready.empty():  # the device batches made ahead, freed now
            self._ready.get_nowait()

    def __enter__(self) -> DevicePrefetch:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def interval_scalars(*, images: int, wall: float, waited: float) -> dict[str, float]:
    """The ``perf/`` scalars of a log interval of ``wall`` seconds that trained ``images`` and
    waited ``waited`` seconds for its batches: the fraction waited, images/s end to end, and
    images/s of the time not waited (what the input would allow if it never stalled)."""
    wall = max(wall, 1e-9)
    return {
        "perf/data_wait_fraction": min(waited / wall, 1.0),
        "perf/images_per_sec": images / wall,
        "perf/step_images_per_sec": images / max(wall - waited, 1e-9),
    }


@dataclasses.dataclass
class DataWaitAlarm:
    """Warns when the loop waited for data more than ``WARN_FRACTION`` of a log interval, at the
    first such interval and then at most once per ``WARN_EVERY_SECONDS`` of the run. The run's
    first interval is left out: its wait holds the pipeline's start-up (the first batch), which
    none of the warning's fixes shortens, next to a step that may have come from the cache."""

    every_seconds: float = WARN_EVERY_SECONDS
    last_warned: float | None = None
    intervals: int = 0  # checked so far

    def check(self, step: int, fraction: float) -> bool:
        """Logs the warning for the interval ending at ``step`` when due; whether it did."""
        self.intervals += 1
        if fraction <= WARN_FRACTION or self.intervals == 1:
            return False
        now = time.monotonic()
        if self.last_warned is not None and now - self.last_warned < self.every_seconds:
            return False
        self.last_warned = now
        logging.warning(starved_message(step, fraction))
        return True


def starved_message(step: int, fraction: float) -> str:
    """What the warning says: how much the loop waited, and the fixes in the order to try."""
    return (
        f"Step {step}: the accelerator waited for data {fraction:.0%} of the last log interval "
        f"(perf/data_wait_fraction; above {WARN_FRACTION:.0%}). To feed it faster: more loader "
        "processes (--config.data.workers=N), the colour augmentations on the accelerator "
        "(--config.data.augment.on_device=True), images stored pre-resized (e.g. ImageNet at "
        'a 256 px shorter side). See docs/operations.md, "Feeding the accelerator".'
    )
