"""ResNet trunks (He et al. 2016, "Deep Residual Learning for Image Recognition").

The layout follows torchvision's ``torchvision/models/resnet.py`` ("v1.5": the
stride of a Bottleneck sits in its 3x3 conv, not in the first 1x1), which is
also what VISSL's ``vissl/models/trunks/resnext.py`` builds on. Submodule and
parameter names mirror torchvision (``conv1``, ``bn1``, ``layer1_0/conv1``,
``layer1_0/downsample_conv``, ``fc`` ...) so PyTorch checkpoints can be mapped
onto the Flax tree by name, and paddings match torchvision exactly so features
can be compared with PyTorch to float tolerance.

The trunk returns a dict of named feature taps using VISSL's names
(``conv1``, ``conv1_relu``, ``res2`` ... ``res5``, ``avgpool``), which is what
feature extraction and linear evaluation select from.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jssl.models import remat as remat_lib
from jssl.models.cpu_ops import cpu_convolution, cpu_max_pool

# depth -> (block kind, blocks per stage), as in torchvision's resnet18..resnet152.
_ARCHS: dict[int, tuple[str, tuple[int, int, int, int]]] = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}
_EXPANSION = {"basic": 1, "bottleneck": 4}

# torchvision initialises convs with kaiming_normal_(mode="fan_out", nonlinearity="relu"):
# an untruncated normal with variance 2 / fan_out.
conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")


def torch_linear_kernel_init(
    key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32
) -> jax.Array:
    """PyTorch nn.Linear's default weight init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / jnp.sqrt(shape[0])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def torch_linear_bias_init(fan_in: int) -> Callable[..., jax.Array]:
    """PyTorch nn.Linear's default bias init, which depends on the kernel's fan_in."""

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        bound = 1.0 / jnp.sqrt(fan_in)
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def batch_norm(
    *, train: bool, momentum: float, epsilon: float, axis_name: str | None, dtype: Any
) -> Callable[..., nn.Module]:
    """jssl's BatchNorm: float32 parameters and statistics, compute in ``dtype``, batch
    statistics averaged over ``axis_name`` (sync BN) when given."""
    return functools.partial(
        nn.BatchNorm,
        use_running_average=not train,
        momentum=momentum,
        epsilon=epsilon,
        axis_name=axis_name,
        dtype=dtype,
        param_dtype=jnp.float32,
    )


def supported_depths() -> tuple[int, ...]:
    """The ResNet depths this module can build."""
    return tuple(sorted(_ARCHS))


def stage_widths(width_multiplier: float) -> tuple[int, int, int, int]:
    """The ``planes`` of the four stages: 64, 128, 256, 512 scaled by the multiplier.

    All channel widths scale together, as in the wide ResNets of SimCLR / VISSL
    (ResNet-50 w2 doubles every conv).
    """
    widths = tuple(int(64 * width_multiplier * 2**i) for i in range(4))
    if min(widths) < 1:
        raise ValueError(f"width_multiplier={width_multiplier} leaves a stage with no channels")
    return widths  # type: ignore[return-value]


def feature_dim(depth: int, width_multiplier: float = 1.0) -> int:
    """Channels of ``res5`` / ``avgpool``: 2048 for ResNet-50, 512 for ResNet-18."""
    if depth not in _ARCHS:
        raise ValueError(f"Unsupported ResNet depth {depth}; valid depths: {supported_depths()}")
    return stage_widths(width_multiplier)[3] * _EXPANSION[_ARCHS[depth][0]]


class BasicBlock(nn.Module):
    """Two 3x3 convs (ResNet-18/34), torchvision ``BasicBlock``."""

    planes: int
    stride: int
    norm: Callable[..., nn.Module]
    conv: Callable[..., nn.Module]
    zero_init_residual: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        out = self.conv(self.planes, (3, 3), (self.stride, self.stride), padding=1, name="conv1")(x)
        out = nn.relu(self.norm(name="bn1")(out))
        out = self.conv(self.planes, (3, 3), padding=1, name="conv2")(out)
        # Zero gamma on the last BN makes each block start as the identity (Goyal et al. 2017).
        last_init = nn.initializers.zeros if self.zero_init_residual else nn.initializers.ones
        out = self.norm(name="bn2", scale_init=last_init)(out)
        return nn.relu(out + _shortcut(self, x, self.planes))


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (strided, torchvision v1.5) -> 1x1 x4 (ResNet-50/101/152)."""

    planes: int
    stride: int
    norm: Callable[..., nn.Module]
    conv: Callable[..., nn.Module]
    zero_init_residual: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        out = self.conv(self.planes, (1, 1), name="conv1")(x)
        out = nn.relu(self.norm(name="bn1")(out))
        out = self.conv(self.planes, (3, 3), (self.stride, self.stride), padding=1, name="conv2")(
            out
        )
        out = nn.relu(self.norm(name="bn2")(out))
        out = self.conv(self.planes * 4, (1, 1), name="conv3")(out)
        last_init = nn.initializers.zeros if self.zero_init_residual else nn.initializers.ones
        out = self.norm(name="bn3", scale_init=last_init)(out)
        return nn.relu(out + _shortcut(self, x, self.planes * 4))


def _shortcut(block: BasicBlock | Bottleneck, x: jax.Array, out_channels: int) -> jax.Array:
    """Identity, or torchvision's 1x1-conv + BN projection when shape changes."""
    if block.stride == 1 and x.shape[-1] == out_channels:
        return x
    s = (block.stride, block.stride)
    x = block.conv(out_channels, (1, 1), s, name="downsample_conv")(x)
    return block.norm(name="downsample_bn")(x)


