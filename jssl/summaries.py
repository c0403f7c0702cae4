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


def write_views(writer, views: Sequence[np.ndarray], augment_config) -> None:
    """Writes the first training examples' augmented views, so augmentations can be checked."""
    if jax.process_index() != 0:
        return
    # Views of different sizes (multi-crop) go in one grid per size.
    by_size: dict[tuple[int, int], list[np.ndarray]] = {}
    for v in views:
        by_size.setdefault(tuple(v.shape[1:3]), []).append(v)
    images = {
        f"augmented_views_{h}px": view_grid(group, augment_config.mean, augment_config.std)[None]
        for (h, _), group in by_size.items()
    }
    writer.write_images(0, images)
