"""Pieces every method would otherwise write again: the model applied in train or eval mode
(to one batch or to every crop group), batch-norm statistics averaged over devices,
momentum (EMA) teachers with a schedule, and named loss terms with weights that may follow a
ramp over training (``config.loss``).

Crops: ``batch["crops"]`` holds one array per crop group (jssl.data.crops), of shape
(n, num_crops, S, S, 3). ``views(batch)`` lists every crop as its own (n, S, S, 3) batch, in
crop order; ``forward_crops`` runs the model on all of them the way VISSL's multi-resolution
forward does and returns taps of (num_crops * n, ...) rows, crop-major: row ``c * n + i`` is
crop c of image i.

All of it runs per replica inside the step's ``shard_map`` over ``DATA_AXIS``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jssl import schedules as schedules_lib
from jssl.parallel import DATA_AXIS


def apply_model(
    model: Any,
    params: Any,
    batch_stats: Any,
    images: jax.Array,
    train: bool,
    rng: jax.Array | None = None,
) -> tuple[dict[str, jax.Array], Any]:
    """``(taps, new batch_stats)``: train mode normalises with batch statistics and returns
    the updated running ones; eval mode uses the running ones and returns them unchanged.
    ``rng`` feeds the ``dropout`` stream (a ViT's stochastic depth) in train mode; use
    :func:`replica_rng` inside the step so each device draws its own masks."""
    variables = {"params": params, "batch_stats": batch_stats}
    if not train:
        return model.apply(variables, images, train=False), batch_stats
    rngs = {"dropout": rng} if rng is not None else None
    out, mutated = model.apply(variables, images, train=True, mutable=["batch_stats"], rngs=rngs)
    return out, mutated.get("batch_stats", {})


def replica_rng(rng: jax.Array, salt: int) -> jax.Array:
    """The step's key (the same on every replica) made this replica's own, for per-example
    randomness such as drop-path masks; ``salt`` separates the uses within one step."""
    return jax.random.fold_in(jax.random.fold_in(rng, salt), jax.lax.axis_index(DATA_AXIS))


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
    model: Any, params: Any, batch_stats: Any, crops: Any, train: bool, rng: jax.Array | None = None
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
    x = inputs[0] if len(inputs) == 1 else inputs
    return apply_model(model, params, batch_stats, x, train, rng)


def split_crops(x: jax.Array, count: int) -> jax.Array:
    """(count * n, ...) crop-major rows as (count, n, ...)."""
    return x.reshape(count, -1, *x.shape[1:])


def loss_weights(
    config: Any, terms: Sequence[str], steps_per_epoch: int | None = None
) -> Callable[[jax.Array], dict[str, jax.Array]]:
    """``step -> {term: weight}`` from ``config.loss.weights`` and ``config.loss.ramps``.

    A term the config does not name weighs 1 (a workdir's config saved before the term
    existed). A ramp moves the weight from ``ramps.<term>.initial`` at ``begin`` to
    ``weights.<term>`` at ``end`` (``unit`` epochs or steps); because it is a function of the
    optimizer step, a resumed run picks it up mid-ramp at the right value. Evaluation engines
    pass no epoch length: an epoch-unit ramp then reads as finished (its final weight).
    """
    loss_config = config.get("loss")
    weights = loss_config.get("weights", {}) if loss_config is not None else {}
    ramps = loss_config.get("ramps", {}) if loss_config is not None else {}
    schedules = {}
    for term in terms:
        final = float(weights.get(term, 1.0))
        spec = ramps.get(term)
        if spec is None or spec.kind == "constant":
            schedules[term] = schedules_lib.ramp("constant", final, final, 0, 0)
            continue
        if spec.unit == "epochs" and not steps_per_epoch:
            schedules[term] = schedules_lib.ramp("constant", final, final, 0, 0)
            continue
        scale = steps_per_epoch if spec.unit == "epochs" else 1
        schedules[term] = schedules_lib.ramp(
            spec.kind,
            float(spec.initial),
            final,
            int(round(spec.begin * scale)),
            int(round(spec.end * scale)),
        )

    def weights_at(step: jax.Array) -> dict[str, jax.Array]:
        return {term: schedule(step) for term, schedule in schedules.items()}

    return weights_at


def weighted_loss(
    terms: dict[str, jax.Array], weights: dict[str, jax.Array]
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """``(loss, per_example, metrics)`` from unweighted per-example terms (each (n,)).

    ``per_example = sum_t weights[t] * terms[t]`` and ``loss`` its mean over the local rows;
    ``metrics`` logs every term unweighted (``loss/<t>``) and weighted
    (``loss/<t>_weighted``) and its weight (``loss_weight/<t>``).
    """
    per_example, metrics = 0.0, {}
    for name, term in terms.items():
        term = term.astype(jnp.float32)
        weight = weights[name]
        per_example = per_example + weight * term
        mean = jnp.mean(term)
        metrics[f"loss/{name}"] = mean
        metrics[f"loss/{name}_weighted"] = weight * mean
        metrics[f"loss_weight/{name}"] = weight
    return jnp.mean(per_example), per_example, metrics


def check_loss_config(config: Any, terms: Sequence[str]) -> None:
    """Start-up checks of ``config.loss`` against the method's term names."""
    loss_config = config.get("loss")
    if loss_config is None:
        return
    for field in ("weights", "ramps"):
        unknown = sorted(set(loss_config.get(field, {}).keys()) - set(terms))
        if unknown:
            raise ValueError(
                f"loss.{field} names {unknown}, which method.name={config.method.name!r} does "
                f"not have; its loss terms are {list(terms)}."
            )
    for term, spec in loss_config.get("ramps", {}).items():
        where = f"loss.ramps.{term}"
        if spec.kind not in schedules_lib.RAMP_KINDS:
            raise ValueError(
                f"{where}.kind={spec.kind!r} is not one of {schedules_lib.RAMP_KINDS}."
            )
        if spec.unit not in schedules_lib.RAMP_UNITS:
            raise ValueError(
                f"{where}.unit={spec.unit!r} is not one of {schedules_lib.RAMP_UNITS}."
            )
        if spec.kind != "constant" and not 0 <= spec.begin <= spec.end:
            raise ValueError(
                f"{where}: begin={spec.begin} and end={spec.end} must satisfy 0 <= begin <= end "
                f"({spec.unit}); the weight moves from {where}.initial to "
                f"loss.weights.{term} between them."
            )
