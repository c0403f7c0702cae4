"""The evaluate engine: every evaluator of ``config.evals`` on one checkpoint, or on each
checkpoint of a training workdir as it appears (VISSL's benchmark-suite scheduler).

``init.checkpoint`` is a jssl workdir (read at its newest complete checkpoint, by its step dir,
so that every record carries the step), a ``checkpoints/<step>`` dir or a weights file. With
``evaluate.follow=True`` each checkpoint is evaluated as the training saves it, until the
training writes ``train_finished.json``; one gone or silent ends the follower with an error
(jssl.engines.evaluate_follow). Evaluators that read extracted features share one extraction
per checkpoint and dataset (``evals/step_<n>/features_<k>``, removed unless
``evaluate.keep_features``). ``results.json`` holds one timeline row per checkpoint, each
evaluator's own results are under ``evals/step_<n>/<name>/``; a rerun runs only what is not
done, and SIGTERM stops it between evaluators with exit status 75. The train engine runs the
same evaluators on its own checkpoints (``after_epoch``). More: docs/evaluation.md,
"Evaluators as config".
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from jssl.checkpoints import manager
from jssl.engines import evaluate_follow as follow
from jssl.evaluation import evaluators
from jssl.evaluation.results import load_json, make_writer, write_results
from jssl.training import preemption

FINISHED_FILE = follow.FINISHED_FILE  # written by the train engine when its last step is done


def validate(config: ml_collections.ConfigDict) -> None:
    """Start-up checks: at least one evaluator, each entry's type and fields, the engines'
    own checks for the evaluators that run the trunk, the settings of those that read
    extracted features (their files are checked once extracted), and the follow fields."""
    if not config.get("evals"):
        raise ValueError(
            "engine='evaluate' runs config.evals, which is empty: start from "
            "--config=configs/evaluate.py:demo (or add entries with configs/evaluate.py's "
            "entry(type))."
        )
    if not config.init.checkpoint:
        raise ValueError(
            "engine='evaluate' evaluates a trained model: set --config.init.checkpoint to a jssl "
            "workdir, a checkpoints/<step> dir or a .torch/.pth file."
        )
    evaluators.check(config)
    e = config.evaluate
    for field in ("poll_seconds", "idle_minutes"):
        value = e[field]
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"evaluate.{field}={value!r} must be a number > 0.")
    if e.follow and not os.path.isdir(os.path.expanduser(config.init.checkpoint)):
        raise ValueError(
            f"evaluate.follow=True follows a training workdir; init.checkpoint="
            f"{config.init.checkpoint!r} is not a directory."
        )
    from jssl import engines
    from jssl.evaluation import svm

    for name, _, evaluator in evaluators.entries(config):
        sub = evaluators.engine_config(config, name, config.init.checkpoint)
        if evaluator.features:
            if "svm" in evaluator.sections:
                svm.check_settings(sub.svm)
        else:
            engines.validate(sub)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Evaluates ``init.checkpoint`` (or follows it); returns what results.json holds, plus
    ``preempted`` when SIGTERM or a first Ctrl-C stopped it between two evaluators or polls
    (a rerun continues). A follower that stops before the training finished raises
    evaluate_follow.FollowError, after evaluating and writing every complete checkpoint."""
    validate(config)
    results = load_json(os.path.join(workdir, "results.json")) or {}
    timeline = results.get("timeline", [])
    writer = make_writer(workdir)
    with preemption.Preemption() as stop_request:
        if config.evaluate.follow:
            evaluate_at = functools.partial(at_checkpoint, config, workdir, writer=writer)
            timeline, preempted, problem = follow.follow(config, workdir, timeline, evaluate_at)
        else:
            checkpoint = evaluators.resolve(config.init.checkpoint)
            row = at_checkpoint(config, workdir, checkpoint, writer=writer)
            preempted, problem = bool(row.get("preempted")), ""
            if not preempted:
                timeline = [r for r in timeline if r["checkpoint"] != row["checkpoint"]] + [row]
    writer.flush()
    out = {"evaluator": "evaluate", "source": os.path.abspath(config.init.checkpoint)}
    out["timeline"] = timeline
    write_results(workdir, out)
    if jax.process_index() == 0:
        print(summary_table(timeline), flush=True)
    if preempted:
        logging.warning(
            "Stopped by %s with every finished evaluation kept in %s; rerun the same command "
            "to continue (exit status %d).",
            stop_request.signal_name or "SIGTERM",
            workdir,
            preemption.PREEMPTED_EXIT_CODE,
        )
        return dict(out, preempted=True)
    if problem:
        raise follow.FollowError(problem)
    return out


HEADLINES = ("top1", "mAP", "mean", "nmi", "ari", "accuracy", "loss")  # the figures the table shows


