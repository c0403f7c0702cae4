"""Starting a training run from trained weights (``init.checkpoint``): ``init_train_state``.

VISSL's ``MODEL.WEIGHTS_INIT`` (``vissl/utils/checkpoint.py``
``init_model_from_consolidated_weights``): a fresh TrainState whose online (and momentum)
encoder takes the weights of a jssl checkpoint or a PyTorch ResNet file, for the train engine
when its workdir has nothing to resume. The trunk must fit; heads are loaded where their shapes
fit and otherwise keep their fresh init; ``init.skip`` names parts that keep their fresh init
whatever the checkpoint holds. Finding and reading the weights (newest readable checkpoint,
PyTorch import) is ``jssl.checkpoints.weights``'s job, shared with the evaluation engines.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import traverse_util

from jssl.checkpoints import weights
from jssl.checkpoints.weights import (
    COLLECTIONS,
    STRICT,
    TORCH_SUFFIXES,
    TRAINING_ONLY,
    Flat,
    WeightsError,
)


def init_train_state(config: ml_collections.ConfigDict, state: Any) -> Any:
    """``state`` with its online (and momentum) encoder weights loaded from ``init.checkpoint``.

    Contract: the train engine calls this only for a fresh run, i.e. when the workdir had no
    checkpoint to resume; the resume order is workdir checkpoint, then ``init.checkpoint``,
    then scratch. ``state`` is the freshly initialised, replicated TrainState; the loaded
    arrays take the sharding and dtype of the leaves they replace.

    - ``params`` and ``batch_stats``: the trunk must fit the configured model exactly, but
      for its training-only mask token (``weights.TRAINING_ONLY``: loaded where both have it,
      else left out or kept fresh, logged: a fine-tune of an iBOT trunk, iBOT from DINO's);
      any other top-level part (the heads) is loaded where the checkpoint has an array of the
      same shape and otherwise keeps its fresh init (logged). ``config.init.skip`` lists
      path prefixes ("head", "trunk/layer4_1", ...) that keep their fresh init regardless.
    - ``ema_params`` / ``ema_batch_stats`` (the momentum encoder, where the method has one):
      the same loaded arrays, as separate buffers, where the paths match.
    - ``opt_state`` is kept: every optimizer of ``jssl.optim`` (SGD momentum, LARS, LARC, AdamW)
      initialises to zeros and counters whose shapes depend only on the parameter shapes,
      which loading does not change. Step, rng, method state (queue, ...) and the online
      probe stay fresh.

    Raises:
      WeightsError: unreadable or garbage ``init.checkpoint``; a trunk that does not fit
        (naming the first mismatching parameter); an ``init.skip`` entry that names nothing.
    """
    path = config.init.checkpoint
    if not path:
        return state
    skip = _skip_prefixes(config)
    wanted = {
        (name, *key): tuple(leaf.shape)
        for name in COLLECTIONS
        for key, leaf in traverse_util.flatten_dict(dict(getattr(state, name))).items()
    }
    _check_skip(skip, wanted)
    if path.endswith(TORCH_SUFFIXES):
        imported = weights.read_torch(path, config)
        loaded = {
            (name, *key): value
            for name, tree in imported.items()
            for key, value in traverse_util.flatten_dict(tree).items()
        }
        kept = _plan(path, {k: np.shape(v) for k, v in loaded.items()}, wanted, skip, config)
        loaded = {k: v for k, v in loaded.items() if k not in kept and k in wanted}
        source = f"the PyTorch file {path}"
    else:

        def read(state_dir: str) -> tuple[Flat, dict]:
            kept = _plan(state_dir, weights.saved_shapes(state_dir), wanted, skip, config)
            shapes = {k: wanted[k] for k in wanted if k not in kept}
            return weights.read_arrays(state_dir, shapes), kept

        state_dir, (loaded, kept) = weights.read_newest(path, read)
        source = f"the checkpoint {state_dir}"
    if not loaded:
        raise WeightsError(
            f"Nothing to load from {source}: init.skip={config.init.get('skip', ())} and the "
            "differences from the configured model leave no array. Shorten init.skip or set "
            "init.checkpoint='' to train from scratch."
        )

    def replace(name: str, tree: Any) -> Any:
        # keep_empty_nodes: the state's tree structure must not change (jit, checkpoints).
        flat = traverse_util.flatten_dict(dict(tree), keep_empty_nodes=True)
        for key, leaf in flat.items():
            value = loaded.get((name, *key))
            if value is not None and np.shape(value) == np.shape(leaf):
                flat[key] = _put(value, leaf)
        return traverse_util.unflatten_dict(flat)

    updates = {name: replace(name, getattr(state, name)) for name in COLLECTIONS}
    teacher = bool(jax.tree.leaves(state.ema_params))
    if teacher:
        # The momentum encoder is initialised as a copy of the online one (MoCo Alg. 1).
        updates["ema_params"] = replace("params", state.ema_params)
        updates["ema_batch_stats"] = replace("batch_stats", state.ema_batch_stats)
    _log_init(source, loaded, wanted, kept, skip, teacher)
    return state.replace(**updates)


def _plan(source: str, saved: Flat, wanted: Flat, skip: tuple, config) -> dict:
    """Which wanted arrays keep their fresh init, and why; raises on a trunk that misfits."""

    def skipped(key: tuple) -> bool:
        return any(key[1 : 1 + len(p)] == p for p in skip)

    def strict(key: tuple) -> bool:
        # A training-only leaf (the mask token) is loaded where both have it, else left out.
        return key[1] in STRICT and key not in TRAINING_ONLY and not skipped(key)

    problems = weights.differences(saved, wanted, strict)
    if problems:
        first, line = problems[0]
        model = weights.describe_model(config)
        hint = weights.match_hint(source, config, [key for key, _ in problems])
        # init.skip names parts of the configured model: it cannot drop a checkpoint's extra.
        skip = (
            f"\nOr keep that part at its fresh init with "
            f"--config.init.skip=\"('{'/'.join(first[1:3])}',)\"."
            if first in wanted
            else ""
        )
        raise WeightsError(
            f"init.checkpoint {source} does not fit the configured model ({model}); "
            f"first mismatch: {line} ({len(problems)} differences in all).\n{hint}{skip}"
        )
    unused = sorted(
        (k for k in saved if k not in wanted and not skipped(k)), key=weights.natural_key
    )
    if unused:
        logging.warning(
            "init.checkpoint: %d arrays of %s are not in the configured model and are not "
            "loaded: %s",
            len(unused),
            source,
            ", ".join("/".join(k) for k in unused[:8]) + (" ..." if len(unused) > 8 else ""),
        )
    kept = {}
    for key in wanted:
        if skipped(key):
            kept[key] = "init.skip"
        elif key not in saved:
            kept[key] = "not in the checkpoint"
        elif tuple(saved[key]) != wanted[key]:
            kept[key] = f"checkpoint {tuple(saved[key])}, model {wanted[key]}"
    return kept


def _skip_prefixes(config: ml_collections.ConfigDict) -> tuple[tuple[str, ...], ...]:
    skip = config.init.get("skip", ())
    if isinstance(skip, str):  # --config.init.skip=head
        skip = (skip,)
    return tuple(tuple(part for part in str(p).split("/") if part) for p in skip)


def _check_skip(skip: tuple, wanted: Flat) -> None:
    for prefix in skip:
        if not any(key[1 : 1 + len(prefix)] == prefix for key in wanted):
            tops = sorted({key[1] for key in wanted})
            raise WeightsError(
                f"init.skip entry {'/'.join(prefix)!r} names no parameter of the model; use "
                f"'/'-separated path prefixes of the parameter tree, e.g. one of {tops} or "
                "'trunk/layer4_1'."
            )


def _put(value: np.ndarray, like: jax.Array) -> jax.Array:
    """``value`` as a new array with ``like``'s dtype and sharding (multi-host safe: each
    process fills its own devices from its host copy). The copy matters: on CPU the array
    may share the host buffer, and the online and momentum encoders must never alias (the
    train step donates the state)."""
    value = np.array(value, dtype=like.dtype, copy=True)
    return jax.make_array_from_callback(like.shape, like.sharding, lambda index: value[index])


def _log_init(
    source: str, loaded: Flat, wanted: Flat, kept: dict, skip: tuple, teacher: bool
) -> None:
    for name in COLLECTIONS:
        keys = [k for k in wanted if k[0] == name]
        n_loaded = [k for k in keys if k in loaded]
        logging.info(
            "init.checkpoint: %s: loaded %d of %d arrays (%d of %d values) from %s.",
            name,
            len(n_loaded),
            len(keys),
            sum(int(np.prod(wanted[k])) for k in n_loaded),
            sum(int(np.prod(wanted[k])) for k in keys),
            source,
        )
    skipped = [k for k, why in kept.items() if why == "init.skip"]
    if skipped:
        logging.info(
            "init.checkpoint: %d arrays keep their fresh init (init.skip=%s).",
            len(skipped),
            tuple("/".join(prefix) for prefix in skip),
        )
    others = sorted((k for k, why in kept.items() if why != "init.skip"), key=weights.natural_key)
    if others:
        logging.warning(
            "init.checkpoint: %d arrays keep their fresh (random) init because they do not "
            "fit:\n  %s",
            len(others),
            "\n  ".join(f"{'/'.join(k)}: {kept[k]}" for k in others),
        )
    if teacher:
        logging.info("init.checkpoint: the momentum encoder starts from the same weights.")
