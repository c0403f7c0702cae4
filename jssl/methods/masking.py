"""Patch masks for masked-image distillation (iBOT, DINOv2), drawn per example in pure JAX.

A crop's mask is a function of one key, ``fold_in(example key, crop)`` with the example key
from ``common.example_keys(step key, batch["index"], MASK_STREAM)``: the same on any number of
devices, in any micro-batch and after a resume, with no host-side state.

Blockwise masking is BEiT's (Bao et al. 2022, Sec. 2.5), as iBOT's ``ImageFolderMask``
(bytedance/ibot loader.py, ``pred_shape="block"``) and DINOv2's ``MaskingGenerator``
(dinov2/data/masking.py) run it (:func:`block_mask`). Per crop a ratio range is picked and the
ratio drawn in it (:class:`MaskSpec`; :func:`ibot_spec`, :func:`dinov2_spec`). Each crop draws
its own ratio, where DINOv2's collate spreads them over the per-GPU batch:
docs/methods.md#dinov2 and docs/methods.md#ibot.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

ATTEMPTS = 10  # rectangles tried per block (BEiT, iBOT and DINOv2: ``for attempt in range(10)``)


class MaskSpec(NamedTuple):
    """How a method masks its crops (see the module docstring).

    ratio_ranges: (low, high) ratio ranges; (0, 0) is no mask.
    range_probs: the probability of each range.
    min_num_patches: the smallest block; None: iBOT's ``(min(h, w) // 3) ** 2``.
    max_fraction: no block adds more than this fraction of the patches (DINOv2: 0.5); None: no
      limit but the target (iBOT).
    whole_target: the target is ``int(ratio * patches)`` (DINOv2) rather than the float
      ``ratio * patches`` (iBOT).
    shape: "block" or "rand".
    aspect: the range of a block's height / width.
    """

    ratio_ranges: tuple[tuple[float, float], ...]
    range_probs: tuple[float, ...]
    min_num_patches: int | None = None
    max_fraction: float | None = None
    whole_target: bool = False
    shape: str = "block"
    aspect: tuple[float, float] = (0.3, 1 / 0.3)


def ibot_spec(pred_ratio, pred_ratio_var, pred_shape: str = "block") -> MaskSpec:
    """iBOT's ``ImageFolderMask`` arguments as a :class:`MaskSpec`."""
    ratios = _as_tuple(pred_ratio)
    variations = _as_tuple(pred_ratio_var)
    if len(variations) == 1 and len(ratios) > 1:
        variations = variations * len(ratios)
    ranges = tuple((r - v, r + v) for r, v in zip(ratios, variations, strict=True))
    return MaskSpec(ranges, (1.0 / len(ranges),) * len(ranges), shape=pred_shape)


def dinov2_spec(mask_ratio_min_max, mask_sample_probability: float) -> MaskSpec:
    """DINOv2's masking arguments (``ibot.mask_ratio_min_max``, ``mask_sample_probability``)."""
    low, high = (float(r) for r in mask_ratio_min_max)
    p = float(mask_sample_probability)
    return MaskSpec(
        ((0.0, 0.0), (low, high)),
        (1.0 - p, p),
        min_num_patches=4,
        max_fraction=0.5,
        whole_target=True,
    )


