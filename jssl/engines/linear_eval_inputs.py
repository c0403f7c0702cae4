"""What the linear_eval engine reads: the frozen trunk (and which checkpoint step it is) or
cached features, and the batches of the train split, of its held-out part, of the test split
and of the extra test sets; and the start-up checks of their labels against the heads'.

The held-out part (``linear.val_fraction``) is the last ``round(val_fraction * n)`` examples
of the train split (after ``data.train_subset``) in its stored order: a contiguous slice, read
by every pipeline as two TFDS slices of the base split (for cached features, two ranges of
rows) without a pass over the split. TFDS stores a prepared split shuffled by key, so the
tail samples every class; image folders (class by class), TFDS builders that keep their order
(``disable_shuffling``, the demo's excepted) and TFDS data without split sizes are refused with
a held-out part. The cut depends on nothing random: every run and both modes hold out the same
examples. ``linear.val_split`` names a split to choose on instead. More: docs/evaluation.md,
"Linear evaluation".
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jssl import data
from jssl.data import sources
from jssl.evaluation import frozen, linear, pooling, robustness_sets
from jssl.evaluation.batches import eval_batches, from_host_batches
from jssl.evaluation.feature_store import load_features
from jssl.evaluation.results import load_json
from jssl.evaluation.svm import features_root

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Splits:
    """Which examples the heads train on, are chosen on and are tested on."""

    train: str  # the split (slice) the heads train on
    held_out: str | None  # None: nothing held out (linear.val_fraction=0)
    test: str
    num_train: int
    num_held_out: int
    rule: str  # how the held-out part was cut, for results.json


@dataclasses.dataclass
class Inputs:
    """What the loop needs from its input source (images + frozen trunk, or cached features)."""

    features_fn: linear.FeaturesFn  # (trunk_variables, batch inputs) -> {layer: features}
    trunk_variables: PyTree  # replicated; {} for cached features
    shapes: dict[str, tuple[int, ...]]  # per-example feature shape of each layer
    steps_per_epoch: int
    splits: Splits
    train_batches: Callable[[int, int], Iterator[dict]]  # (epoch, start_step) -> batches
    # every example of a split once, padded: global {"inputs", "label", "mask"}
    held_out_batches: Callable[[], Iterator[dict]] | None
    test_batches: Callable[[], Iterator[dict]]
    source: dict[str, Any]  # the trunk's checkpoint and step, or the features' source


def held_out_count(num_examples: int, fraction: float) -> int:
    return max(1, int(round(fraction * num_examples))) if fraction > 0 else 0


def _rule(fraction: float, train_split: str, config: ml_collections.ConfigDict) -> str:
    subset = config.data.train_subset
    of = f"data.train_split={train_split!r}" + (
        f" after data.train_subset={subset}" if subset > 0 else ""
    )
    return (
        f"the last round({fraction} x n) examples of {of} in its stored order "
        "(deterministic, no seed); the heads train on the examples before them"
    )


def _split_rule(config: ml_collections.ConfigDict) -> str:
    return (
        f"the dataset's split linear.val_split={config.linear.val_split!r}, every example once; "
        f"the heads train on the whole of data.train_split={config.data.train_split!r}"
    )


def image_splits(config: ml_collections.ConfigDict) -> Splits:
    """The splits of the image pipelines (TFDS or demo data), the held-out part as slices
    (or ``linear.val_split``)."""
    dcfg, fraction = config.data, config.linear.val_fraction
    source = sources.resolve_split(dcfg, dcfg.train_split, dcfg.train_subset)
    val_split = config.linear.get("val_split", "")
    if val_split:
        held = sources.resolve_split(dcfg, val_split).num_examples
        rule = _split_rule(config)
        return Splits(dcfg.train_split, val_split, dcfg.test_split, source.num_examples, held, rule)
    n, held = source.num_examples, held_out_count(source.num_examples, fraction)
    if not held:
        return Splits(dcfg.train_split, None, dcfg.test_split, n, 0, "nothing held out")
    # The demo keeps its generation order, whose labels cycle through the classes (index % 10).
    ordered = dcfg.source == "tfds" and source.builder.info.disable_shuffling
    if source.kind == "folder" or not source.sliceable or ordered:
        what = (
            "an image folder"
            if source.kind == "folder"
            else "TFDS data stored unshuffled (disable_shuffling)"
            if ordered
            else "TFDS data without split sizes"
        )
        raise ValueError(
            f"linear.val_fraction={fraction} holds out the end of the train split, which "
            f"{what} cannot be cut into (its examples are not in a shuffled, sliceable order). "
            "Use a TFDS dataset prepared with `tfds build`, or set "
            "--config.linear.val_fraction=0 with a one-point grid."
        )
    _check_sizes(config, n, held)
    start, cut, end = source.offset, source.offset + n - held, source.offset + n
    return Splits(
        train=f"{source.base_split}[{start}:{cut}]",
        held_out=f"{source.base_split}[{cut}:{end}]",
        test=dcfg.test_split,
        num_train=n - held,
        num_held_out=held,
        rule=_rule(fraction, dcfg.train_split, config),
    )


def _check_sizes(config: ml_collections.ConfigDict, n: int, held: int) -> None:
    batch = config.data.batch_size
    if n - held < batch:
        raise ValueError(
            f"linear.val_fraction={config.linear.val_fraction} holds out {held} of the {n} "
            f"train examples, leaving {n - held}: fewer than one batch of {batch}. Lower "
            "--config.linear.val_fraction or --config.data.batch_size."
        )


def load_trunk(config: ml_collections.ConfigDict, mesh, layers) -> tuple[Any, PyTree, dict]:
    """(model, replicated variables, record) of ``init.checkpoint``; the record names the
    checkpoint directory read and its training step (``frozen.load_frozen_model_recorded``)."""
    return frozen.load_frozen_model_recorded(config, mesh, layers)


def trunk_inputs(config: ml_collections.ConfigDict, mesh) -> Inputs:
    lcfg = config.linear
    layers = tuple(lcfg.layers)
    splits = image_splits(config)
    model, trunk, record = load_trunk(config, mesh, layers)
    pools = pooling.layer_pools(lcfg.pool, layers)

    def features_fn(trunk_variables: PyTree, images: jax.Array) -> dict[str, jax.Array]:
        taps = model.apply(trunk_variables, images, train=False)
        return pooling.pool_taps(taps, layers, pools, "linear.layers")

    size = config.data.image_size
    images = jax.ShapeDtypeStruct((1, size, size, 3), jnp.float32)
    shapes = jax.eval_shape(features_fn, trunk, images)
    train_data = train_data_config(config, splits)
    process_index, process_count = jax.process_index(), jax.process_count()

    def train_batches(epoch: int, start_step: int) -> Iterator[dict]:
        ds = data.build_train_dataset(
            train_data,
            seed=config.seed,
            epoch=epoch,
            start_step=start_step,
            process_index=process_index,
            process_count=process_count,
        )
        for batch in ds.as_numpy_iterator():
            yield {"inputs": batch["crops"][0][:, 0], "label": batch["label"]}

    record.update(trunk=config.model.trunk, image_size=size)
    return Inputs(
        features_fn=features_fn,
        trunk_variables=trunk,
        shapes={layer: tuple(s.shape[1:]) for layer, s in shapes.items()},
        steps_per_epoch=data.steps_per_epoch(train_data, process_count),
        splits=splits,
        train_batches=train_batches,
        held_out_batches=(
            None
            if splits.held_out is None
            else lambda: image_batches(config, splits.held_out, mesh)
        ),
        test_batches=lambda: image_batches(config, splits.test, mesh),
        source=record,
    )


def train_data_config(config: ml_collections.ConfigDict, splits: Splits):
    """The heads' training data: the train part of the split, crops and flips only."""
    dcfg = config.data
    if splits.held_out is not None and not config.linear.get("val_split", ""):
        dcfg = dcfg.copy_and_resolve_references()
        with dcfg.unlocked():
            dcfg.train_split, dcfg.train_subset = splits.train, -1
    return linear.train_data_config(dcfg, config.linear.crop_scale)


