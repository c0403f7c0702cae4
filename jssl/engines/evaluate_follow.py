"""The evaluate engine's follow mode (``evaluate.follow=True``): each complete checkpoint of
a training workdir evaluated once, oldest first, as the training saves it, until the training
has finished (the train engine writes ``train_finished.json`` after its last step).

A follower must not wait for a training that is gone: it probes the training's workdir lock
(jssl.checkpoints.workdir.lock_holder; as reliable across hosts as the file system's flock),
and when no process has held it at two polls in a row and the training did not mark itself
finished, it evaluates what is left and stops with a FollowError saying so. A workdir with
no checkpoint at all, or a training that saves none for ``evaluate.idle_minutes``, stops it
the same way, never with an empty timeline and exit status 0. A stop request (SIGTERM, a
first Ctrl-C) ends it between two checkpoints, or within one (jssl.engines.evaluate), and a
rerun of the same command goes on from its timeline.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from jssl.checkpoints import manager, weights
from jssl.checkpoints import workdir as workdir_lib
from jssl.evaluation.results import load_json, write_results
from jssl.training import preemption

FINISHED_FILE = "train_finished.json"  # written by the train engine when its last step is done


class FollowError(RuntimeError):
    """A follower stopped before the training finished (exit status 1): the training is gone,
    it wrote no checkpoint, or none came for ``evaluate.idle_minutes``."""


def follow(
    config: ml_collections.ConfigDict, workdir: str, timeline: list, evaluate_at: Callable
) -> tuple[list, bool, str]:
    """Evaluates each complete checkpoint of the followed workdir once, oldest first, until
    its training has finished. Returns (timeline, preempted, problem): ``problem`` is "" when
    the training finished, else why the follower stopped before it did: its training is gone
    (no process has held its lock at two polls in a row, so a restart in the same moment is
    not taken for an end, and it wrote no FINISHED_FILE), or no new checkpoint came for
    ``evaluate.idle_minutes``. Either way every complete checkpoint there is evaluated first."""
    source, e = config.init.checkpoint, config.evaluate
    done = {row["checkpoint_step"] for row in timeline}
    idle_since, free_polls = time.monotonic(), 0
    while True:
        steps = _agreed(_complete_steps(source))
        new = [s for s in steps if s not in done]
        for step in new:
            row = _row(evaluate_at, source, step)
            if row.get("preempted"):
                return timeline, True, ""
            timeline.append(row)
            done.add(step)
            write_results(
                workdir, {"evaluator": "evaluate", "source": source, "timeline": timeline}
            )
            idle_since, free_polls = time.monotonic(), 0
        if new:
            continue
        if preemption.stop_agreed():
            return timeline, True, ""
        finished, running, holder = _training_state(source)
        if finished is not None:
            if not steps:
                why = f"its training finished at step {finished.get('step')}"
                return timeline, False, _no_checkpoint(source, why)
            if finished.get("step") not in steps:
                logging.warning(
                    "The followed training finished at step %s, which has no checkpoint here.",
                    finished.get("step"),
                )
            else:
                logging.info("The followed training finished at step %s.", finished.get("step"))
            return timeline, False, ""
        free_polls = 0 if running else free_polls + 1
        if free_polls >= 2:
            return timeline, False, _gone(source, steps)
        if time.monotonic() - idle_since > 60 * e.idle_minutes:
            return timeline, False, _idle(source, steps, e.idle_minutes, holder)
        _sleep(e.poll_seconds)


def _row(evaluate_at: Callable, source: str, step: int) -> dict[str, Any]:
    """The timeline row of checkpoint ``step``; one the training deleted first is skipped."""
    step_dir = os.path.join(manager.checkpoint_dir(source), str(step))
    try:
        return evaluate_at(step_dir)
    except weights.WeightsError as err:
        if os.path.isdir(os.path.join(step_dir, "state")):
            raise
        logging.warning("Checkpoint %d was removed before it was evaluated: %s", step, err)
        return {"checkpoint": step_dir, "checkpoint_step": step, "skipped": "removed"}


def _training_state(source: str) -> tuple[dict | None, bool, dict]:
    """(the FINISHED_FILE record or None, whether a process holds the training's lock, the
    holder's pid and host where known), as process 0 sees them, on every process."""
    finished, holder = None, None
    if jax.process_index() == 0:
        finished = load_json(os.path.join(source, FINISHED_FILE))
        holder = workdir_lib.lock_holder(source)
    if jax.process_count() == 1:
        return finished, holder is not None, holder or {}
    step = -1 if finished is None else int(finished.get("step", -1))
    flags = np.array([finished is not None, step, holder is not None], np.int64)
    has_finished, step, held = (int(v) for v in multihost_utils.broadcast_one_to_all(flags))
    finished = finished or ({"step": None if step < 0 else step} if has_finished else None)
    return finished, bool(held), holder or {}


def _sleep(seconds: float) -> None:
    """Waits ``seconds``, cut short by a stop request (a signal does not end time.sleep)."""
    deadline = time.monotonic() + seconds
    while not preemption.requested_here() and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.5))


