"""The crop draws every loader makes from an example's key: box, flip and the step's seeds.

A crop's randomness is a function of (seed, epoch, dataset index, crop number) alone: the
Philox4x32-10 counter-based generator (Salmon et al., SC 2011; TensorFlow's stateless "philox",
which jssl.data.keyed_crops_tf calls in tf.data) keyed by the seed, counting from (epoch,
index), gives each crop WORDS uint32 words: the crop box (one attempt after another of
tf.image.sample_distorted_bounding_box's algorithm), the flip's coin and the (3, 2) uint32
colour, blur and solarise seeds from which the train step makes the rest of the view
(jssl.data.device_augment). The numpy demo pipeline, grain and tf.data's data.augment.on_device
path all draw these, so they cut the same boxes, flip the same crops and hand the step the same
seeds for the same keys, on any number of processes and after a resume.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

_MAX_ATTEMPTS = 10  # crop boxes tried before the whole image is used (transforms.crop_window)
SEED_WORDS = 6  # the step's colour, blur and solarise seeds: (3, 2) uint32
WORDS = SEED_WORDS + 1 + 4 * _MAX_ATTEMPTS  # + the flip's coin + 4 draws per box attempt
CROP_BLOCKS = 12  # Philox blocks of 4 words per crop: 48 >= WORDS
_VIEWS_STREAM = 0x6A73736C  # keeps the views' key apart from the seed's other uses
INDEX_BITS = 40  # the counter's high half is epoch << INDEX_BITS | dataset index
_MASK32, _MASK64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # Philox4x32's multipliers
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # and its key schedule's Weyl increments


class CropDraw(NamedTuple):
    """One crop's draws: its box (top, left, h, w), whether it is flipped, its step seeds."""

    box: tuple[int, int, int, int]
    flip: bool
    seeds: np.ndarray  # (3, 2) uint32


def _box(height: int, width: int, scale, aspect: float, draws):
    """One attempt of tf.image.sample_distorted_bounding_box's GenerateRandomCrop
    (tensorflow/core/kernels/image/sample_distorted_bounding_box_op.cc) with uniform ``draws``
    in [0, 1): (top, left, h, w), or None where the area constraints cannot be met. Python's
    round() rounds half to even, as the kernel's lrintf."""
    min_area, max_area = scale[0] * width * height, scale[1] * width * height
    h = round(math.sqrt(min_area / aspect))
    max_h = round(math.sqrt(max_area / aspect))
    if round(max_h * aspect) > width:
        max_h = int((width + 0.5 - 1e-7) / aspect)
        if round(max_h * aspect) > width:
            max_h -= 1
    max_h = min(max_h, height)
    h = min(h, max_h)
    if h < max_h:
        h += int(draws[0] * (max_h - h + 1))
    w = round(h * aspect)
    if w * h < min_area:
        h += 1
        w = round(h * aspect)
    if w * h > max_area:
        h -= 1
        w = round(h * aspect)
    area = w * h
    if area < max(min_area, 1) or area > max_area or w > width or h > height or w <= 0:
        return None
    top = int(draws[1] * (height - h)) if h < height else 0
    left = int(draws[2] * (width - w)) if w < width else 0
    return top, left, h, w


def crop_window(height: int, width: int, scale, ratio, draws) -> tuple[int, int, int, int]:
    """(top, left, h, w) of a random resized crop from 4 * _MAX_ATTEMPTS uniform ``draws``:
    transforms.crop_window's box (area fraction in ``scale``, aspect ratio uniform in
    ``ratio``), the whole image when no attempt fits."""
    for a in range(_MAX_ATTEMPTS):
        attempt = draws[4 * a : 4 * a + 4]
        aspect = attempt[0] * (ratio[1] - ratio[0]) + ratio[0]
        box = _box(height, width, scale, aspect, attempt[1:])
        if box is not None:
            return box
    return 0, 0, height, width


def philox_key(seed: int) -> int:
    """The generator's 64-bit key for a run seeded ``seed``."""
    return (int(seed) ^ (_VIEWS_STREAM << 32)) & _MASK64