def image_batches(config: ml_collections.ConfigDict, split: str, mesh, data_config=None):
    """Every example of ``split`` once, through the evaluation pipeline (resize, centre crop)."""
    dcfg = config.data if data_config is None else data_config
    for b in eval_batches(dcfg, split, config.data.batch_size, mesh):
        yield {"inputs": b.batch["image"], "label": b.batch["label"], "mask": b.batch["mask"]}


def extra_set_config(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    """``config.data`` reading the TFDS dataset ``name`` (same data_dir, size, normalisation;
    through tf.data, the only pipeline of TFDS data)."""
    dcfg = config.data.copy_and_resolve_references()
    with dcfg.unlocked():
        dcfg.source, dcfg.name, dcfg.train_subset, dcfg.loader = "tfds", name, -1, "auto"
    return dcfg


def extra_set_label_names(config: ml_collections.ConfigDict, spec: str) -> tuple[str, ...]:
    """The label names of the TFDS set ``spec`` (start-up: its builder's metadata)."""
    name, split = robustness_sets.parse(spec)
    dcfg = extra_set_config(config, name)
    try:
        names = robustness_sets.label_names_of(dcfg, split)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"linear.extra_test_sets entry {spec!r}: {e}") from e
    if not names:
        raise ValueError(
            f"linear.extra_test_sets entry {spec!r}: {name} has no named 'label' classes, so "
            "its labels cannot be matched with the heads' outputs."
        )
    return names


