"""The keyed crop draws every loader shares: numpy's Philox4x32-10 is TensorFlow's, the tf.data
twin of the words and of the box equals the numpy one exactly, and the key has room checked."""

import numpy as np
import pytest
import tensorflow as tf

from jssl.data import keyed_crops, keyed_crops_tf


def test_philox_is_tensorflows():
    key, high = 0x123456789ABCDEF0, (3 << 40) | 12345
    low = np.arange(5, dtype=np.uint64) + np.uint64(2**32 - 2)  # carries into the second word
    ours = keyed_crops.philox4x32(key, np.full(5, high, np.uint64), low).reshape(-1)
    theirs = tf.raw_ops.StatelessRandomUniformFullIntV2(
        shape=[20],
        key=tf.constant([key], tf.uint64),
        counter=tf.constant([2**32 - 2, high], tf.uint64),
        alg=1,
        dtype=tf.uint32,
    )
    np.testing.assert_array_equal(ours, theirs.numpy())


@pytest.mark.parametrize("seed, epoch, index", [(0, 0, 0), (7, 3, 1_281_166), (-5, 99, 2**39)])
def test_tf_words_are_numpys(seed, epoch, index):
    key = tf.constant([seed, epoch, index], tf.int64)
    ours = keyed_crops.example_words(seed, epoch, [index], 5)[0]
    np.testing.assert_array_equal(keyed_crops_tf.example_words(key, 5).numpy(), ours)
    np.testing.assert_array_equal(keyed_crops.view_words(seed, epoch, index, 3), ours[3])
    assert ours.shape == (5, keyed_crops.WORDS)
    assert len({tuple(w) for w in ours}) == 5  # crops draw apart


def test_tf_box_is_numpys():
    rng = np.random.default_rng(0)
    scales = [(0.08, 1.0), (0.05, 0.25), (0.9, 1.0), (0.14, 1.0)]  # one per crop
    whole = 0
    for t in range(100):
        height, width = (int(s) for s in rng.integers(1, 400, 2))
        ratio = [(3 / 4, 4 / 3), (0.2, 5.0)][t % 2]
        draws = rng.random((len(scales), 40))
        tf_boxes = keyed_crops_tf.crop_windows(height, width, scales, ratio, tf.constant(draws))
        for scale, crop_draws, tf_box in zip(scales, draws, tf_boxes.numpy(), strict=True):
            ours = keyed_crops.crop_window(height, width, scale, ratio, crop_draws.tolist())
            assert tuple(tf_box.tolist()) == ours, (height, width, scale, ratio)
            top, left, h, w = ours
            assert 0 <= top and 0 <= left and 0 < h and top + h <= height and left + w <= width
            whole += ours == (0, 0, height, width)
    assert 0 < whole < 200  # the fallback is taken (tiny images, narrow ranges), not always


def test_the_counter_has_room():
    keyed_crops.counter_high(2**24 - 1, [2**40 - 1])
    with pytest.raises(ValueError, match="no room"):
        keyed_crops.counter_high(0, [2**40])
    with pytest.raises(ValueError, match="no room"):
        keyed_crops.counter_high(2**24, [0])