def _no_checkpoint(source: str, why: str) -> str:
    """The message of a followed workdir without any checkpoint: what saves one."""
    if not os.path.exists(os.path.join(source, workdir_lib.CONFIG_FILE)):
        why += f"; no training ever ran there (no {workdir_lib.CONFIG_FILE})"
    return (
        f"evaluate.follow: {source} has no checkpoint to evaluate: {why}. The train engine "
        "saves one at the end of every epoch and every --config.checkpoint.every_steps steps "
        "(0: epoch ends only), so a run stopped within its first epoch leaves none. Check "
        "--config.init.checkpoint, or rerun the training with --config.checkpoint.every_steps "
        "set (it may change on resume), then rerun this command."
    )


def _gone(source: str, steps: list[int]) -> str:
    """The message of a followed training that stopped without finishing."""
    why = (
        f"no process holds its lock ({os.path.join(source, workdir_lib.LOCK_FILE)}) and it "
        f"wrote no {FINISHED_FILE}"
    )
    if not steps:
        return _no_checkpoint(source, f"its training is not running: {why}")
    return (
        f"evaluate.follow: the training in {source} stopped without finishing: {why}. Every "
        f"complete checkpoint it left is evaluated, the last at step {steps[-1]}. Rerun the "
        "training (its same command resumes it), then rerun this command to go on following."
    )


def _idle(source: str, steps: list[int], idle_minutes: float, holder: dict) -> str:
    """The message of a follower that waited ``evaluate.idle_minutes`` for a checkpoint."""
    who = f"process {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    why = f"none came in {idle_minutes} minutes while its training runs ({who} holds its lock)"
    if not steps:
        return _no_checkpoint(source, why) + " Or raise --config.evaluate.idle_minutes."
    return (
        f"evaluate.follow: no new checkpoint in {source} for {idle_minutes} minutes while its "
        f"training still runs ({who} holds its lock); the last, step {steps[-1]}, is "
        "evaluated. Raise --config.evaluate.idle_minutes above the time between two of its "
        "saves (an epoch, or its checkpoint.every_steps), then rerun this command to go on."
    )


def _complete_steps(source: str) -> list[int]:
    directory = manager.checkpoint_dir(source)
    return [
        s
        for s in manager.saved_steps(source)
        if os.path.isdir(os.path.join(directory, str(s), "state"))
    ]


def _agreed(steps: list[int]) -> list[int]:
    """Process 0's list of steps on every process (a shared file system may show a new
    checkpoint to one process before another; the evaluations are collective)."""
    if jax.process_count() == 1:
        return steps
    padded = np.full(4096, -1, np.int64)
    padded[: min(len(steps), 4096)] = steps[-4096:]
    agreed = multihost_utils.broadcast_one_to_all(padded)
    return [int(s) for s in agreed if s >= 0]
