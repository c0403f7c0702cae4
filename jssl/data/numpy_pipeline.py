"""The demo data's input pipeline in numpy: the tf.data pipeline's batches without TensorFlow.

jssl.data.backend picks it for data.source="demo" where TensorFlow is not installed (or with
data.loader="numpy"). The images are jssl.data.demo's, generated in memory, so the dataset is
the one the TFDS builder stores. Batches have jssl.data.pipeline's layout and its exact training
order (jssl.data.order: a seeded permutation per epoch, this process's rows of each global
batch), so a run resumes and shards the same way.

The host makes only each crop's box, resize and flip, as uint8, and hands the train step the
crop's colour, blur and solarise seeds (jssl.data.device_augment; the colour seed also keys
RandAugment and random erasing), as data.augment.on_device does on tf.data. Where no crop group
needs more than crop and flip (the linear heads' training images) the host finishes the views
itself: float32, normalised. A crop's randomness is a
function of (seed, epoch, dataset index, crop number) alone, so the views are the same on any
number of processes and after a resume; the draws are numpy's, so they follow the tf.data
pipeline's distributions (the crop box is tf.image.sample_distorted_bounding_box's algorithm,
the resize bilinear with antialiasing) without being the same views.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator

import numpy as np

from jssl.data import backend, crops, demo, order, sources, splits

_MAX_ATTEMPTS = 10  # crop boxes tried before the whole image is used (transforms.crop_window)
SEED_WORDS = 6  # the step's colour, blur and solarise seeds: (3, 2) uint32
_WORDS = SEED_WORDS + 1 + 4 * _MAX_ATTEMPTS  # + the flip's coin + 4 draws per box attempt
_VIEWS_STREAM = 0x6A73736C  # keeps the views' seeds apart from order.epoch_seed's


class Batches:
    """One pass of host batches, with tf.data.Dataset's ``as_numpy_iterator()`` so that the
    engines read either pipeline the same way; each iteration starts the pass afresh."""

    def __init__(self, make: Callable[[], Iterator[dict]], length: int):
        self._make, self._length = make, length

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[dict]:
        return self._make()

    def as_numpy_iterator(self) -> Iterator[dict]:
        return self._make()


@functools.lru_cache(maxsize=256)
def resize_weights(in_size: int, out_size: int) -> np.ndarray:
    """(out_size, in_size) weights of a bilinear resize along one axis with antialiasing: the
    triangle kernel of tf.image.resize(..., "bilinear", antialias=True), widened by the
    downscaling factor and renormalised at the borders (half-pixel centres)."""
    scale = out_size / in_size
    kernel_width = max(1.0 / scale, 1.0)
    centres = (np.arange(out_size) + 0.5) / scale
    taps = np.arange(in_size) + 0.5
    weights = np.maximum(0.0, 1.0 - np.abs(taps[None] - centres[:, None]) / kernel_width)
    return (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)


def resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """A (h, w, 3) image resized to (height, width, 3), float32 in the input's range."""
    rows = resize_weights(image.shape[0], height) @ image.reshape(image.shape[0], -1)
    rows = rows.reshape(height, image.shape[1], image.shape[2]).astype(np.float32)
    # (width, w) @ (height, w, 3) -> (height, width, 3): the column weights per output row.
    return np.matmul(resize_weights(image.shape[1], width), rows)


def _box(height: int, width: int, scale, aspect: float, draws: np.ndarray):
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


def view_words(seed: int, epoch: int, index: int, crop: int) -> np.ndarray:
    """The _WORDS uint32 random words of one crop: a function of its key alone."""
    key = [seed, epoch, index, crop, _VIEWS_STREAM]
    return np.random.SeedSequence(key).generate_state(_WORDS, np.uint32)


def keyed_views(indices: list[int], groups, view, *, seed: int, epoch: int) -> dict:
    """{"crops", "aug_seeds"}: one (n, num_crops, ...) array per crop group of the views
    ``view(index, words, group) -> (crop, seeds)`` makes of each example from its crops' keyed
    words (view_words: crop numbers run over the groups in order)."""
    views, seeds = [[] for _ in groups], [[] for _ in groups]
    for index in indices:
        c = 0
        for g, group in enumerate(groups):
            for _ in range(group.num_crops):
                crop, crop_seeds = view(index, view_words(seed, epoch, index, c), group)
                views[g].append(crop)
                seeds[g].append(crop_seeds)
                c += 1

    def per_example(g: int, items: list) -> np.ndarray:  # (n * crops, ...) -> (n, crops, ...)
        stacked = np.stack(items)
        return stacked.reshape(len(indices), groups[g].num_crops, *stacked.shape[1:])

    return {
        "crops": tuple(per_example(g, v) for g, v in enumerate(views)),
        "aug_seeds": tuple(per_example(g, s) for g, s in enumerate(seeds)),
    }