class ResNet(nn.Module):
    """ResNet-{18,34,50,101,152} returning VISSL-named feature taps (NHWC)."""

    depth: int = 50
    width_multiplier: float = 1.0
    cifar_stem: bool = False  # 3x3 stride-1 conv1 and no max-pool, for 32px images
    zero_init_residual: bool = False
    num_classes: int | None = None
    dtype: Any = jnp.float32  # computation dtype; parameters stay float32
    bn_axis_name: str | None = None  # named axis to average BN statistics over (sync BN)
    bn_momentum: float = 0.9  # flax convention: 1 - PyTorch's momentum of 0.1
    bn_epsilon: float = 1e-5
    remat: str = "none"  # jssl.models.remat: blocks recomputed in the backward pass

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> dict[str, jax.Array]:
        if self.depth not in _ARCHS:
            raise ValueError(
                f"Unsupported ResNet depth {self.depth}; valid depths: {supported_depths()}"
            )
        kind, blocks = _ARCHS[self.depth]
        block_cls = remat_lib.wrap(BasicBlock if kind == "basic" else Bottleneck, self.remat)
        widths = stage_widths(self.width_multiplier)

        on_cpu = jax.default_backend() == "cpu"
        conv = functools.partial(
            nn.Conv,
            use_bias=False,
            kernel_init=conv_init,
            # Only XLA's CPU backend gains (see jssl/models/cpu_ops.py); GPUs and TPUs keep lax's
            # convolutions, whose layouts the reshapes could disturb (TPU tiling).
            conv_general_dilated=functools.partial(cpu_convolution, training=train)
            if on_cpu
            else None,
            dtype=self.dtype,
            param_dtype=jnp.float32,
        )
        # flax computes the statistics in float32 even when dtype is bf16
        # (force_float32_reductions), and keeps running averages in float32.
        # One difference from torch: the running variance is updated with the
        # biased batch variance (torch uses the unbiased one), a factor n/(n-1).
        norm = batch_norm(
            train=train,
            momentum=self.bn_momentum,
            epsilon=self.bn_epsilon,
            axis_name=self.bn_axis_name,
            dtype=self.dtype,
        )

        taps: dict[str, jax.Array] = {}
        x = jnp.asarray(x, self.dtype)
        if self.cifar_stem:
            x = conv(widths[0], (3, 3), padding=1, name="conv1")(x)
        else:
            x = conv(widths[0], (7, 7), (2, 2), padding=3, name="conv1")(x)
        taps["conv1"] = x
        x = nn.relu(norm(name="bn1")(x))
        taps["conv1_relu"] = x
        if not self.cifar_stem:
            # flax pads max-pool with -inf, as torch's MaxPool2d(3, 2, padding=1) does;
            # cpu_max_pool is the same pool with a cheaper gradient on XLA's CPU backend.
            if on_cpu and train:
                x = cpu_max_pool(x)
            else:
                x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))

        for stage, (planes, n_blocks) in enumerate(zip(widths, blocks, strict=True)):
            for b in range(n_blocks):
                stride = 2 if (stage > 0 and b == 0) else 1
                x = block_cls(
                    planes=planes,
                    stride=stride,
                    norm=norm,
                    conv=conv,
                    zero_init_residual=self.zero_init_residual,
                    name=f"layer{stage + 1}_{b}",
                )(x)
            taps[f"res{stage + 2}"] = x

        x = jnp.mean(x, axis=(1, 2))
        taps["avgpool"] = x
        if self.num_classes is not None:
            fan_in = x.shape[-1]
            taps["logits"] = nn.Dense(
                self.num_classes,
                kernel_init=torch_linear_kernel_init,
                bias_init=torch_linear_bias_init(fan_in),
                dtype=self.dtype,
                param_dtype=jnp.float32,
                name="fc",
            )(x)
        return taps
