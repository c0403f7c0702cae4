"""What the train engine writes to TensorBoard besides scalars: augmented views, averages."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np


def mean_metrics(collected: Sequence[dict]) -> dict[str, float]:
    """Averages a window of per-step metric dicts (device arrays) in one host transfer."""
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
    from PIL import Image

    Image.fromarray(image).save(path)
