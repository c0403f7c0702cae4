"""Pieces every method would otherwise write again: the model applied in train or eval mode
(to one batch or to every crop group), batch-norm statistics averaged over devices, and
momentum (EMA) teachers with a schedule.

Crops: ``batch["crops"]`` holds one array per crop group (jssl.data.crops), of shape
(n, num_crops, S, S, 3). ``views(batch)`` lists every crop as its own (n, S, S, 3) batch, in
crop order; ``forward_crops`` runs the model on all of them the way VISSL's multi-resolution
forward does and returns taps of (num_crops * n, ...) rows, crop-major: row ``c * n + i`` is
crop c of image i.

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


def views(batch: dict) -> list[jax.Array]:
    """Every crop of ``batch["crops"]`` as an (n, S, S, 3) batch, group by group, in order."""
    return [group[:, j] for group in batch["crops"] for j in range(group.shape[1])]


def num_crops(batch: dict) -> int:
    return sum(group.shape[1] for group in batch["crops"])


def forward_crops(
    model: Any, params: Any, batch_stats: Any, crops: Any, train: bool
) -> tuple[dict[str, jax.Array], Any]:
    """The model on every crop: ``(taps, new batch_stats)``, taps crop-major (row c * n + i).

    Consecutive groups of one size are concatenated into one trunk batch, one trunk pass per
    resolution, and the head runs on all crops at once (VISSL ``multi_res_input_forward``), so
    train-mode batch norm normalises each resolution's crops together and the head's over all.
    """
    by_size: list[list[jax.Array]] = []
    for group in crops:
        flat = jnp.swapaxes(group, 0, 1).reshape(-1, *group.shape[2:])  # crop-major rows
        if by_size and by_size[-1][0].shape[1:] == flat.shape[1:]:
            by_size[-1].append(flat)
        else:
            by_size.append([flat])
    inputs = [jnp.concatenate(same) if len(same) > 1 else same[0] for same in by_size]
    return apply_model(model, params, batch_stats, inputs[0] if len(inputs) == 1 else inputs, train)


def split_crops(x: jax.Array, count: int) -> jax.Array:
    """(count * n, ...) crop-major rows as (count, n, ...)."""
    return x.reshape(count, -1, *x.shape[1:])
