"""Where evaluation results go: ``workdir/results.json`` and TensorBoard scalars under
``workdir/tensorboard``, written by process 0."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
from absl import logging

from jssl.training import summaries

if TYPE_CHECKING:
    from clu import metric_writers


def write_results(workdir: str, results: Mapping[str, Any]) -> None:
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        save_json(os.path.join(workdir, "results.json"), dict(results))
        logging.info("Results written to %s", os.path.join(workdir, "results.json"))


def make_writer(workdir: str) -> metric_writers.MetricWriter:
    """The run's writer (jssl.training.summaries.create_writer: needs no TensorFlow)."""
    return summaries.create_writer(
        os.path.join(workdir, "tensorboard"), just_logging=jax.process_index() > 0
    )


def save_json(path: str, value: Any) -> None:
    """Writes ``value`` to ``path`` (process 0) through a temporary file renamed over it, so
    that a process killed mid-write leaves the previous file or none, never half of one."""
    if jax.process_index() == 0:
        temporary = f"{path}.tmp-{os.getpid()}"
        try:
            with open(temporary, "w") as f:
                json.dump(value, f, indent=2)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)


def load_json(path: str) -> Any | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
