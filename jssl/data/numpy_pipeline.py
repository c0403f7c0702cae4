"""The demo data's input pipeline in numpy: the tf.data pipeline's batches without TensorFlow.

jssl.data.backend picks it for data.source="demo" where TensorFlow is not installed (or with
data.loader="numpy"). The images are jssl.data.demo's, generated in memory, so the dataset is
the one the TFDS builder stores. Batches have jssl.data.pipeline's layout and its exact training
order (jssl.data.order: a seeded permutation per epoch, this process's rows of each global
batch), so a run resumes and shards the same way.

The host makes only each crop's box, resize and flip, as uint8, and hands the train step the
crop's colour, blur and solarise seeds (jssl.data.device_augment), as data.augment.on_device
does on tf.data; where no crop group needs more than crop and flip (the linear heads' training
images) it finishes the views itself: float32, normalised. The draws are jssl.data.keyed_crops's,
a function of (seed, epoch, dataset index, crop number) alone and the same as tf.data's with
data.augment.on_device; the resize is tf.image.resize's bilinear with antialiasing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator

import numpy as np

from jssl.data import backend, crops, demo, keyed_crops, order, sources, splits


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


def host_view(
    image: np.ndarray, words: np.ndarray, group: crops.CropGroup, augment, finish: bool
) -> tuple[np.ndarray, np.ndarray]:
    """One crop of a uint8 (H, W, 3) image and the (3, 2) uint32 seeds from which the step makes
    the rest of its view (jssl.data.keyed_crops draws both from ``words``): the crop in uint8,
    or with ``finish`` (crop and flip are all the view needs) the float32 normalised view."""
    draw = keyed_crops.crop_draw(words, image.shape[0], image.shape[1], group, augment.crop_ratio)
    top, left, h, w = draw.box
    crop = image[top : top + h, left : left + w]
    if finish:  # the host path's float view (transforms.random_resized_crop, then normalize)
        crop = resize(crop.astype(np.float32) / 255.0, group.size, group.size).clip(0.0, 1.0)
    else:  # crops.host_crops: round half up to uint8
        crop = np.clip(resize(crop.astype(np.float32), group.size, group.size) + 0.5, 0, 255)
        crop = crop.astype(np.uint8)
    if draw.flip:
        crop = crop[:, ::-1]
    if finish:
        crop = (crop - np.asarray(augment.mean, np.float32)) / np.asarray(augment.std, np.float32)
    return crop, draw.seeds


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

        out = keyed_crops.keyed_views(
            [int(i) for i in indices], groups, view, seed=seed, epoch=epoch
        )
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
