"""The trunk of the run being evaluated: the evaluation engines (kNN, linear evaluation,
feature extraction) take the ``model.*`` fields recorded in the ``config.json`` of the jssl
workdir they read, so ``--config.init.checkpoint=runs/dino_demo`` is enough to evaluate a
DINO demo with any evaluation preset. A field given on the command line wins, and
``--config.init.model_from_checkpoint=False`` turns the adoption off. The fine-tuning presets
(``init.trunk_from_checkpoint``) take the trunk's fields the same way. A layer that reads the
method's head builds it from that workdir's whole training config (``method_config``): the
evaluation presets set no method of their own."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import ml_collections
from absl import logging

from jssl import models
from jssl.checkpoints import run_config
from jssl.checkpoints import workdir as workdir_lib

ENGINES = ("extract_features", "knn", "linear_eval", "export", "evaluate", "test_loss")
# The model fields that fix a trunk's parameters: what a training run started from a jssl
# workdir takes from it with init.trunk_from_checkpoint (the fine-tuning presets); its head,
# regularisation and compute settings stay its own.
TRUNK_FIELDS = (
    "trunk",
    "patch_size",
    "image_size",
    "vit_depth",
    "width_multiplier",
    "cifar_stem",
    "ffn",
    "layerscale",
    "num_registers",
)


def source_path(config: ml_collections.ConfigDict, workdir: str) -> str:
    """Where the evaluated weights come from: ``init.checkpoint``, or for extraction without
    one the workdir's own checkpoints."""
    return config.init.checkpoint or (workdir if config.engine == "extract_features" else "")


def adopt(
    config: ml_collections.ConfigDict, workdir: str, explicit: Iterable[str] = ()
) -> list[str]:
    """Sets ``config.model.*`` to the values recorded by the workdir of the evaluated weights,
    except the fields in ``explicit`` (dotted names, e.g. ``model.trunk``, the command line's
    overrides). A training run does so only with ``init.trunk_from_checkpoint`` and only for
    the trunk's ``TRUNK_FIELDS``, its head's input width following the adopted trunk. Returns
    the ``--config.model.*`` flags it applied (logged), [] when nothing changed or the weights
    are a PyTorch file without a config.json."""
    training = config.engine == "train"
    if training:
        if not config.init.get("trunk_from_checkpoint", False):
            return []
    elif config.engine not in ENGINES or not config.init.get("model_from_checkpoint", True):
        return []
    path = source_path(config, workdir)
    if not path:
        return []
    recorded = workdir_lib.recorded_config(path)
    explicit = set(explicit)
    applied = []
    for field, value in sorted(recorded.items()):
        # The compute dtype and the attention kernel are the evaluation's machine's choice,
        # not properties of the weights.
        if not field.startswith("model.") or field in explicit or field in run_config.NUMERICS:
            continue
        name = field[len("model.") :]
        if name not in config.model or "." in name or (training and name not in TRUNK_FIELDS):
            continue
        current = config.model[name]
        new = _typed(value, current)
        if new is None or workdir_lib.same_value(new, current):
            continue
        config.model[name] = new
        applied.append(f"--config.{field}={workdir_lib.flag_value(value)}")
    if training and applied and "model.head_dims" not in explicit:
        # The classifier reads the adopted trunk's features: its input width follows.
        dims = tuple(config.model.head_dims)
        width = models.trunk_feature_dim(config.model)
        if dims and dims[0] != width:
            config.model.head_dims = (width, *dims[1:])
            applied.append(f"--config.model.head_dims={config.model.head_dims!r}")
    if applied:
        logging.info("Model of %s, from its workdir's config.json: %s", path, " ".join(applied))
    return applied


def method_config(config: ml_collections.ConfigDict, path: str) -> ml_collections.ConfigDict:
    """The training config recorded with the weights at ``path`` (its workdir's config.json),
    with ``config``'s model fields: what ``methods.get`` needs to build the online network
    with the method's own head (DINO's prototypes, SwAV's, a predictor's input)."""
    recorded = workdir_lib.recorded_config(path)
    if not recorded.get("method.name"):
        raise ValueError(
            f"Layer 'head' is the output of the trained method's head, but {path} has no jssl "
            "config.json naming the method (a PyTorch file holds a trunk alone). Evaluate trunk "
            "layers instead (conv1, res2..res5, avgpool), or point --config.init.checkpoint at "
            "the jssl workdir that trained the model."
        )
    tree: dict[str, Any] = {}
    for field, value in recorded.items():
        *parents, name = field.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = _tuples(value)
    source = ml_collections.ConfigDict(tree)
    source.model = ml_collections.ConfigDict(config.model.to_dict())
    return source


def _tuples(value: Any) -> Any:
    """JSON's lists back as the tuples that configs hold."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _typed(value: Any, current: Any) -> Any:
    """``value`` (as JSON read it) in the type of the config's field, None when it cannot
    be (a field whose meaning changed: the config's value is kept)."""
    if isinstance(current, tuple):
        return tuple(value) if isinstance(value, list) else None
    if isinstance(current, bool):
        return value if isinstance(value, bool) else None
    if isinstance(current, int) and not isinstance(current, bool):
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if isinstance(current, float):
        return (
            float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
        )
    if isinstance(current, str):
        return value if isinstance(value, str) else None
    return None