def cached_inputs(config: ml_collections.ConfigDict, mesh) -> Inputs:
    lcfg = config.linear
    layers = tuple(lcfg.layers)
    train_set = load_features(lcfg.cached_features, config.data.train_split, layers)
    test_set = load_features(lcfg.cached_features, config.data.test_split, layers)
    feats, labels, indices = train_set.features, train_set.labels, train_set.indices
    if config.data.train_subset > 0:  # VISSL DATA_LIMIT: the first N examples
        limit = config.data.train_subset
        feats = {k: v[:limit] for k, v in feats.items()}
        labels, indices = labels[:limit], indices[:limit]
    splits, cut = cached_splits(config, indices)
    val_split = lcfg.get("val_split", "")
    val_set = None
    if val_split:
        val_set = load_features(lcfg.cached_features, val_split, layers)
        splits = dataclasses.replace(splits, num_held_out=len(val_set.labels))
    batch_size = config.data.batch_size
    if cut < batch_size:
        raise ValueError(
            f"{cut} cached training examples are fewer than one batch of "
            f"{batch_size}; lower --config.data.batch_size."
        )
    process_index, process_count = jax.process_index(), jax.process_count()
    fit = {k: v[:cut] for k, v in feats.items()}

    def train_batches(epoch: int, start_step: int) -> Iterator[dict]:
        return linear.cached_train_batches(
            fit,
            labels[:cut],
            batch_size=batch_size,
            seed=config.seed,
            epoch=epoch,
            start_step=start_step,
            process_index=process_index,
            process_count=process_count,
        )

    def rows(split_feats, split_labels) -> Iterator[dict]:
        host_batches = linear.cached_eval_batches(
            split_feats,
            split_labels,
            batch_size=batch_size,
            process_index=process_index,
            process_count=process_count,
        )
        for b in from_host_batches(host_batches, mesh):
            yield {name: b.batch[name] for name in ("inputs", "label", "mask")}

    held = {k: v[cut:] for k, v in feats.items()}
    return Inputs(
        features_fn=lambda trunk_variables, x: x,
        trunk_variables={},
        shapes={layer: tuple(feats[layer].shape[1:]) for layer in layers},
        steps_per_epoch=cut // batch_size,
        splits=splits,
        train_batches=train_batches,
        held_out_batches=(
            (lambda: rows(val_set.features, val_set.labels))
            if val_set is not None
            else None
            if cut == len(labels)
            else lambda: rows(held, labels[cut:])
        ),
        test_batches=lambda: rows(test_set.features, test_set.labels),
        source={"features_dir": os.path.abspath(features_root(lcfg.cached_features))},
    )


