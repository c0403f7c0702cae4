"""A workdir's config.json: the first config of a run, kept, and each later launch checked
against it.

``record_config``: the first launch writes ``workdir/config.json``; a later launch is compared
with it, changes of fields that cannot alter the trained weights (``SAFE_FIELDS``) are recorded
in ``workdir/config_changes.json``, any other change is refused (``ConfigChangedError``) unless
``checkpoint.allow_config_change`` forces it. ``recorded_config`` and ``flags_to_match`` read a
workdir's config back, for the evaluation engines and for messages that say which flags give
the recorded model. jssl.checkpoints.workdir runs ``record_config`` under the workdir's lock.
"""

from __future__ import annotations

import datetime
import fnmatch
import json
import os
import shlex
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

CONFIG_FILE = "config.json"
CHANGES_FILE = "config_changes.json"

# Fields whose change cannot change what the run trains, so resuming under a new value is
# allowed (and recorded). Everything not listed is refused, since it changes the model, the
# data or its order, the optimizer or its schedule, or the method:
#   num_epochs: the cosine/multistep schedule and the lr at every step derive from it;
#   seed: the data order and the augmentations; data.*: which examples, their views and
#   order (data.cache is the exception: it only keeps the same examples in memory);
#   probe.*: the probe's parameters live in the TrainState; init.*: weights a restart
#   without a checkpoint would start from; model.dtype: the numerics of every step.
SAFE_FIELDS = (
    "log_every_steps",  # logging cadence
    "test_every_epochs",  # when the test phase runs; it never touches the TrainState
    "eval_outputs",  # whether the test phase writes per-example outputs
    "debug.*",  # NaN checks, profiling, and max_steps (an early stop; schedule unchanged)
    "checkpoint.every_steps",  # when to save, not what is trained
    "checkpoint.max_to_keep",
    "checkpoint.async_save",
    "checkpoint.allow_config_change",
    "monitor.*",  # the collapse alarm reads the step's metrics, never the state
    "evals.*",  # evaluators read saved checkpoints, never the training state
    "linear.report_all",  # a linear evaluation's extra records, not its training
    "linear.extra_test_sets",
    "evaluate.*",
    "knn.*",  # the kNN monitor only reads the trunk (a changed one no longer matches
    # knn_random_init.json, computed once at the start of the workdir)
    "data.cache",  # the same examples, kept in memory or not
    "data.workers",  # how many processes make the same batches
    "data.data_dir",  # the same dataset found at another path (a moved or staged copy)
    "compilation_cache_dir",  # where compiled steps are cached, not what they compute
    "parallel.*",  # how the state is laid out over the devices, not its values
    # Which trunk blocks are recomputed in the backward pass: memory only, the same parameter
    # names and results (jssl.models.remat; tests/models/test_remat.py).
    "model.remat",
    # The ViT's attention implementation (XLA's or cuDNN's, with its masked token padding): the
    # same parameters and function, float rounding apart (tests/models/test_vit_attention.py);
    # "auto" already picks per machine, so a resume on other hardware may change it.
    "model.attention",
    "verify.*",  # engine=verify's steps and tolerances; training never reads them
)


class ConfigChangedError(ValueError):
    pass


def process_0_failed(failed: bool) -> bool:
    """Process 0's ``failed`` on every process, so that all of them stop together (every
    process calls this at the same point; a no-op in a single-process run)."""
    if jax.process_count() == 1:
        return failed
    return bool(multihost_utils.broadcast_one_to_all(np.asarray(failed, np.int32)))


