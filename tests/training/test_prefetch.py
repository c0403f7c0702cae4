"""The batches put on the devices ahead of their step (jssl.training.prefetch): order, errors and
the thread's end; and the data wait the train engine writes at each log step."""

import statistics
import threading
import time
import traceback

import numpy as np
import pytest
from absl import logging
from support.launch import scalar_values
from support.runs import make_config

import jssl
from jssl import data
from jssl.training import prefetch


def _numbered(count: int, read: list | None = None):
    """(epoch, index, {"x": index}) for ``count`` batches, noting each one read in ``read``."""
    for index in range(count):
        if read is not None:
            read.append(index)
        yield 0, index, {"x": np.full((2,), index)}


def test_batches_come_in_order_with_their_device_copy_and_at_most_two_ahead():
    read = []
    with prefetch.DevicePrefetch(_numbered(6, read), lambda b: b["x"] * 10) as batches:
        first = next(batches)
        time.sleep(0.2)  # time for the thread to run as far ahead as it may
        assert read == [0, 1, 2]  # the batch handed over and two ahead
        rest = list(batches)
    got = [first, *rest]
    assert [(e, i) for e, i, _, _ in got] == [(0, i) for i in range(6)]
    for _, index, host_batch, device_batch in got:
        np.testing.assert_array_equal(host_batch["x"], [index, index])
        np.testing.assert_array_equal(device_batch, [10 * index, 10 * index])
    assert next(batches, None) is None


class CorruptImageError(Exception):
    pass


def _corrupt_at(bad: int):
    for index in range(10):
        if index == bad:
            raise CorruptImageError(f"image {index} cannot be decoded")
        yield 0, index, {"x": np.zeros(1)}


def test_an_iterator_error_reaches_the_loop_at_its_batch_with_type_and_traceback():
    batches = prefetch.DevicePrefetch(_corrupt_at(3), lambda b: b)
    assert [next(batches)[1] for _ in range(3)] == [0, 1, 2]
    with pytest.raises(CorruptImageError, match="image 3") as info:
        next(batches)
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "_corrupt_at" in frames  # the thread's frames are kept
    assert next(batches, None) is None  # the error ends the iteration
    batches.close()


def test_an_error_of_the_device_copy_reaches_the_loop_too():
    def to_devices(batch):
        if batch["x"][0] == 2:
            raise ValueError("batch 2 does not split over the devices")
        return batch

    with prefetch.DevicePrefetch(_numbered(5), to_devices) as batches:
        assert [next(batches)[1] for _ in range(2)] == [0, 1]
        with pytest.raises(ValueError, match="batch 2 does not split"):
            next(batches)


def _endless(delay: float = 0.0):
    index = 0
    while True:
        time.sleep(delay)
        yield 0, index, {"x": np.zeros(1)}
        index += 1


@pytest.mark.parametrize("delay", [0.0, 0.3])  # waiting for a slot; inside the iterator
def test_closing_early_stops_the_thread_promptly(delay):
    threads = threading.active_count()
    with prefetch.DevicePrefetch(_endless(delay), lambda b: b) as batches:
        for _, index, _, _ in batches:
            if index == 1:
                break  # a preemption stop, max_steps or an error in the step
        started = time.monotonic()
    assert time.monotonic() - started < delay + 1.0
    assert not batches._thread.is_alive()
    assert threading.active_count() == threads
    assert next(batches, None) is None


def test_the_wait_is_the_time_next_blocks():
    def slow():
        for index in range(4):
            time.sleep(0.1)
            yield 0, index, {}

    with prefetch.DevicePrefetch(slow(), lambda b: b) as batches:
        started = time.perf_counter()
        assert len(list(batches)) == 4
        wall = time.perf_counter() - started
    assert 0.38 <= batches.waited <= wall


def test_interval_scalars():
    scalars = prefetch.interval_scalars(images=100, wall=2.0, waited=0.5)
    assert scalars == {
        "perf/data_wait_fraction": 0.25,
        "perf/images_per_sec": 50.0,
        "perf/step_images_per_sec": pytest.approx(100 / 1.5),
    }


def test_the_warning_names_the_fixes_and_is_rate_limited(monkeypatch):
    warnings = []
    monkeypatch.setattr(logging, "warning", lambda message, *args: warnings.append(message))
    alarm = prefetch.DataWaitAlarm(every_seconds=60)
    assert not alarm.check(5, 0.9)  # the first interval: the pipeline's start-up
    assert not alarm.check(10, 0.1)  # 10% is allowed
    assert alarm.check(20, 0.35)
    assert not alarm.check(30, 0.5)  # within a minute of the last one
    alarm.last_warned -= 61
    assert alarm.check(40, 0.5)
    assert len(warnings) == 2
    message = warnings[0]
    assert "Step 20" in message and "35%" in message
    for fix in ("--config.data.workers", "--config.data.augment.on_device=True", "256 px"):
        assert fix in message
    assert 'docs/operations.md, "Feeding the accelerator"' in message


