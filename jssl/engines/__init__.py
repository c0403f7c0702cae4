"""Engines: what a run does with a config. ``config.engine`` names one; each is a module
``jssl.engines.<name>`` with ``run(config, workdir) -> dict``."""

from __future__ import annotations

import importlib
from typing import Any

import ml_collections

ENGINES = ("train", "extract_features", "knn", "linear_eval")


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    name = config.engine
    if name not in ENGINES:
        raise ValueError(f"engine={name!r} is not one of {ENGINES}; set --config.engine.")
    module = {"extract_features": "extract", "knn": "evaluate", "linear_eval": "evaluate"}
    engine = importlib.import_module(f"jssl.engines.{module.get(name, name)}")
    return getattr(engine, "run_" + name if name in module else "run")(config, workdir)
