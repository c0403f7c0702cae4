"""RandAugment and random erasing in JAX, inside the train step: the twins of jssl.data.randaugment.

jssl.data.device_augment makes the views on the accelerator (data.augment.on_device, grain, the
numpy pipeline); these are its RandAugment (after the crop and flip, before the colour ops) and
random erasing (after normalisation; jssl.data.erasing_device, re-exported). Each op
(jssl.data.randaugment_ops_device, OPS re-exported) is the twin of the tf.data op of its name
given the same argument (tests/data/test_randaugment.py checks them equal), and the draws follow
the same distributions from JAX keys of the view's colour sub-seed (the streams
jssl.data.crops.RANDAUGMENT_STREAM and ERASING_STREAM, as the host folds its own), so the two
paths agree in distribution, not view for view. Vectorised over a batch's crops, a
data-dependent op choice costs every candidate op, so a layer computes each kind once
(``apply_layer``: one affine resampling, one lookup table, one blend), then selects.
References, levels and the deliberate differences from timm: jssl.data.randaugment.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jssl.data import crops
from jssl.data.erasing_device import (  # noqa: F401  (re-exported: device_augment, tests)
    Erasing,
    erase,
    erasing_box,
    sample_erasing,
)
from jssl.data.randaugment_ops_device import (
    OPS,  # noqa: F401  (re-exported: the tests read the ops here)
    affine,
    affine_matrix,
    apply_lut,
    auto_contrast_lut,
    blend,
    equalize_lut,
    histogram,
    invert_lut,
    luma,
    per_channel,
    posterize_lut,
    ramp,
    rotate_matrix,
    shear_x_matrix,
    shear_y_matrix,
    smooth,
    solarize_add_lut,
    solarize_lut,
    translate_x_matrix,
    translate_y_matrix,
)

NUM_OPS = len(crops.RANDAUGMENT_OPS)
_OP = {name: k for k, name in enumerate(crops.RANDAUGMENT_OPS)}
GEOMETRIC = tuple(_OP[n] for n in ("rotate", "shear_x", "shear_y", "translate_x", "translate_y"))
LOOKUP = tuple(
    _OP[n] for n in ("auto_contrast", "equalize", "invert", "posterize", "solarize", "solarize_add")
)


class Layers(NamedTuple):
    """One image's RandAugment draws, one entry per layer (randaugment.Layers)."""

    op: jax.Array  # int32: index in crops.RANDAUGMENT_OPS
    apply: jax.Array  # bool
    magnitude: jax.Array  # float32 in [0, 10]
    negate: jax.Array  # bool


def op_arguments(magnitude: jax.Array, negate: jax.Array) -> jax.Array:
    """(..., NUM_OPS) float32: every op's argument (randaugment.op_arguments)."""
    level = jnp.asarray(magnitude, jnp.float32) / 10.0
    sign = jnp.where(negate, -1.0, 1.0)
    enhance = jnp.maximum(0.1, 1.0 + sign * level * 0.9)
    zero = jnp.zeros_like(level)
    return jnp.stack(
        [
            zero,
            zero,
            zero,
            sign * level * 30.0,
            4.0 - jnp.floor(level * 4.0),
            256.0 - jnp.minimum(256.0, jnp.floor(level * 256.0)),
            jnp.minimum(128.0, jnp.floor(level * 110.0)),
            enhance,
            enhance,
            enhance,
            enhance,
            sign * level * 0.3,
            sign * level * 0.3,
            sign * level * 0.45,
            sign * level * 0.45,
        ],
        axis=-1,
    )


def _select(op: jax.Array, table: dict, default):
    """table[op] for a traced ``op`` (a where chain: the table is small and its rows cheap)."""
    out = default
    for k, value in table.items():
        out = jnp.where(op == k, value, out)
    return out


def apply_layer(image: jax.Array, op, apply, magnitude, negate, fill) -> jax.Array:
    """One layer: OPS[op](image, op_arguments(...)[op], fill) where ``apply``, computed as one
    resampling, one lookup table and one blend whatever ``op`` is."""
    height, width = image.shape[:2]
    args = op_arguments(magnitude, negate)
    matrix = _select(
        op,
        {
            _OP["rotate"]: rotate_matrix(args[_OP["rotate"]], height, width),
            _OP["shear_x"]: shear_x_matrix(args[_OP["shear_x"]]),
            _OP["shear_y"]: shear_y_matrix(args[_OP["shear_y"]]),
            _OP["translate_x"]: translate_x_matrix(args[_OP["translate_x"]], width),
            _OP["translate_y"]: translate_y_matrix(args[_OP["translate_y"]], height),
        },
        affine_matrix(1.0, 0.0, 0.0, 0.0, 1.0, 0.0),
    )
    hist = histogram(image)
    lut = _select(
        op,
        {
            _OP["auto_contrast"]: auto_contrast_lut(hist),
            _OP["equalize"]: equalize_lut(hist),
            _OP["invert"]: invert_lut(),
            _OP["posterize"]: posterize_lut(args[_OP["posterize"]]),
            _OP["solarize"]: solarize_lut(args[_OP["solarize"]]),
            _OP["solarize_add"]: solarize_add_lut(args[_OP["solarize_add"]]),
        },
        per_channel(ramp()),
    )
    luma_ = luma(image)
    degenerate = _select(
        op,
        {_OP["color"]: luma_, _OP["contrast"]: jnp.mean(luma_), _OP["brightness"]: 0.0},
        smooth(image),
    )
    blended = blend(degenerate, image, args[op])
    out = jnp.where(jnp.isin(op, jnp.asarray(GEOMETRIC)), affine(image, matrix, fill), blended)
    out = jnp.where(jnp.isin(op, jnp.asarray(LOOKUP)), apply_lut(image, lut), out)
    return jnp.where(apply, out, image)


def apply_layers(image: jax.Array, layers: Layers, fill) -> jax.Array:
    """The drawn layers applied in turn (randaugment.apply_layers)."""
    fill = jnp.asarray(fill, jnp.float32)
    for i in range(layers.op.shape[0]):
        image = apply_layer(
            image, layers.op[i], layers.apply[i], layers.magnitude[i], layers.negate[i], fill
        )
    return image


def sample_layers(key: jax.Array, num_ops: int, magnitude: float, magnitude_std: float) -> Layers:
    """randaugment.sample_layers's draws from a JAX key."""
    op_key, coin_key, magnitude_key, sign_key = jax.random.split(key, 4)
    shape = (num_ops,)
    op = jax.random.randint(op_key, shape, 0, NUM_OPS, jnp.int32)
    apply = jax.random.uniform(coin_key, shape) < crops.RANDAUGMENT_OP_PROB
    noise = jax.random.normal(magnitude_key, shape)
    drawn = jnp.clip(magnitude + magnitude_std * noise, 0.0, crops.RANDAUGMENT_MAX_MAGNITUDE)
    negate = jax.random.uniform(sign_key, shape) > 0.5
    return Layers(op, apply, drawn, negate)