def host_view(
    image: np.ndarray, words: np.ndarray, group: crops.CropGroup, augment, finish: bool
) -> tuple[np.ndarray, np.ndarray]:
    """One crop of a uint8 (H, W, 3) image and the (3, 2) uint32 seeds from which the step makes
    the rest of its view: the crop in uint8, or with ``finish`` (crop and flip are all the view
    needs) the float32 normalised view."""
    uniforms = (words[SEED_WORDS:] / 2.0**32).tolist()  # python floats: the box is scalar work
    top, left, h, w = crop_window(
        image.shape[0], image.shape[1], group.scale, augment.crop_ratio, uniforms[1:]
    )
    crop = image[top : top + h, left : left + w]
    if finish:  # the host path's float view (transforms.random_resized_crop, then normalize)
        crop = resize(crop.astype(np.float32) / 255.0, group.size, group.size).clip(0.0, 1.0)
    else:  # crops.host_crops: round half up to uint8
        crop = np.clip(resize(crop.astype(np.float32), group.size, group.size) + 0.5, 0, 255)
        crop = crop.astype(np.uint8)
    if uniforms[0] < group.flip_prob:
        crop = crop[:, ::-1]
    if finish:
        crop = (crop - np.asarray(augment.mean, np.float32)) / np.asarray(augment.std, np.float32)
    return crop, words[:SEED_WORDS].reshape(3, 2)


def _split_arrays(source: sources.SplitSource) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of the examples of ``source``, dataset index i at row i."""
    images, labels = demo.split_images(source.base_split, source.offset + source.num_examples)
    return images[source.offset :], labels[source.offset :]


def build_train_dataset(
    data_config,
    *,
    seed: int,
    epoch: int,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
) -> Batches:
    """This process's batches of one training epoch, as jssl.data.pipeline's: "crops" (one
    (local batch, num_crops, S, S, 3) array per group), "label", "index", "replaced", and
    "aug_seeds" where the step makes the views (backend.views_on_device)."""
    local_batch, source, steps, start_step = splits.train_epoch(
        data_config, start_step=start_step, process_count=process_count
    )
    global_order = order.epoch_order(
        source.num_examples, data_config.batch_size, seed=seed, epoch=epoch
    )
    stream = order.process_order(global_order, process_index, process_count)
    rows = stream[start_step * local_batch : steps * local_batch].reshape(-1, local_batch)
    groups = crops.crop_groups(data_config)
    augment = data_config.augment
    on_device = backend.views_on_device(data_config)
    finish = not on_device  # crop and flip are the whole view
    images, labels = _split_arrays(source)

    def batch(indices: np.ndarray) -> dict:
        def view(index, words, group):
            return host_view(images[index], words, group, augment, finish)

        out = keyed_views([int(i) for i in indices], groups, view, seed=seed, epoch=epoch)
        if not on_device:
            del out["aug_seeds"]
        out.update(
            label=labels[indices].astype(np.int32),
            index=indices.astype(np.int64),
            replaced=np.zeros(len(indices), bool),  # generated images are always readable
        )
        return out

    return Batches(lambda: (batch(indices) for indices in rows), len(rows))


def eval_image(image: np.ndarray, size: int, mean, std) -> np.ndarray:
    """transforms.eval_image in numpy: the shorter side resized to size / 0.875 (to ``size``
    when it is at most ``size``), the aspect ratio kept, then centre-cropped to size^2 and
    normalised."""
    image = image.astype(np.float32) / 255.0
    h, w = image.shape[:2]
    short = min(h, w)
    # In float32, as the tf.data version computes the new sides.
    scale = np.float32(size if short <= size else size / 0.875) / np.float32(short)
    new_h = max(int(np.rint(np.float32(h) * scale)), size)
    new_w = max(int(np.rint(np.float32(w) * scale)), size)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    out = resize(image, new_h, new_w)[top : top + size, left : left + size]
    out = out.clip(0.0, 1.0)
    return (out - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


def build_eval_dataset(
    data_config,
    split: str,
    *,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
) -> Batches:
    """This process's batches over the whole ``split``, as jssl.data.pipeline's: {"image",
    "label", "index", "mask"}, its contiguous shard then padding rows (mask False, index -1)."""
    local_batch = order.local_batch(batch_size, process_count)
    source = sources.resolve_split(data_config, split)
    start, end = order.shard_bounds(source.num_examples, process_count, process_index)
    num_batches = math.ceil(math.ceil(source.num_examples / process_count) / local_batch)
    size, augment = data_config.image_size, data_config.augment
    images, labels = _split_arrays(source)

    def batch(b: int) -> dict:
        first = start + b * local_batch
        indices = np.arange(first, min(first + local_batch, end), dtype=np.int64)
        pad = local_batch - len(indices)
        views = [eval_image(images[i], size, augment.mean, augment.std) for i in indices]
        return {
            "image": np.stack(views + [np.zeros((size, size, 3), np.float32)] * pad),
            "label": np.concatenate([labels[indices], np.zeros(pad, np.int32)]).astype(np.int32),
            "index": np.concatenate([indices, np.full(pad, -1, np.int64)]),
            "mask": np.arange(local_batch) < len(indices),
        }

    return Batches(lambda: (batch(b) for b in range(num_batches)), num_batches)
