"""SSL methods. Each is a module ``jssl.methods.<name>`` exposing ``make(config) -> Method``.

A Method bundles pure functions that the one generic train step calls (DESIGN.md, "The method
interface"). ``loss`` and ``after_update`` run per replica inside ``jax.shard_map`` over the
``data`` axis, so they may use named collectives (``jax.lax.all_gather(x, "data")``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

import ml_collections

METHODS = ("moco",)


class Method(NamedTuple):
    # (rng, sample_images) -> TrainState fields: dict(params, batch_stats, ema_params,
    # ema_batch_stats, method_state); the optimizer state is added by the caller.
    init: Callable[..., dict[str, Any]]
    # (params, state, batch, rng, train) -> (loss, (metrics, updates)); differentiated w.r.t.
    # params. ``updates`` carries what after_update needs (new BN statistics, keys, ...) and,
    # for the generic step and monitors, "features" (stop-gradient trunk avgpool of the first
    # view: the online probe's input), "embeddings" (head output) and "per_example_loss".
    loss: Callable[..., Any]
    # (state, updates) -> state, after the optimizer step: EMA teacher, queues, BN statistics.
    after_update: Callable[..., Any]
    # The flax module whose taps the evaluation reads (online trunk + heads).
    model: Any


def _module(config: ml_collections.ConfigDict):
    name = config.method.name
    if name not in METHODS:
        raise ValueError(
            f"method.name={name!r} is not one of the methods jssl has: {', '.join(METHODS)}. "
            "Pick one with --config=configs/<method>.py (or --config.method.name)."
        )
    return importlib.import_module(f"jssl.methods.{name}")


def check_config(config: ml_collections.ConfigDict) -> None:
    """The method's start-up checks (``check_config`` of its module, where it has one)."""
    module = _module(config)
    if hasattr(module, "check_config"):
        module.check_config(config)


def get(config: ml_collections.ConfigDict) -> Method:
    """Imports ``jssl.methods.<config.method.name>`` and builds its Method."""
    return _module(config).make(config)