def cached_splits(config: ml_collections.ConfigDict, indices: np.ndarray) -> tuple[Splits, int]:
    """The splits of cached features whose train rows hold dataset ``indices`` (sorted),
    and the first held-out row."""
    fraction, train_split = config.linear.val_fraction, config.data.train_split
    n = len(indices)
    val_split = config.linear.get("val_split", "")
    if val_split:  # its size is set by the caller, which reads its features
        rule = _split_rule(config) + " (cached features)"
        return Splits(train_split, val_split, config.data.test_split, n, 0, rule), n
    held = held_out_count(n, fraction)
    if not held:
        none = Splits(train_split, None, config.data.test_split, n, 0, "nothing held out")
        return none, n
    _check_sizes(config, n, held)
    base = re.split(r"\[", train_split, maxsplit=1)[0]

    def named(rows: np.ndarray) -> str:
        if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
            return f"{base}[{rows[0]}:{rows[-1] + 1}]"
        return f"{len(rows)} examples of {base} with dataset indices {rows[0]}..{rows[-1]}"

    cut = n - held
    rule = _rule(fraction, train_split, config) + " (rows of the cached features)"
    splits = Splits(
        named(indices[:cut]), named(indices[cut:]), config.data.test_split, cut, held, rule
    )
    return splits, cut


def check_cached_hold_out(config: ml_collections.ConfigDict) -> None:
    """Cached features of an image folder are listed class by class: no tail to hold out."""
    if config.linear.val_fraction <= 0:
        return
    root = features_root(config.linear.cached_features)
    recorded = load_json(os.path.join(root, "config.json")) or {}
    if recorded.get("data", {}).get("source") == "folder":
        raise ValueError(
            f"linear.val_fraction={config.linear.val_fraction}: the cached features in {root} "
            "come from an image folder, whose examples are stored class by class, so their "
            "end is not a sample of every class. Set --config.linear.val_fraction=0 with a "
            "one-point grid, or extract a TFDS dataset."
        )


def check_classes(
    config: ml_collections.ConfigDict, subject: str, labels: np.ndarray | None, found: int
) -> None:
    """A label outside [0, linear.num_classes) makes the heads' loss NaN from the first step."""
    num_classes = config.linear.num_classes
    if labels is not None and len(labels) and labels.min() < 0:
        raise ValueError(
            f"{subject} negative labels (down to {labels.min()}): the heads need labels in "
            f"[0, linear.num_classes); re-extract the features with the right labels."
        )
    if found > num_classes:
        raise ValueError(
            f"{subject} {found} classes but linear.num_classes={num_classes}: every label "
            f"needs an output of the heads. Set --config.linear.num_classes={found}."
        )


def check_extra_sets(config: ml_collections.ConfigDict, extra_sets: tuple) -> None:
    """Each set's labels must be the heads' classes, by name (ImageNet's WordNet ids)."""
    if len(set(extra_sets)) != len(extra_sets):
        raise ValueError(f"linear.extra_test_sets={extra_sets} lists a set twice.")
    trained = robustness_sets.label_names_of(config.data, config.data.train_split)
    for spec in extra_sets:
        if not isinstance(spec, str):
            raise ValueError(f"linear.extra_test_sets entry {spec!r} must be a string.")
        names = extra_set_label_names(config, spec)
        if trained is None or tuple(trained) != tuple(names):
            what = "unnamed classes" if trained is None else f"{len(trained)} other classes"
            raise ValueError(
                f"linear.extra_test_sets entry {spec!r} is labelled with {len(names)} classes "
                f"({', '.join(names[:3])}, ...), but the heads are trained on {what} "
                f"(data.source={config.data.source!r}, data.name={config.data.name!r}): its "
                "labels would not index the heads' outputs. Train on the dataset the set "
                "shares its labels with (ImageNet's: data.name='imagenet2012') or drop it "
                "from linear.extra_test_sets."
            )
        robustness_sets.class_subset(robustness_sets.parse(spec)[0], names)
