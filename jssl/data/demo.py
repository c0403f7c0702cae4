"""The built-in demo dataset: 10 classes of coloured shapes, generated offline as a TFDS builder.

It exists so that every method can be run end to end on a laptop CPU without a download, through
the same TFDS code path as ImageNet. The class is defined by the shape only; foreground and
background colours, size and position are random, so colour is a nuisance
that colour distortion teaches an SSL method to ignore (the point of SimCLR's colour ablation,
arXiv:2002.05709 section 3). Generation is deterministic: example i of a split always comes from
numpy seed (split, i), and shuffling is disabled so the stored order is the generation order.
"""

from __future__ import annotations

import numpy as np
import tensorflow_datasets as tfds

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


class JsslDemo(tfds.core.GeneratorBasedBuilder):
    """TFDS builder "jssl_demo": procedurally generated shapes, no download."""

    VERSION = tfds.core.Version("1.5.0")
    RELEASE_NOTES = {
        "1.0.0": "Initial release: 10 shape classes, 8000 train / 2000 test.",
        "1.1.0": "Plain gradient backgrounds and larger, central shapes (no texture shortcut).",
        "1.2.0": "Palette colours shared across images, uniform backgrounds (no identity cues).",
        "1.3.0": "No per-image pixel noise (a fingerprint shared by overlapping crops).",
        "1.4.0": "Per-image shape geometry: stretch, small rotation, stroke thickness.",
        "1.5.0": "Dark backgrounds, light foregrounds: shapes stay visible in grayscale.",
    }
    # No download, so no checksums file to locate. Locating it (the inherited `code_path`) imports
    # the `importlib_resources` backport, which TFDS 4.9.10 does not declare as a dependency.
    code_path = None

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description="10 classes of shapes in palette colours on uniform backgrounds.",
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(IMAGE_SIZE, IMAGE_SIZE, 3)),
                    "label": tfds.features.ClassLabel(names=CLASS_NAMES),
                }
            ),
            supervised_keys=("image", "label"),
            # Keep generation order on disk so that dataset index i is example i of the split.
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # everything is generated locally
        return {split: self._generate_examples(split, n) for split, n in SPLIT_SIZES.items()}

    def _generate_examples(self, split: str, num: int):
        for index in range(num):
            image, label = make_example(split, index)
            yield index, {"image": image, "label": label}
