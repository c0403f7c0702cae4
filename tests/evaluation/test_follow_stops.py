"""How a follower (``evaluate.follow=True``) stops when its training will not finish: the
training is gone (no process holds its workdir lock, no train_finished.json), the workdir
never had a checkpoint, or the training runs but saves nothing for ``evaluate.idle_minutes``.
Each ends with an error saying so (exit status 1) after every complete checkpoint there is
evaluated, never with exit status 0 and an empty timeline, and a dead training is noticed
within two polls, not after the idle limit. Also SIGTERM during a follower."""

import json
import os
import shutil
import signal
import time

import pytest
from support.runs import tiny_trained_workdir

from configs import evaluate as evaluate_config
from jssl import engines
from jssl.checkpoints import workdir as workdir_lib
from jssl.engines import evaluate, evaluate_follow
from jssl.engines import knn as knn_engine


@pytest.fixture(scope="module")
def killed_training(tmp_path_factory):
    """A training workdir with a checkpoint (step 2) and no train_finished.json: a training
    that stopped without finishing. No process holds its lock."""
    workdir = tiny_trained_workdir(tmp_path_factory)
    os.remove(os.path.join(workdir, evaluate.FINISHED_FILE))
    return workdir


def _follow_config(shared_dirs, source, idle_minutes=120.0):
    config = evaluate_config.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.init.checkpoint = str(source)
    del config.evals["svm"], config.evals["cluster"]  # kNN alone: cheap
    config.evaluate.follow = True
    config.evaluate.poll_seconds = 1
    with config.unlocked():  # the field is an int (1 in this preset); a fraction of a minute
        del config.evaluate["idle_minutes"]
        config.evaluate.idle_minutes = idle_minutes
    return config


def test_a_dead_training_is_noticed_within_two_polls(shared_dirs, killed_training, tmp_path):
    workdir = str(tmp_path / "follow")
    start = time.monotonic()
    with pytest.raises(evaluate_follow.FollowError) as info:
        engines.run(_follow_config(shared_dirs, killed_training), workdir)
    message = str(info.value)
    assert f"the training in {killed_training} stopped without finishing" in message
    assert "no process holds its lock" in message and "the last at step 2" in message
    assert "Rerun the training" in message and "rerun this command" in message
    assert time.monotonic() - start < 100  # the idle limit is 120 minutes
    # What was there is evaluated and written before the error.
    with open(os.path.join(workdir, "results.json")) as f:
        (row,) = json.load(f)["timeline"]
    assert row["checkpoint_step"] == 2 and "top1" in json.dumps(row["evals"]["knn"])


def test_a_running_training_that_saves_nothing_within_the_idle_limit(
    shared_dirs, killed_training, tmp_path
):
    config = _follow_config(shared_dirs, killed_training, idle_minutes=0.002)
    with workdir_lib.lock(killed_training):  # the training runs (this process holds its lock)
        with pytest.raises(evaluate_follow.FollowError) as info:
            engines.run(config, str(tmp_path / "follow"))
    message = str(info.value)
    assert "no new checkpoint in" in message and "while its training still runs" in message
    assert f"process {os.getpid()} on host" in message
    assert "--config.evaluate.idle_minutes" in message


@pytest.mark.parametrize("finished", [False, True])
def test_a_workdir_without_any_checkpoint_is_an_error(shared_dirs, tmp_path, finished):
    source = tmp_path / "never_saved"
    source.mkdir()
    if finished:
        (source / evaluate.FINISHED_FILE).write_text(json.dumps({"step": 3}))
    # idle_minutes small enough that the code before this fix returned (exit status 0).
    config = _follow_config(shared_dirs, source, idle_minutes=0.002)
    with pytest.raises(evaluate_follow.FollowError) as info:
        engines.run(config, str(tmp_path / "follow"))
    message = str(info.value)
    assert f"{source} has no checkpoint to evaluate" in message
    assert "--config.checkpoint.every_steps" in message
    assert ("finished at step 3" in message) == finished


def test_sigterm_stops_a_follower_between_evaluators_and_a_rerun_goes_on(
    shared_dirs, killed_training, tmp_path, monkeypatch
):
    source = str(tmp_path / "finished")
    shutil.copytree(killed_training, source)
    evaluate.mark_finished(source, 2)
    config = _follow_config(shared_dirs, source)
    config.evals.knn_again = evaluate_config.entry("knn", "test")
    calls = []
    run_knn = knn_engine.run

    def knn_with_sigterm(sub, out_dir):
        calls.append(os.path.basename(out_dir))
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the first evaluator runs
        return run_knn(sub, out_dir)

    monkeypatch.setattr(knn_engine, "run", knn_with_sigterm)
    workdir = str(tmp_path / "follow")
    stopped = engines.run(config, workdir)
    assert engines.exit_status(stopped) == 75 and stopped["timeline"] == []
    assert calls == ["knn"]  # the second was not started; the first kept its results
    assert os.path.exists(os.path.join(workdir, "evals", "step_2", "knn", "results.json"))

    again = engines.run(config, workdir)
    assert engines.exit_status(again) == 0 and calls == ["knn", "knn_again"]
    (row,) = again["timeline"]
    assert row["checkpoint_step"] == 2 and set(row["evals"]) == {"knn", "knn_again"}
