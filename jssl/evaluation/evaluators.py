"""Evaluators as configuration: the registry of evaluator types (``EVALUATORS``) and how one
``config.evals`` entry becomes the config of the engine that computes it (big_vision's
``config.evals`` is the model).

An entry is a dict with ``type``, ``every_epochs`` (inside training: after every n-th epoch's
checkpoint; 0: after the last only) and the config sections it sets, built whole by
``configs/evaluate.py``'s ``entry(type, preset)``. Its sections replace the running config's
(the evaluator's own) or are laid over it (any other field: ``data``, ``optim``,
``num_epochs``; the run's ``model`` and ``seed`` unless set), so an evaluator can read another
dataset than the one trained on. An evaluator is an engine (``validate(config)``,
``run(config, workdir) -> dict``); those that read extracted features share one
``extract_features`` pass per checkpoint and dataset. Adding one is its engine module, one line
here and its ``entry``. More: docs/evaluation.md, "Evaluators as config".
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import ml_collections

from jssl.data.sources import DEMO_NAME


@dataclasses.dataclass(frozen=True)
class Evaluator:
    engine: str  # jssl.engines.<engine> computes it
    sections: tuple[str, ...]  # the config sections its settings live in
    # The section whose features_dir, layers and splits name extracted features ("": the
    # evaluator runs the trunk itself); its entry's ``extract`` section says how to extract.
    features: str = ""
    selection: str = ""  # how its reported figure is chosen (results.json's protocol)


EVALUATORS: dict[str, Evaluator] = {
    "knn": Evaluator(
        "knn",
        ("knn",),
        selection="every k of knn.ks reported on the test split; nothing is chosen",
    ),
    "linear": Evaluator(
        "linear_eval",
        ("linear",),
        selection="as the linear engine records it next to each layer's figures (selection)",
    ),
    "svm": Evaluator(
        "svm",
        ("svm", "extract"),
        features="svm",
        selection="each class's cost by cross-validation on the train split",
    ),
    "low_shot": Evaluator(
        "low_shot",
        ("svm", "low_shot", "extract"),
        features="svm",
        selection="mean and spread over low_shot.num_samples seeded samples per k",
    ),
    "cluster": Evaluator(
        "cluster",
        ("cluster", "extract"),
        features="cluster",
        selection="the k-means restart of lowest inertia on the train split",
    ),
    "test_loss": Evaluator(
        "test_loss",
        ("test_loss",),
        selection="the loss averaged over every example of the split once; nothing is chosen",
    ),
}

CONTROL_FIELDS = ("type", "every_epochs")  # an entry's fields that are not config sections


def get(entry: Mapping[str, Any], name: str) -> Evaluator:
    kind = entry.get("type", "")
    if kind not in EVALUATORS:
        raise ValueError(
            f"evals.{name}.type={kind!r} is not one of {tuple(EVALUATORS)}; build the entry "
            "with configs/evaluate.py's entry(type) (see docs/evaluation.md)."
        )
    return EVALUATORS[kind]


def entries(config: ml_collections.ConfigDict) -> Iterator[tuple[str, Any, Evaluator]]:
    """``(name, entry, evaluator)`` of every ``config.evals`` entry, in name order."""
    evals = config.get("evals") or {}
    for name in sorted(evals):
        yield name, evals[name], get(evals[name], name)


def check(config: ml_collections.ConfigDict, *, training: bool = False) -> None:
    """Start-up checks of ``config.evals``: known types, ``every_epochs`` an integer >= 0,
    every section the evaluator reads present, and every field an entry sets known to the
    config it overlays (so a typo is named before anything runs)."""
    for name, entry, evaluator in entries(config):
        every = entry.get("every_epochs", 0)
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(
                f"evals.{name}.every_epochs={every!r} must be an integer >= 0 (0: after the "
                "last epoch only)."
            )
        for section in evaluator.sections:
            if section not in entry and section not in config:
                raise ValueError(
                    f"evals.{name} (type {entry['type']!r}) has no {section} section; build it "
                    f"with configs/evaluate.py's entry({entry['type']!r})."
                )
        engine_config(config, name, "", training=training)


def engine_config(
    config: ml_collections.ConfigDict, name: str, checkpoint: str, *, training: bool = False
) -> ml_collections.ConfigDict:
    """The config the evaluator's engine runs: ``config`` with the entry's sections laid
    over it, ``engine`` set and ``init.checkpoint`` = ``checkpoint``. In training the trunk
    of the evaluated checkpoint is the run's own ``model.*`` (no adoption needed)."""
    entry = config.evals[name]
    evaluator = get(entry, name)
    sub = copy.deepcopy(config)
    with sub.unlocked():
        del sub["evals"]
        for key in entry:
            if key in CONTROL_FIELDS:
                continue
            if key in evaluator.sections:  # the entry carries the whole section
                sub[key] = copy.deepcopy(entry[key])
            else:
                _overlay(sub, key, entry[key], f"evals.{name}.{key}")
        sub.engine = evaluator.engine
        sub.init.checkpoint = checkpoint
        if training:
            sub.init.model_from_checkpoint = False
    return sub