def counter_high(epoch: int, index) -> np.ndarray:
    """The counter's high 64 bits for an example: epoch above the dataset index."""
    index = np.asarray(index, np.uint64)
    if int(epoch) >= 1 << (64 - INDEX_BITS) or np.any(index >= np.uint64(1 << INDEX_BITS)):
        raise ValueError(f"epoch {epoch} or an index past 2**{INDEX_BITS}: no room in the counter.")
    return (np.uint64(epoch) << np.uint64(INDEX_BITS)) | index


def philox4x32(key: int, high: np.ndarray, low: np.ndarray) -> np.ndarray:
    """Philox4x32-10 of the 128-bit counters (low, high) (uint64 arrays of one shape) under
    ``key``: (..., 4) uint32, the words TensorFlow's stateless philox makes for them."""
    mask = np.uint64(_MASK32)
    c = [low & mask, low >> np.uint64(32), high & mask, high >> np.uint64(32)]
    k0, k1 = np.uint64(key & _MASK32), np.uint64(key >> 32)
    m0, m1 = np.uint64(_PHILOX_M[0]), np.uint64(_PHILOX_M[1])
    for _ in range(10):
        p0, p1 = m0 * c[0], m1 * c[2]  # 32 x 32 -> 64 bits: no wrap
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c[3] ^ k1]
        c.append(p0 & mask)
        k0 = (k0 + np.uint64(_PHILOX_W[0])) & mask
        k1 = (k1 + np.uint64(_PHILOX_W[1])) & mask
    return np.stack(c, axis=-1).astype(np.uint32)


def example_words(seed: int, epoch: int, indices, num_crops: int) -> np.ndarray:
    """(n, num_crops, WORDS) uint32: the words of every crop of the examples ``indices``,
    crop c taking the Philox blocks c * CROP_BLOCKS onwards of its example's counter."""
    blocks = np.arange(num_crops * CROP_BLOCKS, dtype=np.uint64)
    high = counter_high(epoch, indices)[:, None] + np.zeros_like(blocks)
    words = philox4x32(philox_key(seed), high, np.broadcast_to(blocks, high.shape))
    return words.reshape(len(high), num_crops, CROP_BLOCKS * 4)[..., :WORDS]


def view_words(seed: int, epoch: int, index: int, crop: int) -> np.ndarray:
    """The WORDS uint32 words of one crop: a function of its key alone."""
    return example_words(seed, epoch, [index], crop + 1)[0, crop]


def crop_draw(words: np.ndarray, height: int, width: int, group, ratio) -> CropDraw:
    """The draws of one crop of an (height, width) image from its ``words``."""
    uniforms = (words[SEED_WORDS:] / 2.0**32).tolist()  # python floats: the box is scalar work
    box = crop_window(height, width, group.scale, ratio, uniforms[1:])
    return CropDraw(box, uniforms[0] < group.flip_prob, words[:SEED_WORDS].reshape(3, 2))


def _numbered(groups) -> list[tuple[int, int]]:
    """(group, crop number) of every crop of an example, crops numbered over the groups."""
    owners = [g for g, group in enumerate(groups) for _ in range(group.num_crops)]
    return [(g, c) for c, g in enumerate(owners)]


def keyed_views(indices: list[int], groups, view, *, seed: int, epoch: int) -> dict:
    """{"crops", "aug_seeds"}: one (n, num_crops, ...) array per crop group of the views
    ``view(index, words, group) -> (crop, seeds)`` makes of each example from its crops' keyed
    words (example_words: crop numbers run over the groups in order)."""
    numbered = _numbered(groups)
    words = example_words(seed, epoch, indices, len(numbered))
    views, seeds = [[] for _ in groups], [[] for _ in groups]
    for i, index in enumerate(indices):
        for g, c in numbered:
            crop, crop_seeds = view(index, words[i, c], groups[g])
            views[g].append(crop)
            seeds[g].append(crop_seeds)

    def per_example(g: int, items: list) -> np.ndarray:  # (n * crops, ...) -> (n, crops, ...)
        stacked = np.stack(items)
        return stacked.reshape(len(indices), groups[g].num_crops, *stacked.shape[1:])

    return {
        "crops": tuple(per_example(g, v) for g, v in enumerate(views)),
        "aug_seeds": tuple(per_example(g, s) for g, s in enumerate(seeds)),
    }