def summary_table(timeline: list) -> str:
    """The log's summary: one line per headline figure of every evaluator and checkpoint,
    with the step, the dataset and split it was read from (results.json has the rest)."""
    lines = ["step    evaluator   figure                          value  data"]
    for row in timeline:
        for name, record in row.get("evals", {}).items():
            protocol = record["protocol"]
            sections = [v for v in protocol["settings"].values() if isinstance(v, dict)]
            split = protocol.get("split") or next(
                (v["test_split"] for v in sections if v.get("test_split")), ""
            )
            data = f"{protocol['dataset']['name']} {split}".strip()
            for figure, value in evaluators.figures(record["results"]).items():
                parts = figure.split("/")
                if parts[-1] in HEADLINES and "value" not in parts:  # value: a repeat
                    step = row.get("checkpoint_step")
                    lines.append(
                        f"{step if step is not None else '-':<7} {name:<11} {figure:<31} "
                        f"{value:6.2f}  {data}"
                    )
    return "\n".join(lines)


def at_checkpoint(
    config: ml_collections.ConfigDict,
    workdir: str,
    checkpoint: str,
    *,
    writer: Any = None,
    epoch: int | None = None,
    last: bool = True,
) -> dict[str, Any]:
    """Every due evaluator of ``config.evals`` on ``checkpoint`` (a step dir or weights file):
    the timeline row ``{"checkpoint", "checkpoint_step", "evals"}``. ``epoch`` (training):
    only entries due after that epoch run (``evaluators.due``), on the run's own model. A stop
    request (SIGTERM, a first Ctrl-C) ends it between two evaluators, or inside one that
    stops on it: the row then has ``"preempted": True`` and the finished evaluators only
    (each keeps its results.json, so a rerun runs the others)."""
    training = epoch is not None
    step = evaluators.checkpoint_step(checkpoint)
    tag = f"step_{step}" if step is not None else os.path.basename(checkpoint.rstrip("/"))
    base = os.path.join(workdir, "evals", tag)
    names = [
        name
        for name, entry, _ in evaluators.entries(config)
        if not training or evaluators.due(entry, epoch, last)
    ]
    row: dict[str, Any] = {"checkpoint": os.path.abspath(checkpoint), "checkpoint_step": step}
    row["evals"] = {}
    todo = [n for n in names if load_json(os.path.join(base, n, "results.json")) is None]
    features = _extract(config, base, checkpoint, todo, training)
    if features is None:  # the extraction stopped on a stop request
        return dict(row, preempted=True)
    from jssl import engines

    for name in names:
        evaluator = evaluators.get(config.evals[name], name)
        sub = evaluators.engine_config(config, name, checkpoint, training=training)
        if evaluator.features and name in todo:
            sub[evaluator.features].features_dir = features[_group(sub)]
        out_dir = os.path.join(base, name)
        done = load_json(os.path.join(out_dir, "results.json"))
        if done is None:
            if preemption.stop_agreed():
                return dict(row, preempted=True)
            engines.validate(sub)
            logging.info("Evaluating %s (%s) on %s", name, sub.engine, checkpoint)
            done = engines.engine_function(sub.engine)(sub, out_dir)
            if done.get("preempted"):  # stopped inside; its own rerun continues it
                return dict(row, preempted=True)
            done = {k: v for k, v in done.items() if k != "state"}
        record = {"protocol": evaluators.protocol(sub, name, evaluator, training)}
        # What the engine itself read (the test loss: the trained run's data) wins.
        own = {k: v for k, v in done.get("protocol", {}).items() if k not in ("evaluator", "mode")}
        record["protocol"].update(own)
        record["results"] = _jsonable(done)
        row["evals"][name] = record
        scalars = evaluators.figures(record["results"], f"evals/{name}/")
        if writer is not None and scalars:
            writer.write_scalars(step if step is not None else 0, scalars)
        shown = ", ".join(f"{k.split('/', 2)[2]} {v:.2f}" for k, v in list(scalars.items())[:6])
        logging.info("%s at step %s: %s", name, step, shown)
    if not config.evaluate.get("keep_features", False):
        for directory in set(features.values()):
            if jax.process_index() == 0:
                shutil.rmtree(directory, ignore_errors=True)
    return row


def validate_in_training(config: ml_collections.ConfigDict) -> None:
    """The train engine's start-up checks of its ``evals`` (the model is the run's own)."""
    from jssl.evaluation import svm

    evaluators.check(config, training=True)
    for name, _, evaluator in evaluators.entries(config):
        sub = evaluators.engine_config(config, name, "", training=True)
        if evaluator.features:
            if "svm" in evaluator.sections:
                svm.check_settings(sub.svm)
        elif evaluator.engine == "knn":
            from jssl.engines import knn

            knn.check_config(sub)
        elif evaluator.engine == "test_loss":
            from jssl.engines import test_loss

            test_loss.check_settings(sub)
        _check_splits(sub, name, evaluator)


