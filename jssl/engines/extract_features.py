"""The extract_features engine: a trained model's features of whole dataset splits, on disk.

VISSL's ``vissl/engines/extract_features.py`` and ``SelfSupervisionTrainer.extract``
(``vissl/trainer/trainer_main.py``), with its files (``vissl/utils/extract_features_utils.py``):
``workdir/features/<split>/<layer>_{features,targets,inds}.npy`` (float32, int64, int64) and
``split.json``, plus ``features/config.json`` and ``source.json`` (the checkpoint read and its
step, so every figure computed from the features can name it). The trunk (with its head only
when a layer asks for ``head``: jssl.evaluation.frozen) runs in eval mode, one jit over the
mesh with the pooling fused in. Every example is written exactly once, sorted by dataset
index, on any number of devices or processes; the files are memory-mapped (a split larger than
host memory is fine) and renamed when complete, so an interrupted run leaves no half-written
features. A TFDS slice gets a directory of its own (``feature_store.split_dir_name``). More:
docs/evaluation.md, "Feature extraction".
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from jssl import models, parallel
from jssl.checkpoints import manager as checkpoint
from jssl.data import sources
from jssl.evaluation import feature_store, features, frozen, pooling
from jssl.evaluation.batches import eval_batches
from jssl.training import preemption

SOURCE_FILE = "source.json"  # in workdir/features: the checkpoint read and its step


def make_extract_fn(
    model: Any, layers: Sequence[str], pools: Mapping[str, pooling.Pool]
) -> Callable[[Any, jax.Array], dict[str, jax.Array]]:
    """``(variables, images) -> {layer: pooled float32 features}`` in eval mode, jitted.

    Taps not requested are dead code and pruned by XLA; pooling runs fused on device, so
    only the pooled features cross to the host.
    """

    def extract(variables: Any, images: jax.Array) -> dict[str, jax.Array]:
        taps = model.apply(variables, images, train=False)
        pooled = pooling.pool_taps(taps, layers, pools, "extract.layers")
        return {layer: x.astype(jnp.float32) for layer, x in pooled.items()}

    return jax.jit(extract)


class _SplitWriter:
    """Memory-mapped ``.npy`` files of one split, filled at row = dataset index."""

    def __init__(
        self,
        directory: str,
        shapes: Mapping[str, tuple[int, ...]],
        num: int,
        offset: int = 0,
        label_shape: tuple[int, ...] = (),
    ):
        os.makedirs(directory, exist_ok=True)
        # Rows are positions in the (sliced) split; inds are indices in the base split.
        self.directory, self.num, self.offset = directory, num, offset
        self.seen = np.zeros(num, bool)
        self.arrays: dict[str, np.ndarray] = {}
        for layer, shape in shapes.items():
            for kind, dtype, row in (
                ("features", np.float32, shape),
                ("targets", np.int64, label_shape),
                ("inds", np.int64, ()),
            ):
                self.arrays[f"{layer}_{kind}"] = np.lib.format.open_memmap(
                    self._partial(f"{layer}_{kind}"), mode="w+", dtype=dtype, shape=(num, *row)
                )

    def _partial(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.npy.partial")

    def write(self, feats: Mapping[str, np.ndarray], labels: np.ndarray, indices: np.ndarray):
        if indices.size == 0:
            return
        if indices.min() < 0 or indices.max() >= self.num:
            raise ValueError(
                f"dataset index {int(indices.max())} outside the split's [0, {self.num}); "
                "the data pipeline must number examples 0..n-1 per split"
            )
        if self.seen[indices].any() or len(np.unique(indices)) != len(indices):
            raise ValueError(
                "some dataset indices arrived twice (e.g. "
                f"{indices[self.seen[indices]][:5].tolist()}); every example must be read "
                "exactly once over all processes, padding rows masked out"
            )
        self.seen[indices] = True
        # Contiguous, ascending rows (one process) are a slice write; others are scattered.
        if indices[-1] - indices[0] == len(indices) - 1 and np.all(np.diff(indices) == 1):
            rows: Any = slice(int(indices[0]), int(indices[-1]) + 1)
        else:
            rows = indices
        for layer, value in feats.items():
            self.arrays[f"{layer}_features"][rows] = value
            self.arrays[f"{layer}_targets"][rows] = labels
            self.arrays[f"{layer}_inds"][rows] = indices + self.offset

    def abort(self) -> None:
        """Removes the partial files of a split left unfinished (a stop request)."""
        for name in list(self.arrays):
            del self.arrays[name]
            os.remove(self._partial(name))

    def finish(self, allow_missing: bool) -> int:
        """Flushes and renames the files into place; returns the number of rows written."""
        missing = np.flatnonzero(~self.seen)
        if missing.size and not allow_missing:
            raise RuntimeError(
                f"{missing.size} of {self.num} examples were never extracted (e.g. indices "
                f"{missing[:10].tolist()}); the data pipeline must yield every example once"
            )
        for name, array in self.arrays.items():
            array.flush()
            final = os.path.join(self.directory, f"{name}.npy")
            if missing.size:  # skipped corrupt images: keep only the rows that exist
                _compact(array, self.seen, final)
                del array
                os.remove(self._partial(name))
            else:
                del array
                os.replace(self._partial(name), final)
        self.arrays = {}
        return int(self.seen.sum())


def _compact(array: np.ndarray, keep: np.ndarray, path: str, chunk: int = 4096) -> None:
    """Copies the rows ``keep`` of ``array`` to a new .npy at ``path``, in chunks."""
    out = np.lib.format.open_memmap(
        path + ".partial", mode="w+", dtype=array.dtype, shape=(int(keep.sum()), *array.shape[1:])
    )
    pos = 0
    for start in range(0, len(array), chunk):
        rows = array[start : start + chunk][keep[start : start + chunk]]
        out[pos : pos + len(rows)] = rows
        pos += len(rows)
    out.flush()
    del out
    os.replace(path + ".partial", path)


def _checkpoint_path(config: ml_collections.ConfigDict, workdir: str) -> str:
    """``init.checkpoint``, or the workdir itself when it holds a training run's checkpoints."""
    path = config.init.checkpoint
    if not path and os.path.isdir(checkpoint.checkpoint_dir(workdir)):
        return workdir
    return path


