"""The blockwise mask generators of iBOT and DINOv2 (jssl/methods/masking.py), run eagerly:
ratios within their ranges and at the masking probability, rectangles of bounded aspect, the
places of the masked patches, and masks keyed by the example alone."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jssl.methods import common, masking

GRID = (14, 14)  # ViT-S/16 at 224 px
N = GRID[0] * GRID[1]


# Compiled once per (spec, crops, grid) and shape: eagerly, each call would compile its loop.
_sample = jax.jit(masking.sample_masks, static_argnums=(0, 2, 3))
_blocks = jax.jit(
    jax.vmap(masking.block_mask, in_axes=(0, None, 0, None, None, None)),
    static_argnums=(1, 3, 4, 5),
)


def _keys(count: int, seed: int = 0) -> jax.Array:
    return common.example_keys(jax.random.key(seed), jnp.arange(count), common.MASK_STREAM)


@pytest.fixture(scope="module")
def ibot_masks():
    spec = masking.ibot_spec((0.0, 0.3), (0.0, 0.2))  # the ViT-S/16 recipe
    return spec, np.asarray(_sample(spec, _keys(200), 2, GRID))


@pytest.fixture(scope="module")
def dinov2_masks():
    spec = masking.dinov2_spec((0.1, 0.5), 0.5)
    grid = (16, 16)  # ViT-L/14 at 224 px
    return spec, np.asarray(_sample(spec, _keys(200), 2, grid))


def test_ibot_masks_half_the_crops_at_ratios_up_to_the_range(ibot_masks):
    spec, masks = ibot_masks
    assert masks.shape == (2, 200, N) and masks.dtype == bool
    counts = masks.sum(-1)
    masked = counts > 0
    # No mask or a ratio in (0.1, 0.5), each with probability 1/2: 400 crops, 5 sigma = 0.125.
    assert abs(masked.mean() - 0.5) < 0.125
    # A crop never passes its target ratio * N <= 0.5 * N; blocks of at least 16 patches
    # ((14 // 3) ** 2) mostly reach it, so the masked crops spread over the range.
    assert counts.max() <= 0.5 * N == masking.max_masked(spec, N)
    assert counts[masked].min() >= 1 and np.median(counts[masked]) > 0.2 * N
    assert counts[masked].max() > 0.4 * N


def test_dinov2_masks_whole_targets_and_half_the_patches_per_block(dinov2_masks):
    spec, masks = dinov2_masks
    counts = masks.sum(-1)
    assert abs((counts > 0).mean() - 0.5) < 0.125
    assert counts.max() <= int(0.5 * 256) == masking.max_masked(spec, 256)
    # At least one block of >= 4 patches (min_num_patches) wherever anything is masked.
    assert counts[counts > 0].min() >= 4


def test_a_block_is_a_rectangle_of_the_drawn_aspect():
    """With one aspect ratio r and a target of one block's area: one rectangle of height
    round(sqrt(16 r)) and width round(sqrt(16 / r)) (BEiT's h and w), anywhere on the grid."""
    keys = jax.random.split(jax.random.key(3), 6)
    for aspect, (height, width) in ((1.0, (4, 4)), (3.0, (7, 2)), (1 / 3, (2, 7))):
        targets = jnp.full((6,), float(height * width))
        masks = np.asarray(_blocks(keys, GRID, targets, 16.0, math.inf, (aspect, aspect)))
        tops = set()
        for mask in masks:
            rows, cols = np.nonzero(mask)
            assert (rows.max() - rows.min() + 1, cols.max() - cols.min() + 1) == (height, width)
            assert mask.sum() == height * width  # it fills its bounding box
            tops.add((rows.min(), cols.min()))
        assert len(tops) > 1
    # Blocks of any aspect in (0.3, 1 / 0.3): never more than the target, even a fraction.
    targets = jnp.asarray([5.5, 30.0, 97.9, 0.0, 1.0, 150.0])
    counts = np.asarray(_blocks(keys, GRID, targets, 4.0, math.inf, (0.3, 1 / 0.3))).sum((1, 2))
    assert np.all(counts <= np.floor(np.asarray(targets))) and np.all(counts[:3] > 0)


def test_rand_shape_masks_exactly_the_target():
    spec = masking.ibot_spec(0.3, 0.0, "rand")
    counts = np.asarray(_sample(spec, _keys(8), 2, GRID)).sum(-1)
    np.testing.assert_array_equal(counts, int(0.3 * N))


def test_masks_are_keyed_by_the_example_alone():
    """The same example index gives the same mask whatever else is in the batch (other
    devices' rows, another micro-batch), and another step key another mask."""
    spec = masking.dinov2_spec((0.1, 0.5), 1.0)
    rng = jax.random.key(11)

    def masks(index, rng=rng):
        keys = common.example_keys(rng, jnp.asarray(index), common.MASK_STREAM)
        return np.asarray(_sample(spec, keys, 2, (8, 8)))

    whole = masks([0, 1, 2, 3, 4, 5])
    shuffled = masks([5, 2, 7, 9, 0, 1])
    np.testing.assert_array_equal(shuffled[:, 0], whole[:, 5])
    np.testing.assert_array_equal(shuffled[:, 1], whole[:, 2])
    np.testing.assert_array_equal(shuffled[:, 4], whole[:, 0])
    assert not np.array_equal(whole[0], whole[1])  # each crop its own mask
    assert not np.array_equal(masks([5, 2, 7, 9, 0, 1], jax.random.key(12)), shuffled)


def test_masked_slots_hold_the_masked_positions_in_grid_order():
    mask = jnp.asarray([[False, True, False, True, True], [False] * 5])
    slots, valid = masking.masked_slots(mask, 4)
    np.testing.assert_array_equal(valid, [[True, True, True, False], [False] * 4])
    np.testing.assert_array_equal(np.asarray(slots)[0, :3], [1, 3, 4])
    assert slots.dtype == jnp.int32 and set(np.asarray(slots)[1]) <= set(range(5))
