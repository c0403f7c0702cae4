"""The verify engine: does this config train the same on every device as on one device, and the
same across a kill and resume?

The first ``verify.steps`` global batches of the config are trained three ways: A, the config as
given on every device (its ``parallel.shard_params`` and ``optim.accumulation_steps``); B, one
device, the state replicated, no accumulation, each step from A's state before it; C, A saved
after ``steps // 2``, restored into a fresh state as a relaunch does, and continued from the
restored data position. After every step B's and C's loss and state are compared with A's; the
table goes to the log and ``workdir/verify.json``. Why B starts each step from A's state, and how
to read the table: docs/operations.md, "Checking a config: verify".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from jssl import data, methods, parallel
from jssl.checkpoints import manager as checkpoint
from jssl.checkpoints import warm_start
from jssl.engines import train
from jssl.training import batches as batches_lib
from jssl.training import probe
from jssl.training import state as train_state
from jssl.training.fresh import init_state
from jssl.training.progress import Plan, Progress

RESULTS_FILE = "verify.json"
RESUME_DIR = "resumed"  # workdir/resumed/checkpoints: C's checkpoint
COMPARED = {"one_device": "the 1-device step", "resumed": "the resumed run"}
# The parts of the TrainState compared; step, rng and the non-finite flag are equal by design.
SAME = ("step", "rng", "nonfinite_step")
PARTS = tuple(f.name for f in dataclasses.fields(train_state.TrainState) if f.name not in SAME)


def validate(config: ml_collections.ConfigDict) -> None:
    """The train engine's start-up checks and verify's own; each names the field to change."""
    if jax.process_count() > 1:
        raise ValueError(
            f"engine=verify runs in one process, not {jax.process_count()}: run it on one host "
            "(without --coordinator_address or srun); it uses every device of that host."
        )
    steps = config.verify.steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(
            f"verify.steps={steps!r} must be an integer >= 2 (the resumed run is saved after "
            "steps // 2): set --config.verify.steps=4."
        )
    for field in ("rtol", "atol"):
        value = config.verify[field]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"verify.{field}={value!r} must be a number >= 0.")
    train.validate(config)


@dataclasses.dataclass
class _Run:
    """One compared run: its mesh, compiled step, state, and the loss of its last step."""

    mesh: Any
    step: Callable
    state: Any
    loss: float | None = None

    def train(self, host_batch: dict) -> None:
        host_batch = {k: v for k, v in host_batch.items() if k != "replaced"}  # skip_corrupt
        batch = parallel.host_batch_to_global(host_batch, self.mesh)
        self.state, metrics = self.step(self.state, batch)
        self.loss = float(metrics["loss"])


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains and compares A, B and C (see the module docstring); writes and returns the
    report, whose ``passed`` is False when a difference is beyond the tolerance."""
    validate(config)
    probe.check_num_classes(config)
    steps, half = config.verify.steps, config.verify.steps // 2
    plan = Plan.from_config(config, data.steps_per_epoch(config.data))
    if steps > plan.total_steps:
        raise ValueError(
            f"verify.steps={steps} is more than the config's {plan.total_steps} steps "
            f"({plan.num_epochs} epochs of {plan.steps_per_epoch}): lower --config.verify.steps."
        )
    reference = config.copy_and_resolve_references()
    reference.parallel.shard_params = False
    reference.optim.accumulation_steps = 1
    as_given, fresh_state = _start(config, parallel.make_mesh(), plan)
    one_device = _start(reference, parallel.make_mesh(jax.local_devices()[:1]), plan)[0]
    one_device_layout = jax.tree.map(lambda x: x.sharding, one_device.state)
    runs = {"one_device": one_device}
    rows = [_row(0, as_given, runs, config.verify)]  # B's own initial state against A's
    batches = batches_lib.pipeline_batches(config, checkpoint.DataPosition(), plan)
    resumed_batches = None
    for step, (epoch, index, host_batch) in zip(range(1, steps + 1), batches, strict=False):
        one_device.state = jax.device_put(jax.device_get(as_given.state), one_device_layout)
        as_given.train(host_batch)
        one_device.train(host_batch)
        if resumed_batches is not None:
            runs["resumed"].train(next(resumed_batches)[2])
        if step == half:
            position = Progress.after(step, epoch, index, plan).next
            runs["resumed"], position = _save_and_restore(
                config, workdir, as_given, fresh_state, position
            )
            resumed_batches = batches_lib.pipeline_batches(config, position, plan)
        rows.append(_row(step, as_given, runs, config.verify))
    report = _report(config, as_given, rows, half)
    path = os.path.join(workdir, RESULTS_FILE)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    logging.info("verify: %s\n%s", path, _table(report))
    if report["passed"]:
        logging.info("verify PASSED: B and C match A within the tolerance.")
    else:
        logging.error("%s", report["message"])
    return report