def _as_tuple(value) -> tuple[float, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(float(v) for v in value)
    return (float(value),)


def max_masked(spec: MaskSpec, num_patches: int) -> int:
    """An upper bound on the masked patches of one crop: the highest ratio's target."""
    high = max(hi for _, hi in spec.ratio_ranges)
    return min(num_patches, int(math.ceil(high * num_patches)))


def sample_masks(spec: MaskSpec, keys: jax.Array, crops: int, grid: tuple[int, int]) -> jax.Array:
    """``(crops, n, h * w)`` masks, True where a patch is masked (row-major grid), for ``n``
    examples with keys ``keys`` (``common.example_keys``): crop c of example i from
    ``fold_in(keys[i], c)``."""
    per_crop = [
        jax.vmap(lambda k, c=c: crop_mask(spec, jax.random.fold_in(k, c), grid))(keys)
        for c in range(crops)
    ]
    return jnp.stack(per_crop)


def crop_mask(spec: MaskSpec, key: jax.Array, grid: tuple[int, int]) -> jax.Array:
    """One crop's (h * w,) mask: a ratio from :class:`MaskSpec`, then blocks or random patches."""
    h, w = grid
    total = h * w
    choice_key, ratio_key, mask_key = jax.random.split(key, 3)
    probs = jnp.asarray(spec.range_probs, jnp.float32)
    pick = jax.random.choice(choice_key, len(spec.ratio_ranges), p=probs / jnp.sum(probs))
    low = jnp.asarray([r[0] for r in spec.ratio_ranges], jnp.float32)[pick]
    high = jnp.asarray([r[1] for r in spec.ratio_ranges], jnp.float32)[pick]
    ratio = low + (high - low) * jax.random.uniform(ratio_key)
    target = ratio * total
    if spec.whole_target or spec.shape == "rand":
        target = jnp.floor(target)
    if spec.shape == "rand":
        rank = jnp.argsort(jnp.argsort(jax.random.uniform(mask_key, (total,))))
        return rank < target
    if spec.shape != "block":
        raise ValueError(f"mask shape {spec.shape!r}: use 'block' or 'rand'.")
    smallest = (min(h, w) // 3) ** 2 if spec.min_num_patches is None else spec.min_num_patches
    largest = math.inf if spec.max_fraction is None else spec.max_fraction * total
    return block_mask(mask_key, grid, target, smallest, largest, spec.aspect).reshape(total)


def block_mask(
    key: jax.Array,
    grid: tuple[int, int],
    target: jax.Array | float,
    min_num_patches: float,
    max_num_patches: float = math.inf,
    aspect: tuple[float, float] = (0.3, 1 / 0.3),
) -> jax.Array:
    """An (h, w) mask of rectangles holding at most ``target`` patches (BEiT's
    ``MaskingGenerator``): rectangles are added until ``target`` is reached or 10 tries in a row
    fail; each adds between 1 and ``min(target - masked, max_num_patches)`` new patches, its
    area drawn from ``min_num_patches`` up to that, its aspect ratio log-uniform in ``aspect``
    and its position uniform. The 10 tries are drawn at once and the first acceptable one
    taken, which has the distribution of trying them in turn."""
    h, w = grid
    rows = jnp.arange(h)[None, :, None]
    cols = jnp.arange(w)[None, None, :]
    log_low, log_high = math.log(aspect[0]), math.log(aspect[1])
    target = jnp.asarray(target, jnp.float32)

    def add_block(carry):
        mask, count, _, step = carry
        room = jnp.minimum(target - count, max_num_patches)
        k_area, k_aspect, k_top, k_left = jax.random.split(jax.random.fold_in(key, step), 4)
        u = lambda k: jax.random.uniform(k, (ATTEMPTS,))  # noqa: E731
        # random.uniform(a, b) = a + (b - a) * u, also when b < a (little room left).
        area = min_num_patches + (room - min_num_patches) * u(k_area)
        ratio = jnp.exp(log_low + (log_high - log_low) * u(k_aspect))
        bh = jnp.round(jnp.sqrt(area * ratio)).astype(jnp.int32)
        bw = jnp.round(jnp.sqrt(area / ratio)).astype(jnp.int32)
        top = jnp.floor(u(k_top) * (h - bh + 1)).astype(jnp.int32)  # randint(0, h - bh)
        left = jnp.floor(u(k_left) * (w - bw + 1)).astype(jnp.int32)
        block = (
            (rows >= top[:, None, None])
            & (rows < (top + bh)[:, None, None])
            & (cols >= left[:, None, None])
            & (cols < (left + bw)[:, None, None])
        )  # (ATTEMPTS, h, w)
        new = jnp.sum(block & ~mask[None], axis=(1, 2))
        ok = (bh < h) & (bw < w) & (new > 0) & (new <= room)
        first = jnp.argmax(ok)
        found = jnp.any(ok)
        mask = jnp.where(found, mask | block[first], mask)
        count = count + jnp.where(found, new[first], 0)
        return mask, count, ~found, step + 1

    def more(carry):
        _, count, stuck, _ = carry
        return (count < target) & ~stuck

    start = (jnp.zeros((h, w), bool), jnp.zeros((), jnp.int32), jnp.zeros((), bool), 0)
    mask, _, _, _ = jax.lax.while_loop(more, add_block, start)
    return mask


def masked_slots(mask: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """``(positions, valid)``: for each row of ``mask`` (..., P), the positions of its masked
    patches in grid order in ``slots`` fixed places (..., slots) int32, the rest padded with
    unmasked positions, and ``valid`` (..., slots) True where a place holds a masked patch.
    A fixed number of places per crop keeps shapes static and each crop's patches its own."""
    order = jnp.argsort(~mask, axis=-1, stable=True)[..., :slots].astype(jnp.int32)
    valid = jnp.arange(slots) < jnp.sum(mask, axis=-1, keepdims=True)
    return order, valid
