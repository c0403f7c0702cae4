"""Engines: what a run does with a config. ``config.engine`` names one; each is a module
``jssl.engines.<name>`` with ``run(config, workdir) -> dict``."""

from __future__ import annotations

import importlib
from typing import Any

import ml_collections

from jssl import workdir as workdir_lib

ENGINES = ("train", "extract_features", "knn", "linear_eval")


def exit_status(summary: dict[str, Any]) -> int:
    """The process exit status for an engine's summary: 0 when it finished, 75
    (``preemption.PREEMPTED_EXIT_CODE``) when it stopped on SIGTERM after saving, so that a
    scheduler or wrapper script knows to rerun the same command to resume."""
    from jssl.engines import preemption

    return preemption.PREEMPTED_EXIT_CODE if summary.get("preempted") else 0


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    name = config.engine
    if name not in ENGINES:
        raise ValueError(f"engine={name!r} is not one of {ENGINES}; set --config.engine.")
    module = {"extract_features": "extract", "knn": "evaluate", "linear_eval": "evaluate"}
    engine = importlib.import_module(f"jssl.engines.{module.get(name, name)}")
    run_engine = getattr(engine, "run_" + name if name in module else "run")
    if name == "extract_features":
        # Extraction may read the training run's own workdir (its config stays as it is);
        # the lock keeps it from running beside that training, or beside another extraction.
        with workdir_lib.lock(workdir):
            return run_engine(config, workdir)
    # One run per workdir at a time, and the workdir's first config kept and enforced
    # (a resumed run must not change what it trains; see jssl.workdir.SAFE_FIELDS).
    with workdir_lib.open_run(config, workdir):
        return run_engine(config, workdir)
