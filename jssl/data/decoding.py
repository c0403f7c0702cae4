"""Decoding images for the tf.data pipeline: one encoded image (bytes or a file path) to RGB, and
a whole split decoded once into memory (data.cache) for random access by index."""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf
from absl import logging

from jssl.data.sources import SplitSource


@dataclasses.dataclass(frozen=True)
class DecodedSplit:
    """Every example of a split decoded to uint8 and held in memory, for random access by index.

    Images may differ in size, so their pixels are stored back to back in one flat tensor with
    per-example offsets and shapes; a lookup is one slice. Unreadable examples keep an empty
    placeholder and readable[i] = False.
    """

    pixels: tf.Tensor  # uint8 [total pixels * 3]
    offsets: tf.Tensor  # int64 [N]
    shapes: tf.Tensor  # int64 [N, 3]
    labels: tf.Tensor  # int32 [N], or [N, C] multi-label targets (SplitSource.label_shape)
    readable: np.ndarray  # bool [N]

    def lookup(self, index: tf.Tensor) -> dict[str, tf.Tensor]:
        """{"image" uint8 HxWx3, "label", "index"} of example `index` (a scalar int64 tensor)."""
        shape = self.shapes[index]
        flat = tf.slice(self.pixels, [self.offsets[index]], [tf.reduce_prod(shape)])
        image = tf.ensure_shape(tf.reshape(flat, shape), [None, None, 3])
        return {"image": image, "label": self.labels[index], "index": index}


def decode_split(source: SplitSource, describe: str) -> DecodedSplit:
    """Reads and decodes all of `source` once (`describe` names it in the log)."""
    size = source.num_examples
    ds = source.read(0, size).map(
        lambda r: {**r, "image": decode_image_uint8(r["image"], is_path=source.kind == "folder")},
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    images = [np.zeros((0, 0, 3), np.uint8)] * size
    labels = np.zeros((size, *source.label_shape), np.int32)
    readable = np.zeros(size, bool)
    # Errors are dropped here and found as the indices that never arrive, so that the caller
    # decides what an unreadable example means (data.skip_corrupt).
    for record in ds.ignore_errors().as_numpy_iterator():
        i = int(record["index"])
        images[i], labels[i], readable[i] = record["image"], record["label"], True
    shapes = np.array([image.shape for image in images], np.int64).reshape(size, 3)
    counts = shapes.prod(axis=1)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    pixels = np.concatenate([image.reshape(-1) for image in images])
    logging.info(
        "Cached %s in memory: %d examples, %.1f MB of decoded pixels.",
        describe,
        size,
        pixels.nbytes / 2**20,
    )
    return DecodedSplit(
        pixels=tf.constant(pixels),
        offsets=tf.constant(offsets),
        shapes=tf.constant(shapes),
        labels=tf.constant(labels),
        readable=readable,
    )


def decode_image_uint8(image: tf.Tensor, is_path: bool) -> tf.Tensor:
    """Encoded bytes (or a file path) -> uint8 RGB HxWx3; grey and RGBA become RGB."""
    data = tf.io.read_file(image) if is_path else image
    decoded = tf.io.decode_image(data, channels=3, expand_animations=False)
    return tf.ensure_shape(decoded, [None, None, 3])


def decode_image(image: tf.Tensor, is_path: bool) -> tf.Tensor:
    """Encoded bytes (or a file path) -> float32 RGB in [0, 1]; grey and RGBA become RGB."""
    return tf.image.convert_image_dtype(decode_image_uint8(image, is_path), tf.float32)