def flatten(config: ml_collections.ConfigDict | dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": value}`` of a config, values as JSON gives them back (tuples are lists)."""
    tree = config
    if isinstance(config, ml_collections.ConfigDict):
        tree = json.loads(config.to_json_best_effort(sort_keys=True))
    flat: dict[str, Any] = {}

    def visit(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                visit(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            flat[prefix] = node

    visit("", tree)
    return flat


# Model fields that fix how the weights are computed with, not what they are: a workdir's
# values are not carried to an evaluation of its checkpoints (which may run elsewhere).
NUMERICS = ("model.dtype", "model.attention")


def flags_to_match(
    path: str, config: ml_collections.ConfigDict, prefix: str = "model."
) -> list[str]:
    """``--config.<field>=<value>`` flags that set ``config``'s ``prefix`` fields to those
    recorded in the config.json of the jssl workdir that holds ``path`` (the workdir itself,
    its checkpoints dir or a checkpoint in it), for a message to show ready to paste. Empty
    when ``path`` is in no workdir or nothing differs; the NUMERICS fields are left out
    (weights fit whatever the compute dtype and attention kernel)."""
    recorded = recorded_config(path)
    current = flatten(config)
    flags = []
    for field, value in sorted(recorded.items()):
        if not field.startswith(prefix) or field in NUMERICS or field not in current:
            continue
        if not same_value(value, current[field]):
            flags.append(f"--config.{field}={shlex.quote(flag_value(value))}")
    return flags


def recorded_config(path: str) -> dict[str, Any]:
    """The flattened config.json of the workdir at or up to three levels above ``path``."""
    here = os.path.abspath(os.path.expanduser(path))
    for _ in range(4):
        candidate = os.path.join(here, CONFIG_FILE)
        if os.path.isfile(candidate):
            try:
                with open(candidate) as f:
                    return flatten(json.load(f))
            except (OSError, ValueError):
                return {}
        here = os.path.dirname(here)
    return {}


def flag_value(value: Any) -> str:
    """A JSON value as ml_collections' command-line flags parse it back."""
    if isinstance(value, list):
        return repr(tuple(value))
    return str(value)


def is_safe(field: str) -> bool:
    return any(fnmatch.fnmatchcase(field, pattern) for pattern in SAFE_FIELDS)


_ABSENT = "<absent>"


def record_config(
    config: ml_collections.ConfigDict, workdir: str, *, resuming: bool, force: bool
) -> list[str]:
    """Keeps the first config of ``workdir`` and checks a later launch against it.

    The first launch writes ``workdir/config.json``, which is never overwritten. A later
    launch (a resume, or a restart of a run that died before its first checkpoint) is
    compared with the config in effect: config.json with the changes already recorded in
    ``config_changes.json`` applied. Changes of ``SAFE_FIELDS`` are logged and recorded;
    any other change raises ConfigChangedError unless ``force``
    (``checkpoint.allow_config_change``), in which case it is recorded too. Returns the
    changes as ``"field: old -> new"`` lines (empty when the config is the same).

    In a multi-process run only process 0 reads, decides and writes; the others (which call
    this at the same point) raise with it or return [].
    """
    if jax.process_index() != 0:
        if process_0_failed(False):
            raise ConfigChangedError(
                f"Process 0 refused this launch on {workdir}: its config differs from the "
                "workdir's (see process 0's log)."
            )
        return []
    try:
        lines = _record_config(config, workdir, resuming=resuming, force=force)
    except BaseException:
        process_0_failed(True)
        raise
    process_0_failed(False)
    return lines


def _record_config(
    config: ml_collections.ConfigDict, workdir: str, *, resuming: bool, force: bool
) -> list[str]:
    path = os.path.join(workdir, CONFIG_FILE)
    new = flatten(config)
    if not os.path.exists(path):
        if resuming:
            logging.warning(
                "%s has checkpoints but no %s; recording this config as its config.",
                workdir,
                CONFIG_FILE,
            )
        _write_json(path, json.loads(config.to_json_best_effort(sort_keys=True)))
        return []
    with open(path) as f:
        original = flatten(json.load(f))
    changes_path = os.path.join(workdir, CHANGES_FILE)
    history = _load_changes(changes_path)
    effective = dict(original)
    for entry in history:
        for field, change in entry["changes"].items():
            if change["new"] == _ABSENT:
                effective.pop(field, None)
            else:
                effective[field] = change["new"]

    differing = sorted(
        f
        for f in effective.keys() | new.keys()
        if not same_value(effective.get(f, _ABSENT), new.get(f, _ABSENT))
    )
    if not differing:
        return []
    lines = [_change_line(f, effective.get(f, _ABSENT), new.get(f, _ABSENT)) for f in differing]
    # A field only one side has comes from another jssl version (a field added with a default
    # that keeps the old behaviour, or one removed): recorded, never refused.
    unsafe = [
        line
        for f, line in zip(differing, lines, strict=True)
        if not is_safe(f) and f in effective and f in new
    ]
    kind = "resume" if resuming else "restart (no checkpoint yet)"
    if unsafe and not force:
        raise ConfigChangedError(
            f"This {kind} of {workdir} uses a config that differs from the workdir's in "
            f"field(s) that change what is trained:\n  " + "\n  ".join(unsafe) + "\n"
            f"The original config is in {path}"
            + (f" (with the changes recorded in {changes_path})" if history else "")
            + ". Rerun with the original values, or pass another --workdir to start a new "
            "run, or force this change with --config.checkpoint.allow_config_change=True "
            "(it is recorded in the workdir)."
        )
    entry = {
        "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "resuming": resuming,
        "forced": bool(unsafe),
        "changes": {
            f: {"old": effective.get(f, _ABSENT), "new": new.get(f, _ABSENT)} for f in differing
        },
    }
    _write_json(changes_path, [*history, entry])
    log = logging.warning if unsafe else logging.info
    log(
        "Config of %s changed since its last launch (%s; recorded in %s):\n  %s",
        workdir,
        "FORCED with checkpoint.allow_config_change" if unsafe else "fields safe to change",
        changes_path,
        "\n  ".join(lines),
    )
    return lines


def same_value(old: Any, new: Any) -> bool:
    """Equal values; a scalar also equals the one-element list of it (augmentation
    probabilities became per-crop-group tuples, so older workdirs hold scalars)."""
    if isinstance(old, list) and len(old) == 1 and not isinstance(new, list):
        old = old[0]
    if isinstance(new, list) and len(new) == 1 and not isinstance(old, list):
        new = new[0]
    return old == new


def _change_line(field: str, old: Any, new: Any) -> str:
    def show(value: Any) -> str:
        return value if value == _ABSENT else json.dumps(value)

    return f"{field}: {show(old)} -> {show(new)}"


def _load_changes(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, value: Any) -> None:
    """Writes ``value`` atomically (a temporary file renamed over ``path``)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
