"""Whether saved weights fit a model, and what to change when they do not: the parts that must
match, the training-only leaves a model may lack, the differences in the model's order and the
advice that names only the ``--config.model.*`` flags that would make them fit. Shared by the
evaluation loader (``jssl.checkpoints.weights``) and warm starts (``warm_start``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

COLLECTIONS = ("params", "batch_stats")  # the model's variables that weights carry
# The part of the model that must fit exactly when starting training from weights: a trunk
# loaded with holes would silently train a half-random network. Heads may differ.
STRICT = ("trunk",)
# Trunk leaves that only training uses, which a trunk built for another use legitimately
# lacks (or holds where the checkpoint has none): the ViT's learned mask token, which iBOT and
# DINOv2 put in place of masked patches. The evaluated trunk is built without it.
MASK_TOKEN = ("params", "trunk", "mask_token")
TRAINING_ONLY = (MASK_TOKEN,)
Flat = dict[tuple[str, ...], Any]  # (collection, *path) -> array or shape


def match_hint(path: str, config: ml_collections.ConfigDict, keys: Sequence[tuple] = ()) -> str:
    """For a mismatch at ``keys``: what to change. The ``--config.model.*`` flags that give
    ``config`` the model recorded in the config.json of the workdir holding ``path``, those of
    the trunk alone when only the trunk misfits; where none differ (the engines adopt that
    config.json), it says that no model flag helps rather than advise what is in effect."""
    from jssl.checkpoints import source_model, workdir

    if not workdir.recorded_config(path):
        return (
            "Use the model config the checkpoint was trained with (the same configs/*.py "
            "preset and --config.model.* overrides)."
        )
    fields = None
    if keys and all(key[1:2] == ("trunk",) for key in keys):
        fields = {f"model.{name}" for name in source_model.TRUNK_FIELDS}
    flags = [
        flag
        for flag in workdir.flags_to_match(path, config)
        if fields is None or flag[len("--config.") :].partition("=")[0] in fields
    ]
    if flags:
        return (
            "Use the model config the checkpoint was trained with: its workdir's config.json "
            f"differs in: {' '.join(flags)}"
        )
    part = "trunk" if fields else "model"
    return (
        f"config.model already holds the {part} fields of its workdir's config.json, so no "
        "--config.model.* flag makes it fit: the checkpoint holds arrays that this model does "
        "not build. Was it copied from another run, or written by another jssl version? If "
        "not, please report it."
    )


def differences(saved: Flat, wanted: Flat, strict: Callable[[tuple], bool]) -> list[tuple]:
    """``(key, line)`` per difference under ``strict`` keys, in the model's natural order."""
    problems = []
    for key in sorted(set(saved) | set(wanted), key=natural_key):
        if not strict(key):
            continue
        name = "/".join(key)
        if key not in saved:
            problems.append((key, f"{name}: missing in the checkpoint"))
        elif key not in wanted:
            problems.append((key, f"{name}: not in the configured model"))
        elif tuple(saved[key]) != tuple(wanted[key]):
            line = f"{name}: checkpoint {tuple(saved[key])}, model {wanted[key]}"
            problems.append((key, line))
    return problems


def natural_key(key: tuple) -> tuple:
    """Sort key: params before batch_stats, trunk first, layer2 before layer10."""
    parts = [(int(p), "") if p.isdigit() else (0, p) for p in re.split(r"(\d+)", "/".join(key))]
    return (COLLECTIONS.index(key[0]), key[1] not in STRICT, parts)


def describe_model(config: ml_collections.ConfigDict) -> str:
    """The architecture fields of ``config.model`` that weights must match, for messages."""
    m = config.model
    return (
        f"trunk={m.trunk}, width_multiplier={m.width_multiplier}, cifar_stem={m.cifar_stem}, "
        f"head_dims={tuple(m.head_dims)}, head_bn={m.head_bn}"
    )
