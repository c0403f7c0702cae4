"""RegNetY trunks (Radosavovic et al. 2020, "Designing Network Design Spaces"), the SEER trunks.

Widths and depths follow the RegNet parametrisation (Sec. 3.3) as classy vision's
``classy_vision/models/regnet.py`` (``RegNetParams``, which VISSL's
``vissl/models/trunks/regnet.py`` builds on) and torchvision's ``torchvision/models/regnet.py``
(``BlockParams.from_init_params``) implement it; sizes: torchvision's RegNetY-16GF / 32GF /
128GF and the SEER sizes of VISSL's configs (``regnet64Gf_3.yaml``, ``regnet256Gf_1.yaml``).
The block is the "Y" bottleneck (multiplier 1): 1x1 conv, strided 3x3 grouped conv,
squeeze-excitation 0.25 of the block's *input* width, 1x1 conv, a 1x1 projection shortcut
where the shape changes. Submodule names follow classy vision (``stem``, ``block{stage}_{i}``
with ``a``, ``b``, ``se_reduce``, ``se_expand``, ``c``, ``proj``, their ``*_bn``); the taps are
VISSL's: ``conv1``, ``res2`` .. ``res5`` and ``avgpool`` (docs/evaluation.md#taps).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jssl.models import remat as remat_lib
from jssl.models.resnet import batch_norm, conv_init


class Design(NamedTuple):
    """The RegNet design parameters (paper Sec. 3.3): ``depth`` blocks whose widths grow
    linearly from ``w_0`` with slope ``w_a``, quantised in log space with step ``w_m``;
    ``group_width`` channels per group of the 3x3 convs."""

    depth: int
    w_0: int
    w_a: float
    w_m: float
    group_width: int


# torchvision regnet_y_16gf / 32gf / 128gf (classy vision's are the same); 64gf and 256gf are
# SEER's, from VISSL's regnet64Gf_3.yaml / regnet256Gf_1.yaml (classy vision's own
# regnet_y_256gf is a different, narrower design).
SIZES: dict[str, Design] = {
    "regnet_y_16gf": Design(18, 200, 106.23, 2.48, 112),
    "regnet_y_32gf": Design(20, 232, 115.89, 2.53, 232),
    "regnet_y_64gf": Design(20, 352, 147.48, 2.4, 328),
    "regnet_y_128gf": Design(27, 456, 160.83, 2.52, 264),
    "regnet_y_256gf": Design(27, 640, 230.83, 2.53, 373),
}

_WIDTH_QUANTUM = 8  # block widths are rounded to multiples of 8 (classy vision's QUANT)


def stages(design: Design) -> list[tuple[int, int, int]]:
    """``(width, blocks, group_width)`` of each stage, as ``RegNetParams.get_expanded_params``.

    Block j's continuous width ``w_0 + w_a * j`` is snapped to ``w_0 * w_m**k`` (k rounded in
    log space), then to a multiple of 8; consecutive blocks of equal width form a stage. Each
    stage's group width is capped at its width and the width rounded to a multiple of the
    group width (classy vision ``_adjust_widths_groups_compatibilty``; torchvision's
    ``_make_divisible`` gives the same widths for every size in ``SIZES``).
    """
    depth, w_0, w_a, w_m, group_width = design
    if not (depth > 0 and w_a >= 0 and w_0 > 0 and w_m > 1 and w_0 % _WIDTH_QUANTUM == 0):
        raise ValueError(
            f"Invalid RegNet design {design}: needs depth > 0, w_a >= 0, w_m > 1 and w_0 a "
            f"positive multiple of {_WIDTH_QUANTUM}."
        )
    widths_cont = np.arange(depth) * w_a + w_0
    exponents = np.round(np.log(widths_cont / w_0) / np.log(w_m))
    block_widths = np.round(w_0 * np.power(w_m, exponents) / _WIDTH_QUANTUM) * _WIDTH_QUANTUM
    result: list[list[int]] = []
    for width in block_widths.astype(int).tolist():
        if result and result[-1][0] == width:
            result[-1][1] += 1
        else:
            result.append([width, 1])
    adjusted = []
    for width, blocks in result:
        groups_of = min(group_width, width)
        adjusted.append((int(round(width / groups_of) * groups_of), blocks, groups_of))
    return adjusted


def feature_dim(size: str) -> int:
    """Channels of ``res5`` / ``avgpool``: the last stage's width (3024 for regnet_y_16gf)."""
    if size not in SIZES:
        raise ValueError(f"Unknown RegNet size {size!r}; valid sizes: {sorted(SIZES)}")
    return stages(SIZES[size])[-1][0]


