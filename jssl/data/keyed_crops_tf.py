"""jssl.data.keyed_crops's draws in TensorFlow ops, for tf.data's data.augment.on_device path.

The words come from TensorFlow's stateless Philox with keyed_crops's key and counters, the box
from the same attempts of sample_distorted_bounding_box's algorithm in float64, so tf.data cuts
the boxes, flips and seeds grain and the numpy pipeline cut, without leaving the graph (a
numpy_function per example would serialise the input threads on the GIL).
"""

from __future__ import annotations

import tensorflow as tf

from jssl.data import keyed_crops

_PHILOX = 1  # tf.random.Algorithm.PHILOX


def example_words(key: tf.Tensor, num_crops: int) -> tf.Tensor:
    """(num_crops, WORDS) uint32 words of an example keyed by int64 (seed, epoch, index):
    keyed_crops.example_words."""
    u64 = tf.bitcast(tf.cast(key, tf.int64), tf.uint64)
    stream = tf.constant(keyed_crops.philox_key(0), tf.uint64)  # the key of seed 0: the stream
    philox_key = tf.bitwise.bitwise_xor(u64[0], stream)
    shift = tf.constant(keyed_crops.INDEX_BITS, tf.uint64)
    high = tf.bitwise.bitwise_or(tf.bitwise.left_shift(u64[1], shift), u64[2])
    words = tf.raw_ops.StatelessRandomUniformFullIntV2(
        shape=[num_crops * keyed_crops.CROP_BLOCKS * 4],
        key=tf.reshape(philox_key, [1]),
        counter=tf.stack([tf.constant(0, tf.uint64), high]),
        alg=_PHILOX,
        dtype=tf.uint32,
    )
    return tf.reshape(words, [num_crops, -1])[:, : keyed_crops.WORDS]


def crop_windows(height, width, scales, ratio, draws: tf.Tensor) -> tf.Tensor:
    """keyed_crops.crop_window of every crop at once, in float64 ops: int32 (num_crops, 4)
    (top, left, h, w) from (num_crops, 4 * _MAX_ATTEMPTS) uniform ``draws`` (float64), each
    crop's area range in ``scales`` ((low, high) per crop), its first attempt that fits or the
    whole image. One set of ops for all crops: per crop, they would cost multi-crop a tenth."""
    a = tf.reshape(draws, [tf.shape(draws)[0], -1, 4])  # (crops, attempts, 4)
    aspect = a[..., 0] * (ratio[1] - ratio[0]) + ratio[0]
    fh, fw = tf.cast(height, tf.float64), tf.cast(width, tf.float64)
    low, high = (tf.constant([[s[i]] for s in scales], tf.float64) for i in (0, 1))
    min_area, max_area = low * fw * fh, high * fw * fh
    h = tf.round(tf.sqrt(min_area / aspect))
    max_h = tf.round(tf.sqrt(max_area / aspect))
    narrow = tf.floor((fw + 0.5 - 1e-7) / aspect)
    narrow = tf.where(tf.round(narrow * aspect) > fw, narrow - 1, narrow)
    max_h = tf.minimum(tf.where(tf.round(max_h * aspect) > fw, narrow, max_h), fh)
    h = tf.minimum(h, max_h)
    h = tf.where(h < max_h, h + tf.floor(a[..., 1] * (max_h - h + 1)), h)
    # w is round(h * aspect) of the h at hand: one step up where too small, one down if too big.
    h = tf.where(tf.round(h * aspect) * h < min_area, h + 1, h)
    h = tf.where(tf.round(h * aspect) * h > max_area, h - 1, h)
    w = tf.round(h * aspect)
    area = w * h
    fits = (area >= tf.maximum(min_area, 1.0)) & (area <= max_area)
    fits &= (w <= fw) & (h <= fh) & (w > 0)
    top = tf.where(h < fh, tf.floor(a[..., 2] * (fh - h)), 0.0)
    left = tf.where(w < fw, tf.floor(a[..., 3] * (fw - w)), 0.0)
    boxes = tf.stack([top, left, h, w], axis=-1)  # (crops, attempts, 4)
    first = tf.argmax(tf.cast(fits, tf.int32), axis=1, output_type=tf.int32)
    chosen = tf.gather(boxes, first, batch_dims=1)
    whole = tf.broadcast_to(tf.stack([0.0, 0.0, fh, fw]), tf.shape(chosen))
    found = tf.reduce_any(fits, axis=1, keepdims=True)
    return tf.cast(tf.where(found, chosen, whole), tf.int32)
