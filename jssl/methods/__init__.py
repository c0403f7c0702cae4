"""SSL methods. Each is a module ``jssl.methods.<name>`` exposing ``make(config) -> Method``.

A Method bundles pure functions that the one generic train step calls (DESIGN.md, "The method
interface"). ``loss`` and ``after_update`` run per replica inside ``jax.shard_map`` over the
``data`` axis, so they may use named collectives (``jax.lax.all_gather(x, "data")``).

The contract, typed: ``loss(params, state, batch, rng, train) -> (loss, LossOutput)``.
``LossOutput`` names what the rest of jssl reads (the generic step, the online probe, the
test phase); ``carry`` is the method's own, handed to ``after_update`` and nothing else.
What every method would otherwise repeat lives in ``jssl.methods.common``: applying the
model in train or eval mode, averaging batch-norm statistics over devices, EMA updates with
a momentum schedule. Adding a method touches its module, its config and ``METHODS`` below.

Crops. ``batch["crops"]`` holds one array per crop group of ``data.augment`` (jssl.data.crops),
``(n, crops_g, S_g, S_g, 3)`` per replica; crop numbers run over the groups in order, so SwAV's
``crops_for_assign=(0, 1)`` are the two large crops of group 0. A method either picks single
views (``common.views(batch)[c]``: MoCo's query and key) or runs the online network on every
crop with ``common.forward_crops`` (one trunk pass per resolution, the head on all crops;
outputs crop-major, ``common.split_crops`` turns them into ``(crops, n, ...)``), as SimCLR and
SwAV do. The online probe and the test phase read crop 0 (``LossOutput.features``). In the
test phase every crop is the centre-cropped eval image, resized to its group's size. A method
that needs an epoch length (SwAV's queue start) gets ``steps_per_epoch`` from the trainer; one
that freezes parameters for a while names them in ``Method.frozen_params``.

Loss terms. A method's module names its loss terms in ``TERMS``, or, where they depend on the
config, returns them from ``terms(config)`` as ``common.LossTerm``s (SwAV's and DINO's terms
per crop, the supervised method's per output); :func:`loss_terms` gives either form as
``LossTerm``s, and the start-up checks and ``configs/base.py`` ``loss_terms`` read it. The loss
returns the terms unweighted per example (``LossOutput.terms``) and combines them with
``common.weighted_loss`` under the weights of ``common.loss_weights``:
``config.loss.weights.<term>`` (on the command line ``--config.loss.weights.<term>``) and an
optional ramp ``config.loss.ramps.<term>`` (constant, linear or cosine between two values over a
range of epochs or steps), declared by the method's config with ``base.loss_terms``. A term
split per crop is a family of parts (``swapped_prediction_crop0``, ``swapped_prediction_crop1``):
each part weighs its share of the family's mean unless its own weight is set, and the family's
weight (``loss.weights.swapped_prediction``) multiplies them all, so the default total is the
single term it replaced.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import ml_collections

METHODS = (
    "moco",
    "mocov3",
    "simclr",
    "swav",
    "byol",
    "simsiam",
    "barlow_twins",
    "vicreg",
    "dino",
    "supervised",
)


class LossOutput(NamedTuple):
    """What a method's ``loss`` returns besides the scalar loss.

    metrics: batch-mean scalars to log (averaged over devices by the step).
    batch_stats: the online model's new batch-norm statistics (train mode); the step averages
      them over devices and stores them, so no method has to. None: unchanged.
    carry: what ``after_update`` needs (keys to enqueue, teacher BN statistics, ...).
    features: stop-gradient trunk features (avgpool) of the first view, one row per local
      example: the online probe's input and the test phase's ``features``.
    embeddings: the head's output for the first view (the test phase's ``embeddings``).
    per_example_loss: the loss of each local example, so the test phase averages over real
      rows only.
    terms: the unweighted loss terms, ``{name: (n,)}`` per local example (a batch-level term
      broadcast to every row); ``per_example_loss`` is their weighted sum
      (``common.weighted_loss``). Terms split per crop also bring their family's mean at the
      parts' shares under the family's name (``common.reported_terms``: the single term of
      before, reported, not weighted again). The test phase averages each over the split and
      writes it.
    per_example_metrics: ``{name: (n,)}`` per local example (a classifier's top-1 hits, in %):
      the test phase reports their mean over the real rows of the split, exactly, in place of
      the batch mean of the same name in ``metrics`` (which the train logs keep).
    """

    metrics: dict[str, jax.Array]
    batch_stats: Any = None
    carry: Any = None
    features: jax.Array | None = None
    embeddings: jax.Array | None = None
    per_example_loss: jax.Array | None = None
    terms: dict[str, jax.Array] | None = None
    per_example_metrics: dict[str, jax.Array] | None = None


class Method(NamedTuple):
    # (rng, sample_images) -> TrainState fields: dict(params, batch_stats, ema_params,
    # ema_batch_stats, method_state); the optimizer state is added by the caller.
    init: Callable[..., dict[str, Any]]
    # (params, state, batch, rng, train) -> (loss, LossOutput); differentiated w.r.t. params.
    # train=False is evaluation mode (running BN statistics; nothing to update).
    loss: Callable[..., tuple[jax.Array, LossOutput]]
    # (state, carry) -> state, after the optimizer step and the BN-statistics update: EMA
    # teacher, queues, prototype normalisation. None: nothing to do.
    after_update: Callable[..., Any] | None
    # The flax module whose taps the evaluation reads (online trunk + heads).
    model: Any
    # (parameter path prefix, steps): parameters the optimizer holds fixed for their first
    # steps (VISSL TEMP_FROZEN_PARAMS_ITER_MAP; SwAV's prototypes).
    frozen_params: tuple[tuple[str, int], ...] = ()


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
    from jssl.methods import common

    module = _module(config)
    common.check_loss_config(config, loss_terms(config))
    rate = config.model.get("drop_path_rate", 0.0)
    if str(config.model.trunk).startswith("vit") and rate and config.method.name != "dino":
        # A ViT's DropPath draws from a "dropout" rng that only DINO's student forward passes
        # so far (jssl.methods.common.forward_crops); the other methods' recipes use none.
        raise ValueError(
            f"model.drop_path_rate={rate}: stochastic depth is wired into DINO's student "
            f"only, not into method {config.method.name!r} yet; set "
            "--config.model.drop_path_rate=0 (MoCo v3's ViT recipes use 0)."
        )
    if hasattr(module, "check_config"):
        module.check_config(config)


def loss_terms(config: ml_collections.ConfigDict) -> tuple[Any, ...]:
    """The method's loss terms under ``config`` as ``common.LossTerm``s: its module's
    ``terms(config)`` where it defines one, else its static ``TERMS``."""
    from jssl.methods import common

    module = _module(config)
    if hasattr(module, "terms"):
        return common.as_loss_terms(module.terms(config))
    return common.as_loss_terms(module.TERMS)


def get(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    """Imports ``jssl.methods.<config.method.name>`` and builds its Method.

    ``steps_per_epoch`` (the trainer passes it) lets a method turn epochs of its config into
    steps (SwAV's queue start); evaluation engines leave it None.
    """
    return _module(config).make(config, steps_per_epoch=steps_per_epoch)
