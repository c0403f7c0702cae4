"""The metric writer of a run, and what the train engine writes besides scalars: augmented
views, averages, an embedding picture.

``create_writer`` gives clu's default writer (the log, plus TensorBoard event files through
tf.summary) where TensorFlow is installed, and without TensorFlow the same pair with the event
files written by tensorboard's own writer and protos (``EventFileWriter``), so a run on a host
with only JAX still has its TensorBoard curves. ``allow_clu_without_tensorflow`` (called when
jssl is imported) lets clu.metric_writers and clu.periodic_actions import there at all: clu
imports its TensorFlow summary writer with the package.

Importing this module is cheap (numpy only): jssl's package import runs it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import struct
import sys
import time
import types
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

_CLU_SUMMARY_WRITER = "clu.metric_writers.summary_writer"


def tensorflow_installed() -> bool:
    """Whether TensorFlow can be found, without importing it."""
    try:
        return importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):  # a finder refusing it; a None entry in sys.modules
        return False


def allow_clu_without_tensorflow(force: bool = False) -> None:
    """Where TensorFlow is missing (or ``force``), gives clu a TensorFlow-free summary writer
    before clu.metric_writers is first imported: clu imports its tf.summary writer with the
    package, so without this no clu writer or periodic action could be imported. Its
    ``SummaryWriter(logdir)`` then makes an ``EventFileWriter``. A no-op once clu's writers are
    imported, and where TensorFlow is installed."""
    if "clu.metric_writers" in sys.modules or _CLU_SUMMARY_WRITER in sys.modules:
        return
    if tensorflow_installed() and not force:
        return
    module = types.ModuleType(_CLU_SUMMARY_WRITER, "jssl's TensorFlow-free clu SummaryWriter.")
    module.SummaryWriter = EventFileWriter
    sys.modules[_CLU_SUMMARY_WRITER] = module


def create_writer(logdir: str, *, just_logging: bool):
    """clu's default writer for ``logdir``: the absl log, plus TensorBoard event files unless
    ``just_logging`` (processes other than 0), asynchronous. Without TensorFlow the event files
    come from ``EventFileWriter``, and without tensorboard either the log alone is written."""
    allow_clu_without_tensorflow()
    try:
        from clu import metric_writers
    except ImportError:  # TensorFlow installed but not importable
        allow_clu_without_tensorflow(force=True)
        from clu import metric_writers
    if not just_logging and sys.modules[_CLU_SUMMARY_WRITER].SummaryWriter is EventFileWriter:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            logging.warning(
                "Neither TensorFlow nor tensorboard is installed: metrics go to the "
                "log only (pip install tensorboard for the event files)."
            )
            just_logging = True
    return metric_writers.create_default_writer(logdir, just_logging=just_logging)


@functools.cache
def _register_as_metric_writer() -> None:
    # A virtual subclass: clu's interface can only be imported once this module has handed clu
    # its summary writer, so EventFileWriter cannot inherit from it at import time.
    from clu.metric_writers import interface

    interface.MetricWriter.register(EventFileWriter)


def encode_png(image: np.ndarray) -> bytes:
    """A uint8 (H, W, C) image, C in 1..4, as PNG bytes (zlib, no filter; no imaging library)."""
    height, width, channels = image.shape
    colour_type = {1: 0, 2: 4, 3: 2, 4: 6}[channels]  # grey, grey+alpha, RGB, RGBA
    rows = np.concatenate([np.zeros((height, 1), np.uint8), image.reshape(height, -1)], axis=1)

    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(np.ascontiguousarray(rows).tobytes()))
        + chunk(b"IEND", b"")
    )


class EventFileWriter:
    """A clu ``MetricWriter`` (registered as one) that writes TensorBoard event files with
    tensorboard's own event writer and summary protos, no TensorFlow: scalars, images, texts,
    histograms and hparams as tf.summary writes them; videos and audio are not supported."""

    def __init__(self, logdir: str):
        try:
            from tensorboard.summary.writer import event_file_writer
        except ImportError as e:
            raise ImportError(
                "Writing TensorBoard event files without TensorFlow needs the tensorboard "
                "package: pip install tensorboard."
            ) from e
        _register_as_metric_writer()
        self._writer = event_file_writer.EventFileWriter(os.fspath(logdir))

    def _write(self, step: int, values: list) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        summary = summary_pb2.Summary(value=values)
        self._writer.add_event(
            event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary)
        )

    def write_summaries(self, step: int, values: Mapping[str, Any], metadata=None) -> None:
        from tensorboard.compat.proto import summary_pb2
        from tensorboard.util import tensor_util

        out = []
        for tag, value in values.items():
            md = (metadata or {}).get(tag)
            if isinstance(md, bytes):
                md = summary_pb2.SummaryMetadata.FromString(md)
            tensor = tensor_util.make_tensor_proto(np.asarray(value))
            out.append(summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=md))
        self._write(step, out)

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        from tensorboard.plugins.scalar import summary_v2

        values = [summary_v2.scalar_pb(k, np.float32(v)).value[0] for k, v in scalars.items()]
        self._write(step, values)

    def write_images(self, step: int, images: Mapping[str, Any]) -> None:
        """(H, W, C) or (N, H, W, C) images, uint8 or float in [0, 1], as tf.summary.image."""
        from tensorboard.compat.proto import summary_pb2
        from tensorboard.plugins.image import metadata
        from tensorboard.util import tensor_util

        values = []
        for tag, image in images.items():
            image = np.asarray(image)
            image = image[None] if image.ndim == 3 else image
            if image.dtype != np.uint8:  # tf.image.convert_image_dtype(..., saturate=True)
                image = np.clip(image.astype(np.float32) * 255.5, 0, 255).astype(np.uint8)
            content = [str(image.shape[2]), str(image.shape[1])] + [encode_png(i) for i in image]
            tensor = tensor_util.make_tensor_proto(np.asarray(content, dtype=object))
            md = metadata.create_summary_metadata(display_name=None, description=None)
            values.append(summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=md))
        self._write(step, values)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        from tensorboard.plugins.text import summary_v2

        self._write(step, [summary_v2.text_pb(k, v).value[0] for k, v in texts.items()])

    def write_histograms(self, step: int, arrays: Mapping[str, Any], num_buckets=None) -> None:
        from tensorboard.plugins.histogram import summary_v2

        values = []
        for tag, array in arrays.items():
            buckets = None if num_buckets is None else num_buckets.get(tag)
            pb = summary_v2.histogram_pb(tag, np.asarray(array, np.float64), buckets=buckets)
            values.append(pb.value[0])
        self._write(step, values)

    def write_videos(self, step: int, videos: Mapping[str, Any]) -> None:
        logging.log_first_n(logging.WARNING, "EventFileWriter does not write videos.", 1)

    def write_audios(self, step: int, audios: Mapping[str, Any], *, sample_rate: int) -> None:
        logging.log_first_n(logging.WARNING, "EventFileWriter does not write audio.", 1)

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        from tensorboard.plugins.hparams import summary_v2

        flat = {}
        for key, value in _flatten(hparams).items():  # TensorBoard takes bool, number or str
            flat[key] = value if isinstance(value, (bool, int, float, str)) else str(value)
        self._write(0, list(summary_v2.hparams_pb(flat).value))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def mean_metrics(collected: Sequence[dict]) -> dict[str, float]:
    """Averages a window of per-step metric dicts (device arrays) in one host transfer."""
    import jax

    stacked = jax.device_get(jax.tree.map(lambda *xs: np.stack(xs), *collected))
    return {k: float(np.mean(v)) for k, v in stacked.items()}


def view_grid(views: Sequence[np.ndarray], mean, std, max_examples: int = 8) -> np.ndarray:
    """A (rows=examples, cols=views) image grid of de-normalised augmented views in [0, 1]."""
    n = min(max_examples, views[0].shape[0])
    rows = []
    for i in range(n):
        cells = [
            np.clip(np.asarray(v[i]) * np.asarray(std) + np.asarray(mean), 0, 1) for v in views
        ]
        rows.append(np.concatenate(cells, axis=1))
    return np.concatenate(rows, axis=0)


def write_views(writer, crops: Sequence[np.ndarray], augment_config) -> None:
    """Writes the first training examples' augmented crops, one grid per crop group (rows:
    examples, columns: the group's crops), so every group's augmentations can be checked."""
    import jax

    if jax.process_index() != 0:
        return
    images = {}
    for g, group in enumerate(crops):
        group = np.asarray(group)  # (n, num_crops, S, S, 3)
        views = [group[:, j] for j in range(group.shape[1])]
        # uint8: data.augment.on_device's host crops, before the step's colour ops.
        mean, std = (augment_config.mean, augment_config.std)
        if group.dtype == np.uint8:
            mean, std = (0.0, 0.0, 0.0), (1 / 255,) * 3
        grid = view_grid(views, mean, std)
        images[f"augmented_crops/group{g}_{group.shape[1]}x{group.shape[2]}px"] = grid[None]
    writer.write_images(0, images)


# A qualitative palette (10 well separated colours), then cycled for more classes.
_PALETTE = np.array(
    [
        [31, 119, 180],
        [255, 127, 14],
        [44, 160, 44],
        [214, 39, 40],
        [148, 103, 189],
        [140, 86, 75],
        [227, 119, 194],
        [127, 127, 127],
        [188, 189, 34],
        [23, 190, 207],
    ],
    np.uint8,
)


def pca_2d(x: np.ndarray) -> np.ndarray:
    """The first two principal components of the rows of ``x`` (via SVD of centred data)."""
    x = x.reshape(len(x), -1).astype(np.float64)
    x = x - x.mean(axis=0)
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    return x @ vt[:2].T


def embedding_picture(x: np.ndarray, labels: np.ndarray, size: int = 384) -> np.ndarray:
    """A scatter plot (uint8 HxWx3) of the 2-D PCA of ``x``, one colour per class."""
    points = pca_2d(x)
    lo, hi = points.min(axis=0), points.max(axis=0)
    margin = 8
    scaled = (points - lo) / np.maximum(hi - lo, 1e-12) * (size - 2 * margin - 1) + margin
    image = np.full((size, size, 3), 255, np.uint8)
    cols, rows = scaled[:, 0].astype(int), (size - 1 - scaled[:, 1]).astype(int)
    colours = _PALETTE[np.asarray(labels) % len(_PALETTE)]
    for dy in (-1, 0, 1):  # 3x3 dots
        for dx in (-1, 0, 1):
            image[np.clip(rows + dy, 0, size - 1), np.clip(cols + dx, 0, size - 1)] = colours
    return image


def save_png(path: str, image: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(encode_png(image))


def write_image_columns(
    writer, step: int, pictures: Mapping[str, Sequence[np.ndarray]], mean, std
) -> None:
    """Writes each picture, a list of columns of (n, H, W, 3) images in the crops' normalised
    space, as one grid (rows: examples, columns: the list's order) de-normalised with ``mean``
    and ``std`` (``data.augment``), on process 0."""
    import jax

    if jax.process_index() != 0 or not pictures:
        return
    images = {
        name: view_grid([np.asarray(c, np.float32) for c in columns], mean, std)[None]
        for name, columns in pictures.items()
    }
    writer.write_images(step, images)


class MethodPictures:
    """A method's own TensorBoard pictures (MAE's reconstructions), from the optional
    ``make_images(config)`` of its module: ``images(params, state, batch, rng) -> {name: [columns
    of (n, H, W, 3) in the crops' normalised space]}``, run jitted in evaluation mode.

    The train engine keeps the first examples of the first batch it trains on (``keep``: every
    process the same ones, process 0's) and draws them with the state's own key at every test
    phase and at the end of the run (``write``), so successive pictures show the same crops
    under the same random choices (MAE's masks) as training goes on."""

    def __init__(self, config, make_images):
        import jax

        self.config = config
        self.images = jax.jit(make_images(config))
        self.batch = None

    @classmethod
    def of(cls, config) -> MethodPictures | None:
        """The pictures of ``config.method.name``'s module, or None where it makes none."""
        import importlib

        module = importlib.import_module(f"jssl.methods.{config.method.name}")
        make_images = getattr(module, "make_images", None)
        return None if make_images is None else cls(config, make_images)

    def keep(self, host_batch: Mapping[str, Any], examples: int = 8) -> None:
        """The first ``examples`` rows of ``host_batch`` (crops and indices), unless some are
        kept already."""
        import jax
        from jax.experimental import multihost_utils

        if self.batch is not None:
            return
        batch = {
            "crops": tuple(np.asarray(g[:examples]) for g in host_batch["crops"]),
            "index": np.asarray(host_batch["index"][:examples]),
        }
        if jax.process_count() > 1:
            batch = multihost_utils.broadcast_one_to_all(batch)
        self.batch = batch

    def write(self, writer, state, step: int) -> None:
        """The pictures of the kept examples under ``state``, written at ``step``."""
        import jax

        if self.batch is None:
            return
        pictures = self.images(state.params, state, self.batch, state.rng)
        augment = self.config.data.augment
        write_image_columns(writer, step, jax.device_get(pictures), augment.mean, augment.std)
