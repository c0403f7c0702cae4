"""Images without TensorFlow, for the grain pipeline: decode with Pillow, crop and resize with
Pillow's antialiased bilinear filter, in uint8.

Pillow's BILINEAR resize widens its triangle kernel by the downscaling factor, as
tf.image.resize(..., "bilinear", antialias=True) does, with half-pixel centres; it works on
uint8 and rounds between its horizontal and vertical passes, so a crop differs from the tf.data
pipeline's by a unit or so of 255 where the box is the same. Pillow's wheels decode JPEG with
libjpeg-turbo, as TensorFlow does, and release the GIL while decoding and resizing.
"""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image, UnidentifiedImageError

# What Pillow raises for a file it cannot read: truncated or corrupt data, an unknown format.
DECODE_ERRORS = (
    OSError,
    UnidentifiedImageError,
    ValueError,
    SyntaxError,
    Image.DecompressionBombError,
)


class UnreadableImage(Exception):
    """An example whose image cannot be decoded; ``what`` names it (a path or an index)."""

    def __init__(self, what: str, cause: BaseException | None = None):
        super().__init__(f"Unreadable or corrupt image: {what} ({cause})")
        self.what = what


def open_rgb(data: bytes | str | os.PathLike | np.ndarray, what: str) -> Image.Image:
    """An RGB Pillow image, fully decoded, of encoded bytes, a file path or a uint8 array (the
    demo data); grey, palette and RGBA images become RGB, an animation its first frame."""
    try:
        if isinstance(data, np.ndarray):
            return Image.fromarray(data)
        image = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
        image = image.convert("RGB")  # also decodes it: errors surface here
    except DECODE_ERRORS as e:
        raise UnreadableImage(what, e) from e
    return image


def crop_resize(image: Image.Image, box: tuple[int, int, int, int], size: int) -> np.ndarray:
    """The (top, left, h, w) ``box`` of ``image`` resized to (size, size, 3) uint8. Cut out
    first, as tf.data's crop: resizing within the box would blend in pixels beside it."""
    top, left, h, w = box
    resized = image.crop((left, top, left + w, top + h)).resize((size, size), Image.BILINEAR)
    return np.asarray(resized, dtype=np.uint8)


def eval_view(image: Image.Image, size: int, mean, std) -> np.ndarray:
    """jssl.data.transforms.eval_image with Pillow: the shorter side resized to size / 0.875 (to
    ``size`` when it is at most ``size``), the aspect ratio kept, the centre size^2 crop,
    normalised float32."""
    w, h = image.size
    short = min(h, w)
    scale = np.float32(size if short <= size else size / 0.875) / np.float32(short)
    new_h = max(int(np.rint(np.float32(h) * scale)), size)
    new_w = max(int(np.rint(np.float32(w) * scale)), size)
    resized = np.asarray(image.resize((new_w, new_h), Image.BILINEAR), dtype=np.float32)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    out = resized[top : top + size, left : left + size] / np.float32(255.0)
    return (out - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