def _extract_split(
    config: ml_collections.ConfigDict,
    workdir: str,
    split: str,
    extract_fn: Callable,
    variables: Any,
    mesh: jax.sharding.Mesh,
) -> dict[str, Any] | None:
    """Extracts ``split`` into its directory under ``workdir/features``; returns its summary,
    or None when a stop request ended it (its partial files removed)."""
    ecfg = config.extract
    source = sources.resolve_split(config.data, split)
    num = source.num_examples
    batch_size = ecfg.batch_size
    local_batch = batch_size // jax.process_count()
    num_batches = math.ceil(math.ceil(num / jax.process_count()) / local_batch)
    size = config.data.image_size
    images = jax.ShapeDtypeStruct((batch_size, size, size, 3), jnp.float32)
    shapes = {k: v.shape[1:] for k, v in jax.eval_shape(extract_fn, variables, images).items()}
    bounds = feature_store.split_bounds(config.data, split)
    directory = feature_store.output_dir(workdir, split, bounds)
    logging.info(
        "Extracting %s (%d examples, %d batches of %d) -> %s; feature shapes %s",
        split,
        num,
        num_batches,
        batch_size,
        directory,
        shapes,
    )
    offset = bounds.start if bounds is not None else 0
    writer = None
    if jax.process_index() == 0:
        writer = _SplitWriter(directory, shapes, num, offset, source.label_shape)
    batches = eval_batches(config.data, split, batch_size, mesh)
    stream = features.iterate_features(lambda x: extract_fn(variables, x), batches)

    start = time.perf_counter()
    steady_start, steady_examples = None, 0
    log_every = max(1, config.log_every_steps)
    done = 0
    for step, (feats, labels, indices) in enumerate(stream, 1):
        if preemption.stop_agreed():  # every process stops at the same batch
            if writer is not None:
                writer.abort()
            logging.warning(
                "Stopped extracting %s after %d of %d batches.", split, step - 1, num_batches
            )
            return None
        if writer is not None:
            writer.write(feats, labels, indices)
        done += len(indices)
        if steady_start is None:  # the first batch pays for compilation
            steady_start = time.perf_counter()
        else:
            steady_examples += len(indices)
        if step % log_every == 0 or step == num_batches:
            _log_progress(split, step, num_batches, done, time.perf_counter() - start)
    seconds = time.perf_counter() - start
    steady = time.perf_counter() - steady_start if steady_start is not None else 0.0
    written = done
    if writer is not None:
        written = writer.finish(allow_missing=config.data.skip_corrupt)
        if bounds is not None:
            feature_store.write_split_info(
                directory, split, bounds, written, class_names=source.class_names
            )
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"jssl_extract_{split}")
    return {
        "directory": directory,
        "num_examples": written,
        "shapes": {layer: tuple(int(d) for d in s) for layer, s in shapes.items()},
        "seconds": seconds,
        # Excluding the first batch (compilation); the whole-run rate when there is only one.
        "images_per_sec": steady_examples / steady if steady_examples else done / seconds,
    }


def _log_progress(split: str, step: int, num_batches: int, done: int, elapsed: float) -> None:
    eta = elapsed / step * (num_batches - step)
    message = "%s: batch %d/%d, %d examples, %.1f s elapsed, ETA %.0f s"
    logging.info(message, split, step, num_batches, done, elapsed, eta)


