"""Where a run's batches start and end (jssl.training.batches.positioned and
progress.position_after), as the train engine's and linear_eval's flat loops read them. Their
schedules (when they log, save, test and stop) are checked end to end in test_train.py and
tests/evaluation/test_linear.py."""

import itertools

from jssl.checkpoints.manager import DataPosition
from jssl.training.batches import positioned
from jssl.training.progress import Plan, position_after


def _plan(**overrides) -> Plan:
    fields = dict(steps_per_epoch=4, num_epochs=3, max_steps=12, log_every_steps=3)
    fields.update(overrides)
    return Plan(**fields)


class _Epochs:
    """``epoch_batches`` that records which epoch was asked for from which batch."""

    def __init__(self, steps_per_epoch: int):
        self.steps_per_epoch = steps_per_epoch
        self.asked: list[tuple[int, int]] = []

    def __call__(self, epoch: int, start: int):
        self.asked.append((epoch, start))
        return iter([{"epoch": epoch, "index": i} for i in range(start, self.steps_per_epoch)])


def test_position_after_rolls_over_at_the_end_of_an_epoch():
    assert position_after(0, 2, 4) == DataPosition(0, 3)
    assert position_after(0, 3, 4) == DataPosition(1, 0)


def test_every_batch_of_every_epoch_once_with_its_position():
    epochs = _Epochs(4)
    seen = list(positioned(epochs, DataPosition(), _plan()))
    assert [(e, i) for e, i, _ in seen] == [(e, i) for e in range(3) for i in range(4)]
    assert all(b == {"epoch": e, "index": i} for e, i, b in seen)
    assert epochs.asked == [(0, 0), (1, 0), (2, 0)]


def test_resume_starts_at_the_saved_batch():
    epochs = _Epochs(4)
    seen = [(e, i) for e, i, _ in positioned(epochs, DataPosition(1, 2), _plan())]
    assert seen[0] == (1, 2) and len(seen) == 6
    assert epochs.asked == [(1, 2), (2, 0)]


def test_an_epoch_is_built_only_when_its_first_batch_is_read():
    """A loop that stops at max_steps mid-epoch (zip with its step range) never builds the
    next epoch's pipeline, and a finished run builds none."""
    epochs = _Epochs(4)
    list(zip(range(1, 7), positioned(epochs, DataPosition(), _plan()), strict=False))
    assert epochs.asked == [(0, 0), (1, 0)]
    again = _Epochs(4)
    list(zip(range(7, 7), positioned(again, DataPosition(1, 2), _plan()), strict=False))
    assert again.asked == []
    done = _Epochs(4)
    assert list(itertools.islice(positioned(done, DataPosition(3, 0), _plan()), 1)) == []
    assert done.asked == []