def _start(config: ml_collections.ConfigDict, mesh, plan: Plan):
    """A run of ``config`` over ``mesh`` at step 0, built as the train engine builds it, and a
    function that gives a fresh state to restore into."""
    method = methods.get(config, plan.steps_per_epoch)
    tx, schedule = train.make_optimizer(config, method, plan.steps_per_epoch)
    state = init_state(config, method, tx, mesh)
    if config.init.checkpoint:
        state = warm_start.init_train_state(config, state)
    step = train.make_step(config, method, tx, schedule, mesh, state)
    return _Run(mesh, step, state), lambda: init_state(config, method, tx, mesh)


def _save_and_restore(config, workdir: str, run: _Run, fresh_state, position):
    """C: ``run``'s state and data position through an orbax checkpoint and back into a fresh
    state, by the train engine's save and resume (the compiled step is the same program)."""
    directory = os.path.join(workdir, RESUME_DIR)
    shutil.rmtree(directory, ignore_errors=True)  # verify's own, from an earlier launch
    manager = checkpoint.make_manager(directory, max_to_keep=0, async_save=False)
    with checkpoint.closing(manager):
        checkpoint.save(manager, run.state, position, force=True)
    manager, state, position, resumed = checkpoint.resume(
        directory, config.checkpoint, fresh_state()
    )
    manager.close()
    if not resumed:
        raise RuntimeError(f"verify: the checkpoint in {directory} was not restored.")
    return _Run(run.mesh, run.step, state), position


def _ratio(a: float, b: float) -> float:
    """a / b, with 0 / 0 = 0, and infinite for NaN or x / 0 (so that NaN and inf fail)."""
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return a / b if b else (0.0 if a == 0 else math.inf)


def _difference(x, y, tolerance) -> dict[str, Any]:
    """``x`` (a loss, or one part of a state) against ``y``: ``rel`` ``||x - y|| / ||y||``,
    ``excess`` that over ``atol + rtol * ||y||`` (at most 1 passes), ``abs`` the largest
    ``|x - y|`` and the ``leaf`` it is in."""
    named = jax.tree_util.tree_flatten_with_path(y)[0]
    diffs = {
        jax.tree_util.keystr(path, simple=True, separator="/"): np.asarray(a, np.float64) - b
        for (path, b), a in zip(named, jax.tree.leaves(x), strict=True)
    }
    norm = lambda arrays: float(np.sqrt(sum(np.sum(np.square(a)) for a in arrays)))  # noqa: E731
    diff, scale = norm(diffs.values()), norm(np.asarray(b, np.float64) for _, b in named)
    largest = {k: float(np.nan_to_num(np.max(np.abs(d)), nan=np.inf)) for k, d in diffs.items()}
    leaf = max(largest, key=largest.get)
    excess = _ratio(diff, tolerance.atol + tolerance.rtol * scale)
    return {"rel": _ratio(diff, scale), "excess": excess, "abs": largest[leaf], "leaf": leaf}


def _row(step: int, as_given: _Run, runs: dict[str, _Run], tolerance) -> dict[str, Any]:
    """The runs' losses after ``step``, and B's and C's loss and state parts against A's;
    ``state`` is the part furthest from the tolerance."""
    reference = jax.device_get(as_given.state)
    row: dict[str, Any] = {"step": step, "loss": {"as_given": as_given.loss}}
    for name, other in runs.items():
        row["loss"][name] = other.loss  # None for C at the step it was restored at
        state, parts = jax.device_get(other.state), {}
        for part in PARTS:
            if jax.tree.leaves(getattr(reference, part)):
                d = _difference(getattr(state, part), getattr(reference, part), tolerance)
                parts[part] = dict(d, leaf=f"{part}/{d['leaf']}" if d["abs"] else "-")
        loss = None
        if as_given.loss is not None and other.loss is not None:
            loss = _difference(other.loss, as_given.loss, tolerance)
        worst = max(({**d, "part": p} for p, d in parts.items()), key=lambda d: d["excess"])
        beyond = [p for p, d in {"loss": loss, **parts}.items() if d and d["excess"] > 1]
        row[name] = {"loss": loss, "state": worst, "parts": parts, "beyond": beyond}
    return row


def expected_differences(config: ml_collections.ConfigDict, devices: int, batch_norm: bool):
    """What makes B differ from A by design for this config (docs/operations.md)."""
    notes, micro = [], config.optim.accumulation_steps
    if batch_norm and not config.model.sync_bn and devices > 1:
        notes.append(
            f"model.sync_bn=False: batch norm normalises each device's "
            f"{config.data.batch_size // devices} examples on their own, so results depend on "
            f"the device count; --config.model.sync_bn=True normalises the global batch."
        )
    if batch_norm and micro > 1:
        notes.append(
            f"optim.accumulation_steps={micro} with batch norm: each micro-batch is normalised "
            "on its own (docs/operations.md, 'Batches larger than the devices hold')."
        )
    if config.model.dtype == "bfloat16":
        notes.append(
            "model.dtype=bfloat16: bf16 rounding follows the order of the sums, which devices "
            "and micro-batches change; --config.model.dtype=float32 checks the rest."
        )
    return notes