# The engine: a run on the caller's batches, slow (a sleep in the iterator) or not.
STEPS, LOG_EVERY = 8, 2
SLEEP = 0.5  # seconds per slow batch: far longer than a step of the test preset


class SlowBatches:
    """The caller's batches, ``delay`` seconds each, with the time spent inside ``next``."""

    def __init__(self, batches: list[dict], delay: float):
        self.batches, self.delay, self.seconds = batches, delay, []

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            started = time.perf_counter()
            time.sleep(self.delay)
            self.seconds.append(time.perf_counter() - started)
            yield batch


def _train(shared_dirs, tmp_path, delay: float, monkeypatch) -> dict:
    """A run of STEPS steps on ``delay``-slow batches: its perf/ scalars, the seconds the loop
    blocked on each batch (a timer around the prefetch iterator it consumes), the seconds the
    caller's iterator took per batch, and the warnings logged."""
    config = make_config(shared_dirs, **{"knn.enabled": False, "num_epochs": 1})
    config.log_every_steps = LOG_EVERY
    dataset = data.build_train_dataset(
        config.data, seed=config.seed, epoch=0, process_index=0, process_count=1
    )
    cached = [b for b, _ in zip(dataset.as_numpy_iterator(), range(2), strict=False)]
    batches = SlowBatches([cached[i % 2] for i in range(STEPS)], delay)
    run = {"blocked": [], "warnings": []}
    untimed_next = prefetch.DevicePrefetch.__next__

    def timed_next(self):
        started = time.perf_counter()
        try:
            return untimed_next(self)
        finally:
            run["blocked"].append(time.perf_counter() - started)

    def warning(message, *args):
        run["warnings"].append(message % args if args else message)

    monkeypatch.setattr(prefetch.DevicePrefetch, "__next__", timed_next)
    monkeypatch.setattr(prefetch.logging, "warning", warning)
    workdir = str(tmp_path / f"delay{delay}")
    assert jssl.train(config, workdir, batches=batches)["step"] == STEPS
    logdir = f"{workdir}/tensorboard"
    for tag in ("data_wait_fraction", "images_per_sec", "step_images_per_sec"):
        run[tag] = scalar_values(logdir, f"perf/{tag}")
        assert sorted(run[tag]) == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY)), tag
    run["batch_seconds"] = statistics.mean(batches.seconds)
    run["images"] = LOG_EVERY * config.data.batch_size  # per log interval
    return run


def _check_against_the_timer(run: dict) -> None:
    """Each interval's fraction is the loop's blocked time over the interval's wall, and the
    step's images/s those of the wall less that time."""
    assert len(run["blocked"]) == STEPS
    for step, fraction in run["data_wait_fraction"].items():
        wall = run["images"] / run["images_per_sec"][step]
        blocked = sum(run["blocked"][step - LOG_EVERY : step])  # the interval's batches
        assert fraction == pytest.approx(blocked / wall, abs=0.02), (step, run)
        step_wall = run["images"] / run["step_images_per_sec"][step]
        assert step_wall == pytest.approx(wall - blocked, abs=0.02 * wall)


@pytest.mark.e2e
def test_the_data_wait_is_measured_and_warned_about(shared_dirs, tmp_path, monkeypatch):
    # On fast batches the loop barely waits. (A timer around its gets would also count the
    # milliseconds the prefetch thread holds the GIL, as large as a step of the test preset.)
    fast = _train(shared_dirs, tmp_path, 0.0, monkeypatch)
    assert max(fast["data_wait_fraction"].values()) < 0.05, fast
    assert not any("waited for data" in w for w in fast["warnings"]), fast["warnings"]

    slow = _train(shared_dirs, tmp_path, SLEEP, monkeypatch)
    _check_against_the_timer(slow)
    # The caller's iterator sets the pace once the batches read during compilation are used,
    # and the loop waits for most of it (its own work overlaps the read of the next batch).
    # The last two intervals: one of them may hold a step slowed by a neighbouring test.
    paces = [slow["images"] / slow["images_per_sec"][s] / LOG_EVERY for s in (STEPS - 2, STEPS)]
    assert min(paces) == pytest.approx(slow["batch_seconds"], rel=0.05), paces
    assert max(paces) < 1.5 * slow["batch_seconds"], paces
    assert min(slow["data_wait_fraction"][s] for s in (STEPS - 2, STEPS)) > 0.85, slow
    assert len([w for w in slow["warnings"] if "waited for data" in w]) == 1, slow["warnings"]
