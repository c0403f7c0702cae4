"""Convolutions and the stem max-pool arranged for XLA's CPU backend: the same values, faster.

The ResNet trains (and, for tiny maps, evaluates) through ``cpu_convolution`` and
``cpu_max_pool`` on the CPU backend only; GPUs and TPUs keep lax's and flax's operations. Each
change is measured by benchmarks/train_step.py and benchmarks/conv_layers.py and tested
against the operation it replaces (tests/models/test_cpu_ops.py).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

_NHWC = ("NHWC", "HWIO", "NHWC")


def cpu_convolution(
    lhs, rhs, window_strides, padding, *, training: bool = True, **kwargs
) -> jax.Array:
    """``lax.conv_general_dilated`` arranged for XLA's CPU backend to train; the same convolution.

    Three changes for the backward pass and one for tiny maps. Without ``training`` (ResNet's
    ``train=False``: evaluation and feature extraction) it is ``lax.conv_general_dilated`` but
    for tiny maps: without a backward pass the first three only cost time.

    - The input is divided by a runtime 1 (exact), so that XLA computes it once. XLA's CPU
      fusion copies cheap elementwise producers into every consumer, so the transposed copy
      of the input that the weight gradient needs recomputed batch norm, ReLU and the
      residual sums of up to three blocks, reading them in transposed order (a fifth of a
      ResNet-18 forward and backward). XLA does not duplicate a division, so both the
      forward convolution and that copy read one buffer. (``lax.optimization_barrier`` says
      this directly, but XLA's CPU pipeline removes barriers before fusion.)
    - A 1x1 convolution is one 2-D matmul, ``reshape -> dot -> reshape``: XLA's weight
      gradient of a 1x1 convolution is 1.4-3x slower than ``x.T @ dy`` of the same sizes.
      Strided 1x1 convolutions (torchvision's downsample) take every ``stride``-th pixel
      first, which is what a 1x1 window with zero padding sees.
    - A 3x3 stride-2 convolution computes its input gradient phase by phase instead of over
      a zero-dilated gradient (``_conv3x3_stride2``).
    - The other stride-1 convolutions compute both gradients as convolutions in the forward
      pass's layout (``_conv_stride1``), as the stride-2 one does its weight gradient.
      XLA's own gradient convolutions contract other dimensions; outside a loop its CPU
      backend rearranges them for Eigen, inside a loop body (exact accumulation's
      ``lax.scan`` over micro-batches) it runs them as generic loops, 7-45x slower.
    - A 3x3 stride-1 convolution of a map of at most 2x2 pixels is one matmul
      (``_small_conv3x3``), in training and evaluation.

    The ResNet's stem max-pool trains through ``cpu_max_pool`` on the same backend.
    """
    plain = (
        set(kwargs) <= _PLAIN_KWARGS
        and kwargs.get("feature_group_count", 1) == 1
        and all(
            d is None or tuple(d) == (1, 1)
            for d in (kwargs.get("lhs_dilation"), kwargs.get("rhs_dilation"))
        )
        and rhs.ndim == 4
        and kwargs.get("dimension_numbers")
        == jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, _NHWC)
    )
    pads = padding if isinstance(padding, str) else tuple(tuple(p) for p in padding)
    taps, strides, precision = rhs.shape[:2], tuple(window_strides), kwargs.get("precision")
    # Forward too: evaluation of small crops meets it as well.
    small = plain and taps == (3, 3) and strides == (1, 1) and pads == _PAD1
    small = small and max(lhs.shape[1:3]) <= 2
    if not training:
        if small:
            return _small_conv3x3(lhs, rhs, precision)
        return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, **kwargs)
    # sign(1 + |w|) is 1 for every non-NaN weight; XLA cannot fold it to a constant.
    one = jnp.sign(1 + jnp.abs(rhs.reshape(-1)[0]))
    lhs = lhs / jax.lax.stop_gradient(one).astype(lhs.dtype)
    if plain and taps == (1, 1) and pads in ("SAME", "VALID", ((0, 0), (0, 0))):
        sh, sw = strides
        x = lhs[:, ::sh, ::sw, :] if (sh, sw) != (1, 1) else lhs
        cin, cout = rhs.shape[2:]
        y = jax.lax.dot(x.reshape(-1, cin), rhs.reshape(cin, cout), precision=precision)
        return y.reshape(x.shape[:-1] + (cout,))
    if plain and taps == (3, 3) and strides == (2, 2) and pads == _PAD1:
        return _conv3x3_stride2(lhs, rhs, precision)
    if small:
        return _small_conv3x3(lhs, rhs, precision)
    if plain and strides == (1, 1):
        if isinstance(pads, str):
            pads = tuple(jax.lax.padtype_to_pads(lhs.shape[1:3], taps, strides, pads))
        if all(0 <= p <= k - 1 for k, pair in zip(taps, pads, strict=True) for p in pair):
            return _conv_stride1(lhs, rhs, pads, precision)
    return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, **kwargs)


_PAD1 = ((1, 1), (1, 1))
# What flax's Conv passes; anything else (batch groups, an accumulation type) goes to lax as is.
_PLAIN_KWARGS = {
    "lhs_dilation",
    "rhs_dilation",
    "dimension_numbers",
    "feature_group_count",
    "precision",
}


def _small_conv3x3(x: jax.Array, w: jax.Array, precision: Any) -> jax.Array:
    """A 3x3, stride-1, padding-1 convolution of a map of at most 2x2 pixels, as one matmul.

    Its kernel is larger than its input, so XLA's CPU backend swaps the two operands and runs
    the result as a generic loop, not Eigen's convolution, which made SwAV's and DINO's small
    crops (ResNet-18's last stage at 2x2 pixels) cost most of their step. Every output pixel of so
    small a map sees every input pixel, through tap (p - i + 1, q - j + 1), so the convolution
    is one dense matmul of the flattened map with those taps arranged in blocks; it does no
    product with padding, and its gradients are matmuls too.
    """
    n, h, wd, c = x.shape
    blocks = [
        [w[p - i + 1, q - j + 1] for i in range(h) for j in range(wd)]
        for p in range(h)
        for q in range(wd)
    ]
    taps = jnp.concatenate([jnp.concatenate(row, axis=1) for row in blocks], axis=0)
    y = jax.lax.dot(x.reshape(n, h * wd * c), taps, precision=precision)
    return y.reshape(n, h, wd, w.shape[-1])


def _lax_conv(x: jax.Array, w: jax.Array, strides, pads, precision: Any, **kwargs) -> jax.Array:
    return jax.lax.conv_general_dilated(
        x, w, strides, pads, dimension_numbers=_NHWC, precision=precision, **kwargs
    )


def _weight_gradient(x: jax.Array, dy: jax.Array, w: jax.Array, strides, pads, precision):
    """The kernel gradient of ``_lax_conv(x, w, strides, pads)`` as a forward convolution:
    the input channels as its batch, the examples as its features, the output gradient as its
    kernel (dilated by the stride), and a slice of the kernel's taps."""
    taps = w.shape[:2]
    dw = _lax_conv(
        x.transpose(3, 1, 2, 0),  # (C, H, W, N)
        dy.transpose(1, 2, 0, 3),  # (Ho, Wo, N, K)
        (1, 1),
        pads,
        precision,
        rhs_dilation=strides,
    )
    return dw[:, : taps[0], : taps[1]].transpose(1, 2, 0, 3).astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv_stride1(x: jax.Array, w: jax.Array, pads, precision: Any) -> jax.Array:
    """A stride-1 convolution whose gradients are convolutions in its own layout: the input
    gradient correlates the output gradient with the flipped kernel (input and output channels
    swapped), the weight gradient is ``_weight_gradient``. The same values as lax's; a
    ``custom_vjp`` like ``_conv3x3_stride2``."""
    return _lax_conv(x, w, (1, 1), pads, precision)


def _conv_stride1_fwd(x, w, pads, precision):
    return _conv_stride1(x, w, pads, precision), (x, w)


def _conv_stride1_bwd(pads, precision, residuals, dy):
    x, w = residuals
    flipped = jnp.flip(w, (0, 1)).transpose(0, 1, 3, 2)
    full = tuple((k - 1 - lo, k - 1 - hi) for k, (lo, hi) in zip(w.shape[:2], pads, strict=True))
    dx = _lax_conv(dy, flipped, (1, 1), full, precision)
    return dx.astype(x.dtype), _weight_gradient(x, dy, w, (1, 1), pads, precision)


_conv_stride1.defvjp(_conv_stride1_fwd, _conv_stride1_bwd)


def _lax_conv3x3_stride2(x: jax.Array, w: jax.Array, precision: Any) -> jax.Array:
    return jax.lax.conv_general_dilated(
        x, w, (2, 2), _PAD1, dimension_numbers=_NHWC, precision=precision
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _conv3x3_stride2(x: jax.Array, w: jax.Array, precision: Any) -> jax.Array:
    """A 3x3, stride-2, padding-1 convolution whose input gradient skips the zeros.

    XLA computes that gradient as a convolution of the output gradient dilated by 2, so 3 of
    every 4 products are with an inserted zero. Split by the parity of the input pixel
    instead, each phase is a small stride-1 convolution of the undilated gradient (the
    sub-pixel view of a transposed convolution, Shi et al. 2016, "Real-Time Single Image and
    Video Super-Resolution Using an Efficient Sub-Pixel CNN"), about twice as fast.
    Being a ``custom_vjp``, it has no forward-mode derivative (``jax.jvp``) on the CPU backend
    while training; reverse mode, ``vmap`` and ``jit`` are as before.
    """
    return _lax_conv3x3_stride2(x, w, precision)


def _conv3x3_stride2_fwd(x, w, precision):
    return _lax_conv3x3_stride2(x, w, precision), (x, w)


# In one dimension, input pixel i = 2m + k - 1 meets tap k of output m. An even pixel 2m meets
# only tap 1 of output m; an odd pixel 2m + 1 meets tap 2 of output m and tap 0 of output
# m + 1 (a zero past the edge). Per parity: the taps, in the order they meet outputs m, m + 1,
# and the padding of the output gradient that this correlation needs.
_PHASES = (((1,), (0, 0)), ((2, 0), (0, 1)))


def _conv3x3_stride2_bwd(precision, residuals, dy):
    x, w = residuals
    n, h, wd, c = x.shape
    rows = []
    for taps_h, pad_h in _PHASES:
        cols = []
        for taps_w, pad_w in _PHASES:
            k = w[jnp.array(taps_h)][:, jnp.array(taps_w)]
            # "HWOI": the kernel's output channels are this correlation's input channels.
            cols.append(
                jax.lax.conv_general_dilated(
                    dy,
                    k,
                    (1, 1),
                    (pad_h, pad_w),
                    dimension_numbers=("NHWC", "HWOI", "NHWC"),
                    precision=precision,
                )
            )
        rows.append(jnp.stack(cols, axis=3))  # (n, m, q, parity_w, c)
    ho, wo = dy.shape[1:3]
    # (n, m, parity_h, q, parity_w, c) is dx at (2m + parity_h, 2q + parity_w); an odd input
    # size has one row or column fewer than 2 * output.
    dx = jnp.stack(rows, axis=2).reshape(n, 2 * ho, 2 * wo, c)[:, :h, :wd]
    return dx.astype(x.dtype), _weight_gradient(x, dy, w, (2, 2), _PAD1, precision)


_conv3x3_stride2.defvjp(_conv3x3_stride2_fwd, _conv3x3_stride2_bwd)


def cpu_max_pool(x: jax.Array) -> jax.Array:
    """ResNet's stem max-pool (3x3 window, stride 2, padding 1 with -inf) for XLA's CPU backend
    to train: the same values, and the same gradient (to the first maximum of each window).

    XLA's CPU backend expands the gradient of ``nn.max_pool`` (a select-and-scatter) into a
    reduce-window that carries int32 index arrays beside the values, then a scatter (7% of a
    ResNet-50 forward and backward at 96 px). Here the forward keeps, per output, which of the
    9 taps won (the first maximum in row-major window order, as XLA's select-and-scatter picks
    it), and the backward routes each output's gradient to that tap, one parity phase of the
    input at a time as ``_conv3x3_stride2_bwd`` does. Keeping the winning tap, not recomparing
    with the input in the backward, matters: XLA recomputes a fused input (batch norm, ReLU)
    inside each consumer, and two recomputations need not round alike, which would break ties
    (and the stem's gradient). Like ``_conv3x3_stride2`` it is a ``custom_vjp``: no
    ``jax.jvp`` through it.
    """
    return _max_pool(x, x.shape[1:3])


def _pool_taps(x: jax.Array, out_hw: tuple[int, int]) -> list[jax.Array]:
    """The 9 window taps of every output, row-major: tap (kh, kw) of output (m, q) is input
    pixel (2m + kh - 1, 2q + kw - 1), -inf outside the map."""
    (ho, wo), (h, w) = out_hw, x.shape[1:3]
    pad = ((0, 0), (1, 2 * ho - h), (1, 2 * wo - w), (0, 0))
    xp = jnp.pad(x, pad, constant_values=-jnp.inf)
    return [xp[:, kh : kh + 2 * ho : 2, kw : kw + 2 * wo : 2] for kh in range(3) for kw in range(3)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _max_pool(x: jax.Array, size: tuple[int, int]) -> jax.Array:
    return _max_pool_fwd(x, size)[0]


def _max_pool_fwd(x, size):
    taps = _pool_taps(x, ((size[0] + 1) // 2, (size[1] + 1) // 2))
    best, winner = taps[0], jnp.zeros(taps[0].shape, jnp.int8)
    for t, tap in enumerate(taps[1:], 1):
        # Strictly greater keeps the first maximum; a NaN wins as in XLA's max.
        wins = (tap > best) | (jnp.isnan(tap) & ~jnp.isnan(best))
        best = jnp.where(wins, tap, best)
        winner = jnp.where(wins, jnp.int8(t), winner)
    return best, winner


def _next_row(a: jax.Array, axis: int) -> jax.Array:
    """``a`` moved by one along ``axis``: entry m holds a[m + 1], zero past the end."""
    config = [(0, 0, 0)] * a.ndim
    config[axis] = (-1, 1, 0)
    return jax.lax.pad(a, jnp.zeros((), a.dtype), config)


def _max_pool_bwd(size, winner, dy):
    n, ho, wo, c = dy.shape
    # Divided by a runtime 1 (the winning tap is never negative), so that XLA computes the
    # incoming gradient once instead of inside each of the nine taps that read it (see
    # cpu_convolution); without it the step gains nothing over lax's max-pool.
    one = (winner.reshape(-1)[0] >= 0).astype(dy.dtype)
    dy = dy / one
    zero = jnp.zeros((), dy.dtype)
    rows = []
    for taps_h, _ in _PHASES:
        cols = []
        for taps_w, _ in _PHASES:
            # Input pixel (2m + parity) meets taps_h[j] of output row m + j (likewise columns).
            total = None
            for j, kh in enumerate(taps_h):
                for i, kw in enumerate(taps_w):
                    part = jnp.where(winner == 3 * kh + kw, dy, zero)
                    part = _next_row(part, 1) if j else part
                    part = _next_row(part, 2) if i else part
                    total = part if total is None else total + part
            cols.append(total)
        rows.append(jnp.stack(cols, axis=3))  # (n, m, q, parity_w, c)
    dx = jnp.stack(rows, axis=2).reshape(n, 2 * ho, 2 * wo, c)[:, : size[0], : size[1]]
    # Once more, so that what reads dx (the stem's batch-norm gradient) reads a buffer instead
    # of computing the interleaving inside its own loop.
    return (dx / one,)


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)