class YBlock(nn.Module):
    """RegNetY residual bottleneck block (classy vision ``ResBottleneckBlock`` with SE)."""

    width: int
    stride: int
    group_width: int
    se_ratio: float
    norm: Callable[..., nn.Module]
    conv: Callable[..., nn.Module]
    zero_init_residual: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        width_in = x.shape[-1]
        strides = (self.stride, self.stride)
        out = self.conv(self.width, (1, 1), name="a")(x)
        out = nn.relu(self.norm(name="a_bn")(out))
        out = self.conv(
            self.width,
            (3, 3),
            strides,
            padding=1,
            feature_group_count=self.width // self.group_width,
            name="b",
        )(out)
        out = nn.relu(self.norm(name="b_bn")(out))
        # SE width is relative to the block's input, not its bottleneck (classy vision
        # ResBottleneckBlock / torchvision BottleneckTransform).
        se_width = int(round(self.se_ratio * width_in))
        scale = jnp.mean(out, axis=(1, 2), keepdims=True)
        scale = nn.relu(self.conv(se_width, (1, 1), use_bias=True, name="se_reduce")(scale))
        scale = self.conv(self.width, (1, 1), use_bias=True, name="se_expand")(scale)
        out = out * nn.sigmoid(scale)
        out = self.conv(self.width, (1, 1), name="c")(out)
        # Zero gamma on the last BN makes each block start as the identity (Goyal et al. 2017).
        last_init = nn.initializers.zeros if self.zero_init_residual else nn.initializers.ones
        out = self.norm(name="c_bn", scale_init=last_init)(out)
        shortcut = x
        if self.stride != 1 or width_in != self.width:
            shortcut = self.norm(name="proj_bn")(
                self.conv(self.width, (1, 1), strides, name="proj")(x)
            )
        return nn.relu(out + shortcut)


class RegNet(nn.Module):
    """RegNetY of ``depth``, ``w_0``, ``w_a``, ``w_m``, ``group_width`` (see ``SIZES``)
    returning VISSL-named feature taps (NHWC)."""

    depth: int
    w_0: int
    w_a: float
    w_m: float
    group_width: int
    se_ratio: float = 0.25
    stem_width: int = 32
    zero_init_residual: bool = False
    dtype: Any = jnp.float32  # computation dtype; parameters stay float32
    bn_axis_name: str | None = None  # named axis to average BN statistics over (sync BN)
    bn_momentum: float = 0.9  # flax convention: 1 - PyTorch's momentum of 0.1
    bn_epsilon: float = 1e-5
    remat: str = "none"  # jssl.models.remat: blocks recomputed in the backward pass

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> dict[str, jax.Array]:
        design = Design(self.depth, self.w_0, self.w_a, self.w_m, self.group_width)
        block_cls = remat_lib.wrap(YBlock, self.remat)
        # classy vision's init: every conv (SE included) N(0, 2 / fan_out) with fan_out =
        # k * k * out_channels, whatever the groups; flax's fan_out for a grouped kernel is the
        # same. SE biases start at zero.
        conv = functools.partial(
            nn.Conv,
            use_bias=False,
            kernel_init=conv_init,
            dtype=self.dtype,
            param_dtype=jnp.float32,
        )
        norm = batch_norm(
            train=train,
            momentum=self.bn_momentum,
            epsilon=self.bn_epsilon,
            axis_name=self.bn_axis_name,
            dtype=self.dtype,
        )

        taps: dict[str, jax.Array] = {}
        x = jnp.asarray(x, self.dtype)
        x = conv(self.stem_width, (3, 3), (2, 2), padding=1, name="stem")(x)
        x = nn.relu(norm(name="stem_bn")(x))
        taps["conv1"] = x
        for stage, (width, blocks, group_width) in enumerate(stages(design)):
            for b in range(blocks):
                x = block_cls(
                    width=width,
                    stride=2 if b == 0 else 1,
                    group_width=group_width,
                    se_ratio=self.se_ratio,
                    norm=norm,
                    conv=conv,
                    zero_init_residual=self.zero_init_residual,
                    name=f"block{stage + 1}_{b}",
                )(x)
            taps[f"res{stage + 2}"] = x
        taps["avgpool"] = jnp.mean(x, axis=(1, 2))
        return taps
