"""The built-in demo dataset: 10 classes of coloured shapes, generated offline.

It exists so that every method can be run end to end on a laptop CPU without a download. Where
TensorFlow is installed it is read through the same TFDS code path as ImageNet (the builder
"jssl_demo", jssl.data.demo_tfds, stores these images); without TensorFlow the numpy pipeline
(jssl.data.numpy_pipeline) reads the same images from ``split_images``.

The class is defined by the shape only; foreground and background colours, size and position
are random, so colour is a nuisance that colour distortion teaches an SSL method to ignore (the
point of SimCLR's colour ablation, arXiv:2002.05709 section 3). Generation is deterministic:
example i of a split always comes from numpy seed (split, i), and the TFDS builder disables
shuffling, so its stored order is the generation order.
"""

from __future__ import annotations

import numpy as np

IMAGE_SIZE = 32
CLASS_NAMES = (
    "circle",
    "square",
    "triangle",
    "cross",
    "ring",
    "horizontal_bar",
    "vertical_bar",
    "diamond",
    "plus",
    "two_dots",
)
SPLIT_SIZES = {"train": 8000, "test": 2000}
VERSION = "1.5.0"  # the TFDS builder's version: bump it with any change to make_example
# Eight well separated colours (RGB in [0, 1]).
_PALETTE = np.array(
    [
        [0.9, 0.1, 0.1],
        [0.1, 0.7, 0.2],
        [0.15, 0.3, 0.9],
        [0.95, 0.85, 0.1],
        [0.6, 0.2, 0.8],
        [0.1, 0.8, 0.85],
        [0.95, 0.5, 0.1],
        [0.5, 0.5, 0.5],
    ]
)
_SPLIT_SEEDS = {"train": 0, "test": 1}  # different seeds: test images are not copies of train ones


def _shape_mask(
    label: int, dx: np.ndarray, dy: np.ndarray, r: float, thick: float = 1.0
) -> np.ndarray:
    """Boolean mask of shape `label` centred at the origin of (dx, dy) with radius r; `thick`
    scales the width of bars, arms and the ring."""
    ax, ay = np.abs(dx), np.abs(dy)
    dist2 = dx**2 + dy**2
    if label == 0:  # circle
        return dist2 <= r**2
    if label == 1:  # square
        return (ax <= 0.8 * r) & (ay <= 0.8 * r)
    if label == 2:  # upward triangle
        return (dy >= -r) & (dy <= 0.8 * r) & (ax <= 0.55 * (dy + r))
    if label == 3:  # diagonal cross
        arm = 0.3 * r * thick
        return ((np.abs(dx - dy) <= arm) | (np.abs(dx + dy) <= arm)) & (ax <= r) & (ay <= r)
    if label == 4:  # ring
        return (dist2 <= r**2) & (dist2 >= ((1 - 0.45 * thick) * r) ** 2)
    if label == 5:  # horizontal bar
        return (ay <= 0.3 * r * thick) & (ax <= r)
    if label == 6:  # vertical bar
        return (ax <= 0.3 * r * thick) & (ay <= r)
    if label == 7:  # diamond
        return ax + ay <= r
    if label == 8:  # plus
        w = 0.25 * r * thick
        return ((ax <= w) & (ay <= r)) | ((ay <= w) & (ax <= r))
    # two dots side by side
    dot = (0.4 * r) ** 2
    return ((dx - 0.55 * r) ** 2 + dy**2 <= dot) | ((dx + 0.55 * r) ** 2 + dy**2 <= dot)


def make_example(split: str, index: int) -> tuple[np.ndarray, int]:
    """The (image uint8 32x32x3, label) of example `index` of `split`; balanced labels."""
    rng = np.random.default_rng([_SPLIT_SEEDS[split], index])
    label = index % len(CLASS_NAMES)
    size = IMAGE_SIZE
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)

    # Colours come from a small shared palette, so that many images (of every class) share
    # each (background, foreground) pair: telling one image from the others then takes its
    # shape, size and position, which is what an SSL method should learn. Continuous random
    # colours (v1.0, v1.1) made the colour pair, and a random background gradient direction,
    # a per-image identity that survives cropping and colour jitter, and contrastive methods
    # learned those instead of shapes.
    bg, fg = rng.choice(len(_PALETTE), size=2, replace=False)
    # A dark background and a light foreground: the shape keeps its contrast under grayscale
    # and colour jitter. Palette pairs of equal luminance (red and blue, grey and green) made the
    # shape vanish from grayscale views (v1.4), leaving views with nothing to match.
    background = 0.3 * _PALETTE[bg]
    foreground = 0.45 + 0.55 * _PALETTE[fg]
    image = np.broadcast_to(background, (size, size, 3)).astype(np.float64)

    # Large, roughly central shapes, so most random crops still contain part of the shape.
    radius = rng.uniform(8.0, 13.0)
    cx, cy = rng.uniform(max(radius, size / 2 - 5), min(size - radius, size / 2 + 5), 2)
    # Per-image geometry: a stretch, a small rotation (small, so bars and crosses keep their
    # class) and a stroke thickness. It survives crops and colour jitter, differs from image
    # to image and belongs to the shape, so telling instances apart teaches shape features.
    angle = rng.uniform(-np.pi / 12, np.pi / 12)
    stretch = np.exp(rng.uniform(-0.3, 0.3))
    dx, dy = xx - cx, yy - cy
    rx = (np.cos(angle) * dx + np.sin(angle) * dy) * stretch
    ry = (-np.sin(angle) * dx + np.cos(angle) * dy) / stretch
    mask = _shape_mask(label, rx, ry, radius, thick=rng.uniform(0.6, 1.4))
    image = np.where(mask[..., None], foreground[None, None, :], image)
    # No pixel noise: an image's fixed noise pattern, shared by its overlapping crops, is a
    # fingerprint that contrastive methods match instead of learning the shape (v1.2 had it).
    return np.clip(image * 255.0 + 0.5, 0, 255).astype(np.uint8), label


_GENERATED: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # split -> (images, labels) so far


def split_images(split: str, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``count`` examples of ``split``: uint8 images (count, 32, 32, 3) and int32
    labels, generated once per process (0.2 ms an image) and extended when more are asked.
    Example i is ``make_example(split, i)``, as in the TFDS builder's files."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"The demo data has splits {sorted(SPLIT_SIZES)}, not {split!r}.")
    count = min(count, SPLIT_SIZES[split])
    images, labels = _GENERATED.get(
        split, (np.zeros((0, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8), np.zeros(0, np.int32))
    )
    if len(images) < count:
        new = [make_example(split, i) for i in range(len(images), count)]
        images = np.concatenate([images, np.stack([image for image, _ in new])])
        labels = np.concatenate([labels, np.asarray([label for _, label in new], np.int32)])
        _GENERATED[split] = images, labels
    return images[:count], labels[:count]
