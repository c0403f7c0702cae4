"""linear_eval's epoch/step loop (jssl.engines.loop) with a fake step: when it logs, saves,
tests and stops, and where a resume starts. The engines' own runs are in test_train.py (whose
flat loop keeps the same schedule, checked there end to end) and
tests/evaluation/test_linear.py."""

import numpy as np
import pytest

from jssl.checkpoints.manager import DataPosition
from jssl.engines import loop


class _Recorder:
    """Hooks that record what the loop asked for; the state is the number of steps trained."""

    def __init__(self, steps_per_epoch: int, stop_after: int | None = None):
        self.steps_per_epoch = steps_per_epoch
        self.stop_after = stop_after  # the step whose metrics first carry the stop flag
        self.events: list[tuple] = []

    def hooks(self, **extra) -> loop.Hooks:
        return loop.Hooks(
            batches=self.batches,
            step=self.step,
            write_metrics=self.write_metrics,
            save=self.save,
            test=self.test,
            **extra,
        )

    def batches(self, epoch, start):
        self.events.append(("epoch", epoch, start))
        return iter([{"x": np.zeros(1)}] * (self.steps_per_epoch - start))

    def step(self, state, batch, steps_done):
        assert state == steps_done
        stop = self.stop_after is not None and state + 1 >= self.stop_after
        return state + 1, {"loss": np.float32(state + 1), "stop": np.int32(stop)}

    def write_metrics(self, state, progress, window):
        self.events.append(("log", progress.step, len(window), window.mean()))

    def save(self, state, position, force):
        self.events.append(("save", state, position.epoch, position.step_in_epoch, force))

    def test(self, state, step, epochs):
        self.events.append(("test", step, epochs))

    def of(self, kind):
        return [e[1:] for e in self.events if e[0] == kind]


class _Writer:
    def write_scalars(self, step, scalars):
        pass


def _plan(**overrides) -> loop.Plan:
    fields = dict(
        steps_per_epoch=4,
        num_epochs=3,
        max_steps=12,
        log_every_steps=3,
        checkpoint_every_steps=3,
        test_every_epochs=2,
    )
    fields.update(overrides)
    return loop.Plan(**fields)


def test_position_after_rolls_over_at_the_end_of_an_epoch():
    assert loop.position_after(0, 2, 4) == DataPosition(0, 3)
    assert loop.position_after(0, 3, 4) == DataPosition(1, 0)


def test_logs_saves_and_tests_on_schedule():
    hooks = _Recorder(4)
    run = loop.Loop(_plan(), hooks.hooks(), _Writer())
    state, step = run.run(0, DataPosition(), 0)
    assert (state, step, run.stopped) == (12, 12, False)
    assert hooks.of("epoch") == [(0, 0), (1, 0), (2, 0)]
    # Windows end every 3 steps and start again with each epoch (the steps after an epoch's
    # last full window are not written); "stop" is the loop's flag, not a metric.
    logs = hooks.of("log")
    assert [(s, n) for s, n, _ in logs] == [(3, 3), (6, 2), (9, 1), (12, 3)]
    assert logs[0][2] == {"loss": 2.0}
    # Every 3 steps, except where the end of the epoch saves anyway (forced): step 12.
    assert hooks.of("save") == [
        (3, 0, 3, False),
        (4, 1, 0, True),
        (6, 1, 2, False),
        (8, 2, 0, True),
        (9, 2, 1, False),
        (12, 3, 0, True),
    ]
    assert hooks.of("test") == [(8, 2)]


def test_partial_windows_written_at_epoch_end_on_request():
    hooks = _Recorder(4)
    run = loop.Loop(_plan(), hooks.hooks(), _Writer(), write_window_at_epoch_end=True)
    run.run(0, DataPosition(), 0)
    windows = [(s, n) for s, n, _ in hooks.of("log")]
    assert windows == [(3, 3), (4, 1), (6, 2), (8, 2), (9, 1), (12, 3)]


def test_max_steps_ends_mid_epoch_and_a_rerun_trains_nothing():
    hooks = _Recorder(4)
    plan = _plan(max_steps=6)
    state, step = loop.Loop(plan, hooks.hooks(), _Writer()).run(0, DataPosition(), 0)
    assert step == 6
    assert [s for s, _, _ in hooks.of("log")] == [3, 6]
    assert hooks.of("save")[-1] == (6, 1, 2, True)
    assert hooks.of("test") == []
    again = _Recorder(4)
    assert loop.Loop(plan, again.hooks(), _Writer()).run(6, DataPosition(1, 2), 6) == (6, 6)
    assert again.events == []


def test_resume_starts_at_the_saved_batch():
    hooks = _Recorder(4)
    state, step = loop.Loop(_plan(), hooks.hooks(), _Writer()).run(6, DataPosition(1, 2), 6)
    assert step == 12
    assert hooks.of("epoch") == [(1, 2), (2, 0)]
    assert hooks.of("test") == [(8, 2)]


@pytest.mark.parametrize("flag_at", [2, 4, 7])
def test_agreed_stop_ends_one_step_after_the_flag_with_a_forced_save(flag_at):
    hooks = _Recorder(4, stop_after=flag_at)
    run = loop.Loop(_plan(), hooks.hooks(), _Writer(), agreed_stop=True)
    state, step = run.run(0, DataPosition(), 0)
    # The flag of a step is read after the next one, or at the end of the epoch.
    expected = flag_at if flag_at % 4 == 0 else flag_at + 1
    assert run.stopped and step == expected
    assert hooks.of("save")[-1][0] == expected and hooks.of("save")[-1][-1] is True
    assert all(t[0] < expected for t in hooks.of("test"))


def test_without_agreed_stop_the_flag_is_ignored():
    hooks = _Recorder(4, stop_after=2)
    run = loop.Loop(_plan(), hooks.hooks(), _Writer())
    assert run.run(0, DataPosition(), 0) == (12, 12) and not run.stopped


def test_end_of_epoch_runs_before_the_epoch_checkpoint():
    hooks = _Recorder(4)
    extra = {"end_of_epoch": lambda epoch, step: hooks.events.append(("end", epoch, step))}
    loop.Loop(_plan(num_epochs=1, max_steps=4), hooks.hooks(**extra), _Writer()).run(
        0, DataPosition(), 0
    )
    kinds = [e[0] for e in hooks.events]
    assert kinds[-2:] == ["end", "save"] and hooks.of("end") == [(0, 4)]
