"""Pieces every method would otherwise write again: the model applied in train or eval mode,
batch-norm statistics averaged over devices, and momentum (EMA) teachers with a schedule.

All of it runs per replica inside the step's ``shard_map`` over ``DATA_AXIS``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jssl.parallel import DATA_AXIS


def apply_model(
    model: Any, params: Any, batch_stats: Any, images: jax.Array, train: bool
) -> tuple[dict[str, jax.Array], Any]:
    """``(taps, new batch_stats)``: train mode normalises with batch statistics and returns
    the updated running ones; eval mode uses the running ones and returns them unchanged."""
    variables = {"params": params, "batch_stats": batch_stats}
    if not train:
        return model.apply(variables, images, train=False), batch_stats
    out, mutated = model.apply(variables, images, train=True, mutable=["batch_stats"])
    return out, mutated["batch_stats"]


def mean_over_devices(tree: Any) -> Any:
    """Per-device batch-norm running statistics (``model.sync_bn=False``) averaged, so the
    replicated state stays the same on every device. PyTorch DDP broadcasts rank 0's buffers
    instead; the average uses every device's batches."""
    return jax.tree.map(lambda x: jax.lax.pmean(x, DATA_AXIS), tree)


def cosine_momentum(step: jax.Array, total_steps: int, base: float, final: float = 1.0):
    """BYOL's teacher momentum (Grill et al. 2020, Sec. 3.2): ``final - (final - base) *
    (cos(pi * step / total) + 1) / 2``, from ``base`` at step 0 to ``final`` at the end."""
    progress = jnp.clip(step / max(total_steps, 1), 0.0, 1.0)
    return final - (final - base) * (jnp.cos(jnp.pi * progress) + 1.0) / 2.0


def ema(online: Any, teacher: Any, momentum: jax.Array | float) -> Any:
    """``momentum * teacher + (1 - momentum) * online``, leaf by leaf (MoCo's key encoder,
    BYOL's target, DINO's teacher)."""
    return optax.incremental_update(online, teacher, 1.0 - momentum)
