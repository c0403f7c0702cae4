"""Where examples come from: TFDS builders (including the demo set) and image folders.

`resolve_split` resolves a split of data.source once into a `SplitSource` (jssl.data.split_source)
that knows its size and reads any contiguous range of it in a stable order as raw, undecoded
records; dataset indices are positions in the stored split order, so they are stable across
runs. Each source resolves its splits in its own module: TFDS and the demo set read by tf.data
in jssl.data.tfds_source, image folders in jssl.data.image_folder (their names that other
modules read are re-exported here).

The demo data read by grain or the numpy pipeline (jssl.data.backend picks one where TensorFlow
is missing) resolves to kind "demo": its images are generated in memory (jssl.data.demo), with
TFDS's split and slice syntax (`slice_bounds`). TensorFlow and TFDS are imported only by the
functions that read TFDS data or build tf.data ops, so resolving a folder or the in-memory demo
needs neither.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from jssl.data import backend, demo
from jssl.data.image_folder import list_image_folder, resolve_folder  # noqa: F401  (re-exported)
from jssl.data.split_source import SplitSource, unknown_split_error
from jssl.data.tfds_source import DEMO_NAME, resolve_tfds  # noqa: F401  (re-exported)

# TFDS's split syntax (tensorflow_datasets/core/splits.py): name, then an optional [from:to].
_SPLIT_RE = re.compile(r"^(?P<name>[\w-]+)(\[(?P<selector>[\d\w%:.-]+)\])?$")
_BOUND_RE = re.compile(r"^((?P<value>-?[\d_.]+)(?P<unit>%)?)?$")


def slice_bounds(split: str, sizes: dict[str, int]) -> tuple[str, int, int]:
    """(base split, start, end) of a TFDS split spec such as 'train', 'train[:1000]' or
    'test[10%:-10%]' over splits of ``sizes``, as TFDS resolves it (percent boundaries rounded
    to the closest example), for sources read without TFDS."""
    invalid = ValueError(
        f"Split {split!r} is not a split name or one slice of one: write it as 'train', "
        "'train[:1000]' or 'train[10%:20%]'."
    )
    match = _SPLIT_RE.match(split.strip())
    bounds = (match["selector"] or ":").split(":") if match else []
    units = [_BOUND_RE.match(b) for b in bounds]
    if len(bounds) != 2 or not all(units):
        raise invalid
    name = match["name"]
    if name not in sizes:
        raise KeyError(name)
    size = sizes[name]
    percent = any(u["unit"] for u in units)

    def absolute(bound, default: int) -> int:
        if not bound["value"]:
            return default
        if percent:  # TFDS's "closest" rounding
            return int(round(float(bound["value"]) * size / 100.0))
        return int(bound["value"])

    try:
        start, end = absolute(units[0], 0), absolute(units[1], size)
    except ValueError:
        raise invalid from None
    if abs(start) > size or abs(end) > size:
        raise ValueError(f"Split {split!r}: the slice is outside the {size} examples of {name!r}.")
    start, end = (size + start if start < 0 else start), (size + end if end < 0 else end)
    return name, start, max(start, end)


def _resolve_demo(data_config, split: str) -> SplitSource:
    """The demo data generated in memory (the numpy pipeline): TFDS's split syntax, no files."""
    try:
        base, start, end = slice_bounds(split, demo.SPLIT_SIZES)
    except KeyError:
        raise unknown_split_error(data_config, split, demo.SPLIT_SIZES) from None
    return SplitSource(
        kind="demo",
        split=split,
        num_examples=end - start,
        offset=start,
        base_split=base,
        labels=np.arange(start, end, dtype=np.int32) % len(demo.CLASS_NAMES),
    )


def resolve_split(data_config, split: str, limit: int = -1) -> SplitSource:
    """Resolve `split` of the configured source; `limit` > 0 keeps only its first `limit`."""
    if data_config.source == "demo" and backend.resolve(data_config) in backend.HOST_CROP_LOADERS:
        source = _resolve_demo(data_config, split)
    elif data_config.source in ("demo", "tfds"):
        source = resolve_tfds(data_config, split)
    elif data_config.source == "folder":
        source = resolve_folder(data_config, split)
    else:
        raise ValueError(
            f"Unknown data.source={data_config.source!r}: use 'demo', 'tfds' or 'folder'."
        )
    if limit > 0 and limit < source.num_examples:
        labels = None if source.labels is None else source.labels[:limit]
        source = dataclasses.replace(source, num_examples=limit, labels=labels)
    return source