def _report(config, as_given: _Run, rows: list[dict], half: int) -> dict[str, Any]:
    report = {"steps": config.verify.steps, "resumed_after": half, "devices": as_given.mesh.size}
    report.update(
        shard_params=config.parallel.shard_params,
        accumulation_steps=config.optim.accumulation_steps,
        rtol=config.verify.rtol,
        atol=config.verify.atol,
        expected_differences=expected_differences(
            config, as_given.mesh.size, bool(jax.tree.leaves(as_given.state.batch_stats))
        ),
        worst={},
    )
    for name in COMPARED:
        compared = [row for row in rows if name in row]
        failing = [r["step"] for r in compared if r[name]["beyond"]]
        losses = [{**r[name]["loss"], "step": r["step"]} for r in compared if r[name]["loss"]]
        states = [{**r[name]["state"], "step": r["step"]} for r in compared]
        report["worst"][name] = {
            "first_failing_step": failing[0] if failing else None,
            "loss": max(losses, key=lambda d: d["excess"]),
            "state": max(states, key=lambda d: d["excess"]),
        }
    report["passed"] = all(w["first_failing_step"] is None for w in report["worst"].values())
    report["verdict"] = "pass" if report["passed"] else "fail"
    report["message"] = "" if report["passed"] else _failure_message(report, rows)
    return dict(report, rows=rows)


def _failure_message(report: dict, rows: list[dict]) -> str:
    lines = [f"verify FAILED (rtol={report['rtol']}, atol={report['atol']}; {RESULTS_FILE}):"]
    for name, what in COMPARED.items():
        worst, first = report["worst"][name], report["worst"][name]["first_failing_step"]
        if first is not None:
            loss, state, beyond = worst["loss"], worst["state"], rows[first][name]["beyond"]
            lines.append(
                f"- {what} differs from A from step {first} (in {', '.join(beyond)}); at most "
                f"the loss by {loss['rel']:.1e} (relative, step {loss['step']}), {state['part']} "
                f"by {state['rel']:.1e} (step {state['step']}, largest in {state['leaf']})."
            )
    if report["worst"]["one_device"]["first_failing_step"] is not None:
        notes = report["expected_differences"]
        lines += ["Different by design for this config:"] + [f"  {n}" for n in notes]
        if not notes:
            lines[-1] = (
                "No cause by design applies (sync_bn=False on several devices, batch norm or "
                "drop path with accumulation, bfloat16), and float32 sums in another order "
                "differ by about 1e-6: please report it with verify.json."
            )
    if report["worst"]["resumed"]["first_failing_step"] is not None:
        lines.append(
            "A resumed run must continue exactly: this is a checkpoint or data-position bug, "
            "or non-deterministic kernels (XLA_FLAGS=--xla_gpu_deterministic_ops=true on GPU)."
        )
    return "\n".join(lines)


def _table(report: dict) -> str:
    def rel(difference: dict | None) -> str:
        if difference is None:
            return "-"
        return f"{difference['rel']:.1e}" + ("*" if difference["excess"] > 1 else "")

    lines = [
        f"A: as given on {report['devices']} devices (parallel.shard_params="
        f"{report['shard_params']}, optim.accumulation_steps={report['accumulation_steps']}); "
        "B: 1 device, replicated, no accumulation, each step from A's state; C: A saved after "
        f"step {report['resumed_after']}, restored into a fresh state and continued.",
        "Relative differences from A (state: the part furthest from the tolerance, with the "
        f"leaf of its largest difference); * beyond rtol={report['rtol']}, atol={report['atol']}.",
        f"{'step':>4} {'loss A':>10} {'loss B':>10} {'loss C':>10} {'B loss':>8} {'B state':>8} "
        f"{'C loss':>8} {'C state':>8}  largest B | C",
    ]
    for row in report["rows"]:
        losses = [row["loss"].get(n) for n in ("as_given", *COMPARED)]
        compared = [row.get(name) or {"loss": None, "state": None} for name in COMPARED]
        lines.append(
            f"{row['step']:>4} "
            + " ".join("-".rjust(10) if v is None else f"{v:>10.6f}" for v in losses)
            + "".join(f" {rel(c['loss']):>8} {rel(c['state']):>8}" for c in compared)
            + "  "
            + " | ".join(c["state"]["leaf"] if c["state"] else "-" for c in compared)
        )
    return "\n".join(lines)
