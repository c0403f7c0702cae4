"""Pooling of conv feature maps before they are stored or fed to linear heads.

VISSL's linear benchmarks average-pool each ResNet-50 stage to about 9k dims
(``MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP`` in
``configs/config/benchmark/linear_image_classification/imagenet1k/
eval_resnet_8gpu_transfer_in1k_linear.yaml``): at 224 px conv1 -> 12x12x64, res2 -> 6x6x256,
res3 -> 4x4x512, res4 -> 3x3x1024, res5 -> 2x2x2048; ``res5avg`` (``avgpool``) as it is. Here
they are jax functions on NHWC arrays that keep the (n, h, w, c) shape (VISSL's
SHOULD_FLATTEN_FEATS=False). Specs (``get_pool``): "none"; "avg" (over height and width);
"avg:k,s,p", ``torch.nn.AvgPool2d(k, s, p)`` with the zero padding counted in the average;
"vissl_resnet50", the table above by layer name (other layers: "none"). ``layer_pools`` takes
one spec for every layer, or "layer=spec;..." for each its own (unnamed layers: "none"), e.g.
"res4=avg:8,3,0;res5=avg".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

Pool = Callable[[jax.Array], jax.Array]

# layer -> (kernel, stride, padding) of torch.nn.AvgPool2d, from VISSL's ResNet-50 linear
# evaluation config (see the module docstring).
VISSL_RESNET50 = {
    "conv1": (10, 10, 4),
    "res2": (16, 8, 0),
    "res3": (13, 5, 0),
    "res4": (8, 3, 0),
    "res5": (6, 1, 0),
}
TABLES = {"vissl_resnet50": VISSL_RESNET50}


def avg_pool(x: jax.Array, kernel: int, stride: int, padding: int = 0) -> jax.Array:
    """``torch.nn.AvgPool2d(kernel, stride, padding)`` on an NHWC array (floor mode, zero
    padding included in the average)."""
    if x.ndim != 4:
        raise ValueError(
            f"avg:{kernel},{stride},{padding} needs an NHWC feature map, got {x.shape}"
        )
    h, w = x.shape[1] + 2 * padding, x.shape[2] + 2 * padding
    if kernel > min(h, w):
        raise ValueError(
            f"Pooling kernel {kernel} is larger than the padded {h}x{w} feature map of shape "
            f"{x.shape}; pick a smaller kernel (VISSL's table assumes ResNet-50 at 224 px)."
        )
    summed = jax.lax.reduce_window(
        x.astype(jnp.float32),
        0.0,
        jax.lax.add,
        window_dimensions=(1, kernel, kernel, 1),
        window_strides=(1, stride, stride, 1),
        padding=((0, 0), (padding, padding), (padding, padding), (0, 0)),
    )
    return summed / (kernel * kernel)


def global_avg_pool(x: jax.Array) -> jax.Array:
    """Mean over height and width of an NHWC map; (n, c) vectors are returned unchanged."""
    return x.mean(axis=(1, 2)) if x.ndim == 4 else x


def _identity(x: jax.Array) -> jax.Array:
    return x


def get_pool(spec: str, layer: str | None = None) -> Pool:
    """The pooling function for ``spec`` (see the module docstring); ``layer`` picks the
    entry of a table spec such as "vissl_resnet50"."""
    spec = spec.strip()
    if spec in ("", "none"):
        return _identity
    if spec == "avg":
        return global_avg_pool
    if spec in TABLES:
        if layer is None:
            raise ValueError(f"Pool table {spec!r} needs the layer name.")
        entry = TABLES[spec].get(layer)
        return _identity if entry is None else _avg(*entry)
    if spec.startswith("avg:"):
        try:
            kernel, stride, padding = (int(v) for v in spec[4:].split(","))
        except ValueError:
            raise ValueError(f"Pool spec {spec!r}: write avg:KERNEL,STRIDE,PADDING") from None
        return _avg(kernel, stride, padding)
    raise ValueError(
        f"Unknown pool spec {spec!r}: use 'none', 'avg', 'avg:k,s,p' or one of {sorted(TABLES)}."
    )


def _avg(kernel: int, stride: int, padding: int) -> Pool:
    def pool(x: jax.Array) -> jax.Array:
        return avg_pool(x, kernel, stride, padding)

    return pool


def layer_pools(pool: str | Mapping[str, str], layers: Sequence[str]) -> dict[str, Pool]:
    """One pooling function per layer from a config value: a spec for every layer, a
    "layer=spec;layer=spec" string, or a mapping layer -> spec."""
    if isinstance(pool, str) and "=" in pool:
        pairs = [item.split("=", 1) for item in pool.split(";") if item.strip()]
        pool = {name.strip(): spec.strip() for name, spec in pairs}
    if isinstance(pool, Mapping):
        unknown = sorted(set(pool) - set(layers))
        if unknown:
            raise ValueError(
                f"Pooling given for {unknown}, which are not in layers={list(layers)}."
            )
        return {layer: get_pool(pool.get(layer, "none"), layer) for layer in layers}
    return {layer: get_pool(pool, layer) for layer in layers}


def pool_taps(
    taps: Mapping[str, jax.Array], layers: Sequence[str], pools: Mapping[str, Pool], field: str
) -> dict[str, jax.Array]:
    """``{layer: pools[layer](taps[layer])}`` for ``layers``; a layer the model does not tap is
    a KeyError naming the config ``field`` and the available taps."""
    missing = [layer for layer in layers if layer not in taps]
    if missing:
        raise KeyError(
            f"{field} names {missing}, which the model does not tap; available: {sorted(taps)}"
        )
    return {layer: pools[layer](taps[layer]) for layer in layers}