def validate(config: ml_collections.ConfigDict) -> None:
    """The extract_features engine's start-up checks, run before anything is written."""
    from jssl import engines

    ecfg = config.extract
    engines.check_positive(config, "extract.batch_size")
    parallel.check_batch_divisible(ecfg.batch_size, "extract.batch_size")
    layers = tuple(ecfg.layers)
    if not layers or not tuple(ecfg.splits):
        raise ValueError(
            "Set extract.layers and extract.splits, e.g. --config.extract.layers='(\"avgpool\",)'"
            ' --config.extract.splits=\'("train", "test")\'.'
        )
    pooling.layer_pools(ecfg.pool, layers)
    models.check_input_size(config.model, config.data.image_size, "data.image_size")


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Extracts ``config.extract.layers`` of every split in ``config.extract.splits``.

    Returns ``{split: {"directory", "num_examples", "shapes", "seconds",
    "images_per_sec"}}``, or ``{"preempted": True}`` when SIGTERM or a first Ctrl-C stopped
    it between two batches: the splits finished are kept, the one in progress is removed, and
    a rerun of the same command extracts only what is missing (splits that an earlier run of
    the same config on the same checkpoint finished are kept, ``_kept_split``).
    """
    validate(config)
    ecfg = config.extract
    layers = tuple(ecfg.layers)
    pools = pooling.layer_pools(ecfg.pool, layers)
    with preemption.Preemption() as stop_request:
        mesh = parallel.make_mesh()
        # The trunk alone unless the head's output is asked for (see jssl.evaluation.frozen).
        path = _checkpoint_path(config, workdir)
        model, variables, source = frozen.load_frozen_model_recorded(
            config, mesh, layers, path=path
        )
        extract_fn = make_extract_fn(model, layers, pools)
        same_run = _record_run(config, workdir, source)
        summary = {}
        for split in ecfg.splits:
            kept = _kept_split(config, workdir, split) if same_run else None
            summary[split] = kept or _extract_split(
                config, workdir, split, extract_fn, variables, mesh
            )
            if summary[split] is None:
                logging.warning(
                    "Stopped by %s; the splits extracted so far are kept in %s/features. Rerun "
                    "the same command to extract the rest (exit status %d).",
                    stop_request.signal_name or "SIGTERM",
                    workdir,
                    preemption.PREEMPTED_EXIT_CODE,
                )
                return {"preempted": True}
    lines = [f"Features of {path} ({config.model.trunk}) in {workdir}/features:"]
    for split, s in summary.items():
        dims = ", ".join(f"{layer} {s['shapes'][layer]}" for layer in layers)
        lines.append(
            f"  {split}: {s['num_examples']} examples, {dims}, {s['seconds']:.1f} s, "
            f"{s['images_per_sec']:.0f} images/s"
        )
    logging.info("\n".join(lines))
    if jax.process_index() == 0:
        print("\n".join(lines), flush=True)
    return summary


def _record_run(config: ml_collections.ConfigDict, workdir: str, source: dict) -> bool:
    """Writes ``features/config.json`` and ``source.json``; returns whether an earlier run
    wrote the same ones (the same settings on the same checkpoint step), whose finished
    splits can then be kept. Otherwise the split directories this run writes are removed
    first, so that no split of an earlier extraction is ever mistaken for one of this one."""
    directory = os.path.join(workdir, "features")
    settings = config.to_json_best_effort(indent=2, sort_keys=True)
    recorded = json.dumps(source, indent=2, sort_keys=True)
    same = _read(os.path.join(directory, "config.json")) == settings
    same = same and _read(os.path.join(directory, SOURCE_FILE)) == recorded
    if jax.process_index() == 0 and not same:
        for split in config.extract.splits:
            bounds = feature_store.split_bounds(config.data, split)
            shutil.rmtree(feature_store.output_dir(workdir, split, bounds), ignore_errors=True)
        os.makedirs(directory, exist_ok=True)
        for name, text in (("config.json", settings), (SOURCE_FILE, recorded)):
            with open(os.path.join(directory, name + ".partial"), "w") as f:
                f.write(text)
            os.replace(os.path.join(directory, name + ".partial"), os.path.join(directory, name))
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jssl_extract_start")
    return same


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _kept_split(config: ml_collections.ConfigDict, workdir: str, split: str) -> dict | None:
    """The summary of ``split`` when an earlier run of this config finished it (every layer's
    three files in place), else None."""
    bounds = feature_store.split_bounds(config.data, split)
    directory = feature_store.output_dir(workdir, split, bounds)
    layers = tuple(config.extract.layers)
    names = [f"{layer}_{kind}.npy" for layer in layers for kind in feature_store.KINDS]
    if not all(os.path.exists(os.path.join(directory, name)) for name in names):
        return None
    shapes = {
        layer: tuple(np.load(os.path.join(directory, f"{layer}_features.npy"), mmap_mode="r").shape)
        for layer in layers
    }
    logging.info("Kept %s: extracted by an earlier run of the same config (%s).", split, directory)
    return {
        "directory": directory,
        "num_examples": shapes[layers[0]][0],
        "shapes": {layer: shape[1:] for layer, shape in shapes.items()},
        "seconds": 0.0,
        "images_per_sec": 0.0,
    }