def _overlay(target: ml_collections.ConfigDict, key: str, value: Any, path: str) -> None:
    if key not in target:
        if isinstance(value, ml_collections.ConfigDict | dict):
            target[key] = copy.deepcopy(value)
            return
        raise ValueError(f"{path}: this config has no field {key!r}; check the name.")
    current = target[key]
    if isinstance(current, ml_collections.ConfigDict):
        if not isinstance(value, ml_collections.ConfigDict | dict):
            raise ValueError(f"{path} must be a section (a dict), not {value!r}.")
        for child in value:
            _overlay(current, child, value[child], f"{path}.{child}")
        return
    try:
        target[key] = value
    except TypeError as e:
        raise ValueError(f"{path}={value!r}: {e}") from None


def due(entry: Mapping[str, Any], epoch: int, last: bool) -> bool:
    """Whether an entry runs after epoch ``epoch`` (1-based) of training; ``last``: the run's
    final epoch, after which every entry runs."""
    every = entry.get("every_epochs", 0)
    return last or (every > 0 and epoch % every == 0)


def resolve(path: str) -> str:
    """A workdir or checkpoints dir as its newest complete step dir (so that a record can
    name the step); a step dir or an imported weights file as given."""
    from jssl.checkpoints import weights

    if not path or path.endswith(weights.TORCH_SUFFIXES):
        return path
    return os.path.dirname(weights.resolve_checkpoint(path))


def checkpoint_step(path: str) -> int | None:
    """The step of a ``checkpoints/<step>`` dir (or its ``state``), None for anything else."""
    match = re.search(r"checkpoints/(\d+)(/state)?/?$", path)
    return int(match.group(1)) if match else None


def protocol(
    sub: ml_collections.ConfigDict, name: str, evaluator: Evaluator, online: bool
) -> dict[str, Any]:
    """What an evaluator's figures depend on, as results.json records it next to them."""
    d = sub.data
    record: dict[str, Any] = {
        "evaluator": name,
        "type": [k for k, v in EVALUATORS.items() if v == evaluator][0],
        "mode": (
            "inside training, on the checkpoint just saved (frozen trunk)"
            if online
            else "offline, frozen trunk"
        ),
        "checkpoint": os.path.abspath(sub.init.checkpoint) if sub.init.checkpoint else "",
        "checkpoint_step": checkpoint_step(sub.init.checkpoint),
        "dataset": {
            "source": d.source,
            "name": d.name or (DEMO_NAME if d.source == "demo" else d.source),
            "data_dir": d.data_dir,
            "image_size": d.image_size,
        },
        "trunk": sub.model.trunk,
        "settings": {s: sub[s].to_dict() for s in evaluator.sections},
        "selection": evaluator.selection,
    }
    return json.loads(json.dumps(record, default=str))  # as results.json will read back


def figures(results: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of an engine's results, flattened to ``a/b/c`` names (lists and
    protocol records left out): what TensorBoard and the timeline show."""
    out: dict[str, float] = {}
    for key, value in results.items():
        if key in ("protocol", "per_class", "reference", "chosen", "grid", "selection"):
            continue
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(figures(value, f"{name}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            if math.isfinite(value):
                out[name] = float(value)
    return out