def _check_splits(sub: ml_collections.ConfigDict, name: str, evaluator) -> None:
    """Every split an evaluator will read resolves now, not after the first epoch's save."""
    from jssl import data

    section = evaluator.features or ("knn" if evaluator.engine == "knn" else "data")
    fields = ("train_split", "test_split")
    if evaluator.engine == "test_loss":
        section, fields = "test_loss", ("split",)
    for field in fields:
        split = sub[section][field]
        if not split:
            continue
        try:
            data.num_examples(sub.data, split)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(
                f"evals.{name}: {section}.{field}={split!r} cannot be read ({e}); fix "
                f"--config.evals.{name}.{section}.{field} or remove the entry."
            ) from e


def after_epoch(
    config: ml_collections.ConfigDict, workdir: str, step: int, epoch: int, last: bool, writer
) -> None:
    """Inside training, after epoch ``epoch``'s checkpoint (step ``step``) is saved: the due
    evaluators on it, their figures in the run's TensorBoard at ``step`` and a timeline row
    in ``workdir/evals/results.json``."""
    if not any(evaluators.due(e, epoch, last) for _, e, _ in evaluators.entries(config)):
        return
    step_dir = os.path.join(manager.checkpoint_dir(workdir), str(step))
    row = at_checkpoint(config, workdir, step_dir, writer=writer, epoch=epoch, last=last)
    if row.get("preempted"):  # the train loop stops at its next step on the same request
        logging.warning(
            "The evaluators after epoch %d were stopped by a stop request before %s finished; "
            "training resumes after this checkpoint and does not run them again: run "
            "engine=evaluate with --config.init.checkpoint=%s for them.",
            epoch,
            ", ".join(sorted(set(config.evals) - set(row["evals"]))),
            step_dir,
        )
    path = os.path.join(workdir, "evals", "results.json")
    timeline = (load_json(path) or {}).get("timeline", [])
    timeline = [r for r in timeline if r["checkpoint_step"] != step] + [row]
    write_results(os.path.dirname(path), {"evaluator": "evaluate", "timeline": timeline})


def mark_finished(workdir: str, step: int) -> None:
    """The train engine's last word: a follower (``evaluate.follow``) stops after ``step``."""
    if jax.process_index() == 0:
        with open(os.path.join(workdir, FINISHED_FILE), "w") as f:
            json.dump({"step": int(step), "time": time.time()}, f)


def pool_of(spec: str, layers) -> str:
    """An extraction's pooling spec cut to ``layers``: a per-layer spec ("res4=avg;res5=avg")
    keeps only theirs (extraction refuses pooling for a layer it does not extract)."""
    if not isinstance(spec, str) or "=" not in spec:
        return spec
    items = [item.strip() for item in spec.split(";") if item.strip()]
    kept = [item for item in items if item.split("=", 1)[0].strip() in set(layers)]
    return ";".join(kept) or "none"


def _group(sub: ml_collections.ConfigDict) -> str:
    """Evaluators whose data and extraction settings agree share one extraction."""
    d, e = sub.data, sub.extract
    return json.dumps(
        [d.source, d.name, d.data_dir, d.image_size, e.pool, e.batch_size], default=str
    )


def _extract(
    config: ml_collections.ConfigDict, base: str, checkpoint: str, names, training: bool
) -> dict[str, str]:
    """One ``extract_features`` run per group of feature-reading evaluators: the union of
    their layers and splits. Returns ``{group: features workdir}``, None when a stop request
    ended an extraction."""
    from jssl.engines import extract_features

    groups: dict[str, tuple[ml_collections.ConfigDict, set, set]] = {}
    for name in names:
        evaluator = evaluators.get(config.evals[name], name)
        if not evaluator.features:
            continue
        sub = evaluators.engine_config(config, name, checkpoint, training=training)
        section = sub[evaluator.features]
        first, layers, splits = groups.setdefault(_group(sub), (sub, set(), set()))
        layers.update(section.layers)
        splits.update(s for s in (section.train_split, section.test_split) if s)
    out = {}
    for number, (key, (sub, layers, splits)) in enumerate(sorted(groups.items())):
        directory = os.path.join(base, f"features_{number}")
        out[key] = directory
        ext = copy.deepcopy(sub)
        ext.engine = "extract_features"
        ext.extract.layers = tuple(sorted(layers))
        ext.extract.pool = pool_of(ext.extract.pool, layers)
        ext.extract.splits = tuple(sorted(splits))
        logging.info(
            "Extracting %s of %s from %s", ext.extract.layers, ext.extract.splits, checkpoint
        )
        extract_features.validate(ext)
        # Splits extracted before an interruption are kept (extract_features.run).
        if extract_features.run(ext, directory).get("preempted"):
            return None
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value
