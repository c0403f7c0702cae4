"""Extracted features on disk: the layout ``extract_features`` writes and the evaluation
engines read (VISSL's ``<layer>_{features,targets,inds}.npy`` per split, plus ``split.json``
saying which examples of which split a directory holds), and ``load_features``, which reads
a split or a TFDS slice of it memory-mapped."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
from collections.abc import Sequence

import ml_collections
import numpy as np
from absl import logging

from jssl.data import sources
from jssl.evaluation import features
from jssl.evaluation.results import load_json

KINDS = ("features", "targets", "inds")
SPLIT_INFO = "split.json"  # which examples of which split a features directory holds


@dataclasses.dataclass(frozen=True)
class SplitBounds:
    """Which examples a (possibly sliced) split holds: [start, end) of ``base``'s
    ``base_num_examples``."""

    base: str
    start: int
    end: int
    base_num_examples: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end == self.base_num_examples


def split_bounds(data_config: ml_collections.ConfigDict, split: str) -> SplitBounds | None:
    """The absolute bounds of ``split`` (TFDS slice semantics), None when the source cannot
    tell (TFDS data without split metadata, e.g. ``tfds.testing.mock_data``)."""
    source = sources.resolve_split(data_config, split)
    if source.kind == "folder":
        return SplitBounds(split, 0, source.num_examples, source.num_examples)
    if not source.sliceable:
        return None
    return SplitBounds(
        source.base_split,
        source.offset,
        source.offset + source.num_examples,
        source.base_num_examples,
    )


def _sanitise(name: str) -> str:
    return re.sub(r"[^\w.-]", "_", name) or "split"


def split_dir_name(split: str, bounds: SplitBounds | None = None) -> str:
    """The directory name of ``split``'s features.

    A whole split keeps its name ("test"). A slice is named by the examples it holds,
    ``<base>@<start>-<end>`` in examples of the base split: "test[10:20]" -> "test@10-20",
    "test[:10%]" of 2,000 examples -> "test@0-200", so different slices never share a
    directory and spellings of the same slice do. ``@`` never survives the sanitising of
    names, so a slice's name cannot be a whole split's. Without ``bounds`` (or when they are
    unknown) a slice is named from its spelling: "test[:10%]" -> "test@-10%".
    """
    if bounds is not None:
        if bounds.whole:
            return _sanitise(bounds.base)
        return f"{_sanitise(bounds.base)}@{bounds.start}-{bounds.end}"
    match = re.fullmatch(r"(.*?)\[(.*)\](.*)", split)
    if not match:
        return _sanitise(split)
    base, inner, rest = match.groups()
    spelling = re.sub(r"[^\w.%-]", "_", inner.replace(":", "-") + rest)
    return f"{_sanitise(base)}@{spelling}"


def output_dir(workdir: str, split: str, bounds: SplitBounds | None = None) -> str:
    """``workdir/features/<split_dir_name(split, bounds)>``."""
    return os.path.join(workdir, "features", split_dir_name(split, bounds))


def write_split_info(
    directory: str,
    split: str,
    bounds: SplitBounds,
    num_examples: int,
    class_names: Sequence[str] = (),
) -> None:
    """Records in ``<directory>/split.json`` which examples the directory holds; the
    evaluation engines select slices from it (``load_features``). An image folder's
    ``class_names`` (target i is class_names[i]) are recorded too, for the user to check."""
    info = {"split": split, **dataclasses.asdict(bounds), "num_examples": num_examples}
    if class_names:
        info["class_names"] = list(class_names)
    path = os.path.join(directory, SPLIT_INFO)
    with open(path + ".partial", "w") as f:
        json.dump(info, f, indent=2)
    os.replace(path + ".partial", path)


def load_features(
    features_dir: str, split: str, layers: Sequence[str], field: str = ""
) -> features.Features:
    """Features written by ``extract_features`` (``<dir>/<name>/<layer>_{features,targets,
    inds}.npy``, VISSL's layout), the feature arrays memory-mapped so a bank larger than RAM
    streams from disk. Rows are checked to be the same examples in every layer.

    A whole split ("test") reads ``<dir>/test``. A TFDS slice ("test[:5]", "test[10:20]",
    "test[:10%]") selects exactly its examples, by the stored indices, from the directory of
    that slice or of any extraction of the same split that covers it (the whole split
    included), as recorded in the directories' ``split.json``; a slice no directory covers,
    or one asked of directories without ``split.json`` (which cannot say which examples they
    hold), is refused. A refusal lists what the directory holds; ``field`` (the config field
    that named ``split``, e.g. "svm.train_split") lets it name the flag that reads it.
    """
    if os.path.isdir(os.path.join(features_dir, "features")):  # an extract_features workdir
        features_dir = os.path.join(features_dir, "features")
    match = re.fullmatch(r"(.*?)\[.*\].*", split)
    if not match:
        split_dir = os.path.join(features_dir, split_dir_name(split))
        if not os.path.isdir(split_dir):
            raise FileNotFoundError(_missing_split(features_dir, split, field))
        return _read_layers(split_dir, split, layers)

    base = match.group(1)
    infos = _split_infos(features_dir, base)
    if not infos:
        held = _held(features_dir)
        if not held:
            raise FileNotFoundError(_missing_split(features_dir, split, field))
        listing = "; ".join(_describe(name, info) for name, info in held)
        whole = any(name == split_dir_name(base) for name, _ in held)
        ask = f"--config.{field}='{base}'" if field else f"the whole split {base!r}"
        raise FileNotFoundError(
            f"No features of split {base!r} in {features_dir} record which examples they hold "
            f"(a {SPLIT_INFO} beside them), so the slice {split!r} cannot be selected; it holds "
            f"{listing}. Extract the slice with --config.extract.splits='(\"{split}\",)' (or "
            "the whole split)"
            + (f", or evaluate the whole split it holds: {ask}." if whole else ".")
        )
    base_size = infos[0][1]["base_num_examples"]
    start, end = _absolute_bounds(split, base, base_size)
    covering = [
        (name, info) for name, info in infos if info["start"] <= start and end <= info["end"]
    ]
    if not covering:
        held = ", ".join(f"{name} [{i['start']}:{i['end']}]" for name, i in infos)
        raise FileNotFoundError(
            f"No extracted features of {base!r} cover {split!r} (examples [{start}:{end}]); "
            f"{features_dir} holds {held}. Extract it with "
            f"--config.extract.splits='(\"{split}\",)'"
            + (f", or set --config.{field} to a slice they hold." if field else ".")
        )
    # The exact slice if it was extracted, else the smallest extraction that holds it.
    name, info = min(covering, key=lambda c: (c[1]["end"] - c[1]["start"], c[0]))
    stored = _read_layers(os.path.join(features_dir, name), split, layers)
    if np.any(np.diff(stored.indices) <= 0):
        raise ValueError(
            f"The inds.npy of {os.path.join(features_dir, name)} are not sorted and unique, as "
            "extract_features writes them; re-run the extraction."
        )
    # Indices are sorted, so the slice is a contiguous range of rows: memmaps stay memmaps.
    lo, hi = np.searchsorted(stored.indices, [start, end])
    selected = features.Features(
        {layer: x[lo:hi] for layer, x in stored.features.items()},
        stored.labels[lo:hi],
        stored.indices[lo:hi],
    )
    complete = info["num_examples"] == info["end"] - info["start"]
    if complete and len(selected) != end - start:
        raise ValueError(
            f"{os.path.join(features_dir, name)} should hold examples [{info['start']}:"
            f"{info['end']}] of {base!r} but its inds.npy does not; re-run the extraction."
        )
    logging.info("Features of %s: rows [%d:%d) of %s/%s", split, lo, hi, features_dir, name)
    return selected


def _absolute_bounds(split: str, base: str, base_size: int) -> tuple[int, int]:
    """[start, end) of a TFDS slice spec, with TFDS's own parsing and rounding (or, without
    TFDS, its twin jssl.data.sources.slice_bounds)."""
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        return _absolute_bounds_without_tfds(split, base, base_size)
    sizes = {base: types.SimpleNamespace(num_examples=base_size)}
    try:
        instructions = tfds.core.ReadInstruction.from_spec(split).to_absolute(sizes)
    except (AttributeError, AssertionError, ValueError, KeyError) as e:
        raise ValueError(
            f"Cannot select {split!r} from extracted features: use one slice of one split in "
            f"examples or percent, e.g. '{base}[:5]', '{base}[10:20]', '{base}[:10%]' ({e})."
        ) from e
    if len(instructions) != 1 or instructions[0].splitname != base:
        raise ValueError(f"Split {split!r}: use a single slice of one split, e.g. '{base}[:5]'.")
    absolute = instructions[0]
    start = absolute.from_ or 0
    end = base_size if absolute.to is None else absolute.to
    return start, end


def _absolute_bounds_without_tfds(split: str, base: str, base_size: int) -> tuple[int, int]:
    try:
        _, start, end = sources.slice_bounds(split, {base: base_size})
    except KeyError:
        raise ValueError(
            f"Split {split!r}: use a single slice of one split, e.g. '{base}[:5]'."
        ) from None
    except ValueError as e:
        raise ValueError(
            f"Cannot select {split!r} from extracted features: use one slice of one split in "
            f"examples or percent, e.g. '{base}[:5]', '{base}[10:20]', '{base}[:10%]' ({e})."
        ) from e
    return start, end


def _split_infos(features_dir: str, base: str) -> list[tuple[str, dict]]:
    """(directory name, split.json) of every extraction of ``base`` under ``features_dir``."""
    found = []
    if not os.path.isdir(features_dir):
        return found
    for name in sorted(os.listdir(features_dir)):
        info = load_json(os.path.join(features_dir, name, SPLIT_INFO))
        if info is not None and info.get("base") == base:
            found.append((name, info))
    return found


def _read_layers(split_dir: str, split: str, layers: Sequence[str]) -> features.Features:
    feats: dict[str, np.ndarray] = {}
    labels = indices = None
    for layer in layers:
        prefix = os.path.join(split_dir, f"{layer}_")
        path = prefix + "features.npy"
        if not os.path.exists(path):
            available = _available(split_dir)
            found = (
                f"its layers: {', '.join(available)}"
                if available
                else "the directory holds no <layer>_features.npy"
            )
            raise FileNotFoundError(
                f"No features of layer {layer!r} for split {split!r}: {path} does not exist "
                f"({found}). Evaluate one of the layers extracted, or extract this one with "
                "--config=configs/extract_features.py (extract.layers)."
            )
        feats[layer] = np.load(path, mmap_mode="r")
        layer_labels = np.load(prefix + "targets.npy").reshape(-1).astype(np.int32)
        layer_indices = np.load(prefix + "inds.npy").reshape(-1).astype(np.int64)
        if not len(layer_labels) == len(layer_indices) == len(feats[layer]):
            raise ValueError(
                f"{prefix}*.npy disagree in length: features {len(feats[layer])}, targets "
                f"{len(layer_labels)}, inds {len(layer_indices)}; re-run the extraction."
            )
        if indices is None:
            labels, indices = layer_labels, layer_indices
        elif not np.array_equal(indices, layer_indices):
            raise ValueError(
                f"The rows of {layer!r} and {layers[0]!r} in {split_dir} are "
                "different examples; extract all layers in one run."
            )
    return features.Features(feats, labels, indices)


def _available(directory: str) -> list[str]:
    if not os.path.isdir(directory):
        return []
    return sorted(f[: -len("_features.npy")] for f in os.listdir(directory) if "_features" in f)


def _missing_split(features_dir: str, split: str, field: str) -> str:
    """The refusal of a whole split no directory of ``features_dir`` holds: what it does hold
    and, when that is a slice of the same split, the slice (and ``field``'s flag) that reads it."""
    held = _held(features_dir)
    if not held:
        state = "holds no split directories" if os.path.isdir(features_dir) else "does not exist"
        return (
            f"No features of split {split!r}: {features_dir} {state}. Extract them first with "
            "--config=configs/extract_features.py, or point the features directory at an "
            "extract_features workdir (or its features/ folder)."
        )
    listing = "; ".join(_describe(name, info) for name, info in held)
    message = (
        f"No features of the whole split {split!r}: "
        f"{os.path.join(features_dir, split_dir_name(split))} does not exist. "
        f"{features_dir} holds {listing}."
    )
    slices = [_slice_spec(info) for _, info in held if info and info.get("base") == split]
    if slices:
        ask = f"set --config.{field}=" if field else "ask for the split "
        message += f" To evaluate an extracted slice, {ask}'{slices[0]}'" + (
            f" (or {', '.join(repr(s) for s in slices[1:])})." if len(slices) > 1 else "."
        )
    return message + (
        f" To evaluate the whole split, extract it: --config.extract.splits='(\"{split}\",)'."
    )


def _held(features_dir: str) -> list[tuple[str, dict | None]]:
    """(name, split.json or None) of every directory under ``features_dir``."""
    if not os.path.isdir(features_dir):
        return []
    names = sorted(
        n for n in os.listdir(features_dir) if os.path.isdir(os.path.join(features_dir, n))
    )
    return [(name, load_json(os.path.join(features_dir, name, SPLIT_INFO))) for name in names]


def _describe(name: str, info: dict | None) -> str:
    if not info:
        return f"{name} (no {SPLIT_INFO}: which examples it holds is not recorded)"
    if info["start"] == 0 and info["end"] == info["base_num_examples"]:
        return f"{name} (the whole {info['base']!r})"
    return (
        f"{name} (examples [{info['start']}:{info['end']}] of the "
        f"{info['base_num_examples']} of {info['base']!r})"
    )


def _slice_spec(info: dict) -> str:
    """The TFDS slice of an extraction's bounds: "train[:64]", "test[10:20]"."""
    return f"{info['base']}[{info['start'] or ''}:{info['end']}]"
