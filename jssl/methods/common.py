"""Pieces every method would otherwise write again: the model applied in train or eval mode
(to one batch or to every crop group), batch-norm statistics averaged over devices,
momentum (EMA) teachers with a schedule, and named loss terms with weights that may follow a
ramp over training (``config.loss``), which ``jssl.methods.loss`` applies for every method.

Crops: ``batch["crops"]`` holds one array per crop group (jssl.data.crops), of shape
(n, num_crops, S, S, 3). ``views(batch)`` lists every crop as its own (n, S, S, 3) batch, in
crop order; ``forward_crops`` runs the model on all of them the way VISSL's multi-resolution
forward does and returns taps of (num_crops * n, ...) rows, crop-major: row ``c * n + i`` is
crop c of image i.

All of it runs per replica inside the step's ``shard_map`` over ``DATA_AXIS``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jssl.optim import schedules as schedules_lib
from jssl.parallel import DATA_AXIS


def apply_model(
    model: Any,
    params: Any,
    batch_stats: Any,
    images: jax.Array | Sequence[jax.Array],
    train: bool,
    row_keys: jax.Array | Sequence[jax.Array] | None = None,
    **trunk_kwargs,
) -> tuple[dict[str, jax.Array], Any]:
    """``(taps, new batch_stats)``: train mode normalises with batch statistics and returns
    the updated running ones; eval mode uses the running ones and returns them unchanged.
    ``row_keys`` (one key per image row, :func:`drop_path_keys`) drive a ViT's stochastic
    depth in train mode; ``trunk_kwargs`` (a ViT's ``mask``, ``keep``) go to the trunk."""
    variables = {"params": params, "batch_stats": batch_stats}
    if train and row_keys is not None and uses_drop_path(model):
        trunk_kwargs = dict(trunk_kwargs, row_keys=row_keys)
    return apply_variables(model, variables, train, images, train=train, **trunk_kwargs)


def apply_variables(
    model: Any, variables: dict, train: bool, /, *args, **kwargs
) -> tuple[Any, Any]:
    """``model.apply(variables, *args, **kwargs)`` and the new ``batch_stats``: updated in
    train mode, ``variables["batch_stats"]`` unchanged in eval mode."""
    if not train:
        return model.apply(variables, *args, **kwargs), variables["batch_stats"]
    out, mutated = model.apply(variables, *args, mutable=["batch_stats"], **kwargs)
    return out, mutated.get("batch_stats", {})


# Streams of the step key for per-example draws (example_keys): distinct draws, distinct keys.
DROP_PATH_STREAM = 0x5D0B
MASK_STREAM = 0x3A5C


def example_keys(rng: jax.Array, index: jax.Array, stream: int) -> jax.Array:
    """One key per row, ``fold_in(fold_in(rng, stream), index[i])``: a draw keyed by (seed,
    step, example index) as the augmentations are, so an example gets the same draw on any
    number of devices, in any micro-batch and after a resume. ``rng`` is the forward's step key
    (the same on every replica); ``index`` is ``batch["index"]``."""
    stream_key = jax.random.fold_in(rng, stream)
    return jax.vmap(lambda i: jax.random.fold_in(stream_key, i))(index.astype(jnp.uint32))


def drop_path_keys(rng: jax.Array, index: jax.Array, crops: int, first: int = 0) -> jax.Array:
    """Stochastic depth's row keys for crops ``first .. first + crops - 1`` of the examples
    ``index``, crop-major (row ``c * n + i``: crop c of example i, keyed by the step, the crop
    number and the example)."""
    base = jax.random.fold_in(rng, DROP_PATH_STREAM)
    return jnp.concatenate([example_keys(base, index, c) for c in range(first, first + crops)])


def view_drop_keys(
    model: Any, rng: jax.Array, batch: dict, crop: int, train: bool
) -> jax.Array | None:
    """:func:`drop_path_keys` of one view (crop number ``crop``) for :func:`apply_model`, or
    None where the model has no stochastic depth or is not training."""
    if not (train and uses_drop_path(model)):
        return None
    return drop_path_keys(rng, batch["index"], 1, first=crop)


def uses_drop_path(model: Any) -> bool:
    """Whether ``model`` (a trunk, or a trunk with a head) has stochastic depth."""
    trunk = getattr(model, "trunk", model)
    return float(getattr(trunk, "drop_path_rate", 0.0) or 0.0) > 0.0


def without_drop_path(model: Any) -> Any:
    """``model`` with its trunk's stochastic depth off: the teacher or momentum encoder of a
    student with drop path (DINO's ``main_dino.py`` builds the teacher without it)."""
    if not uses_drop_path(model):
        return model
    if hasattr(model, "trunk"):
        return model.clone(trunk=model.trunk.clone(drop_path_rate=0.0))
    return model.clone(drop_path_rate=0.0)


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


def target_momentum(config: Any, steps_per_epoch: int | None):
    """``momentum_at(steps_done)``: cosine from ``method.base_momentum`` to
    ``method.final_momentum`` over the run (BYOL Sec. 3.2; MoCo v3 ``adjust_moco_momentum``).
    Evaluation engines pass no epoch length; the momentum is then never used."""
    mcfg = config.method
    total_steps = int(config.num_epochs * steps_per_epoch) if steps_per_epoch else 1

    def momentum_at(steps_done: jax.Array) -> jax.Array:
        return cosine_momentum(steps_done, total_steps, mcfg.base_momentum, mcfg.final_momentum)

    return momentum_at


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
    model: Any,
    params: Any,
    batch_stats: Any,
    crops: Any,
    train: bool,
    rng: jax.Array | None = None,
    index: jax.Array | None = None,
) -> tuple[dict[str, jax.Array], Any]:
    """The model on every crop: ``(taps, new batch_stats)``, taps crop-major (row c * n + i).

    Consecutive groups of one size are concatenated into one trunk batch, one trunk pass per
    resolution, and the head runs on all crops at once (VISSL ``multi_res_input_forward``), so
    train-mode batch norm normalises each resolution's crops together and the head's over all.

    With ``rng`` (the forward's step key) and ``index`` (``batch["index"]``) in train mode, a
    trunk with stochastic depth draws each row's masks from (step, crop, example index)
    (:func:`drop_path_keys`): the same on any number of devices and in any micro-batch.
    """
    by_size: list[list[jax.Array]] = []  # (n, crops, S, S, 3) groups, one list per size
    for group in crops:
        if by_size and by_size[-1][0].shape[2:] == group.shape[2:]:
            by_size[-1].append(group)
        else:
            by_size.append([group])
    stacked = [jnp.concatenate(same, axis=1) if len(same) > 1 else same[0] for same in by_size]
    inputs = [jnp.swapaxes(s, 0, 1).reshape(-1, *s.shape[2:]) for s in stacked]
    row_keys = None
    if train and uses_drop_path(model):
        if rng is None or index is None:
            raise ValueError(
                "This network has stochastic depth (model.drop_path_rate > 0): its training "
                "forward needs the step key and batch['index'] (forward_crops(..., rng, index))."
            )
        keys = drop_path_keys(rng, index, sum(s.shape[1] for s in stacked))
        row_keys, start = [], 0
        for s in stacked:
            row_keys.append(keys[start : start + s.shape[0] * s.shape[1]])
            start += s.shape[0] * s.shape[1]
        row_keys = row_keys[0] if len(inputs) == 1 else row_keys
    x = inputs[0] if len(inputs) == 1 else inputs
    return apply_model(model, params, batch_stats, x, train, row_keys)


def split_crops(x: jax.Array, count: int) -> jax.Array:
    """(count * n, ...) crop-major rows as (count, n, ...)."""
    return x.reshape(count, -1, *x.shape[1:])


class LossTerm(NamedTuple):
    """One named loss term of a method.

    name: the term, as logged (``loss/<name>``), written (``term_<name>.npy``) and weighted
      (``config.loss.weights.<name>``).
    family: the term it is a part of: itself for a term of its own; for a term split per crop
      (SwAV's ``swapped_prediction_crop0``, DINO's ``cross_entropy_crop1``), the name of the
      single term it was split from, whose weight and ramp (``loss.weights.<family>``) scale
      every part.
    share: the part's weight when the config does not set it: its share of the family's mean
      (1 / number of parts), so the default total is the mean the single term was.
    """

    name: str
    family: str
    share: float = 1.0


def as_loss_terms(terms: Sequence[str | LossTerm]) -> tuple[LossTerm, ...]:
    """``LossTerm``s from a method's ``TERMS`` (names of terms of their own) or its
    ``terms(config)``."""
    return tuple(t if isinstance(t, LossTerm) else LossTerm(t, t) for t in terms)


def crop_terms(family: str, crops: Sequence[int]) -> tuple[LossTerm, ...]:
    """The parts of ``family`` per crop: ``<family>_crop<c>`` for each crop number ``c``,
    each with the share ``1 / len(crops)``."""
    crops = tuple(int(c) for c in crops)
    return tuple(LossTerm(f"{family}_crop{c}", family, 1.0 / len(crops)) for c in crops)


def _ramped(
    name: str, final: float, ramps: Any, steps_per_epoch: int | None
) -> Callable[[jax.Array], jax.Array]:
    """``loss.ramps.<name>`` moving to ``final`` (constant where none is set)."""
    spec = ramps.get(name)
    if spec is None or spec.kind == "constant" or (spec.unit == "epochs" and not steps_per_epoch):
        # Without an epoch length (evaluation engines) an epoch ramp reads as finished.
        return schedules_lib.ramp("constant", final, final, 0, 0)
    scale = steps_per_epoch if spec.unit == "epochs" else 1
    return schedules_lib.ramp(
        spec.kind,
        float(spec.initial),
        final,
        int(round(spec.begin * scale)),
        int(round(spec.end * scale)),
    )


def _is_constant(name: str, ramps: Any) -> bool:
    spec = ramps.get(name)
    return spec is None or spec.kind == "constant"


def loss_weights(
    config: Any, terms: Sequence[str | LossTerm], steps_per_epoch: int | None = None
) -> Callable[[jax.Array], dict[str, jax.Array]]:
    """``step -> {term: weight}`` from ``config.loss.weights`` and ``config.loss.ramps``.

    ``terms``: a method's ``TERMS`` or ``terms(config)`` (:class:`LossTerm`). A term's weight is
    ``loss.weights.<term>``; where that is unset (absent, as in a workdir's config saved before
    the term existed, or None) it is the term's ``share`` (1 for a term of its own). A part of
    a family (a term split per crop) is further multiplied by the family's weight,
    ``loss.weights.<family>`` (1 where unset), so that field weighs the family's mean as it
    weighed the single term, and ``loss.weights.<family>_crop<c>`` replaces one part's share.

    A ramp moves a weight from ``ramps.<name>.initial`` at ``begin`` to ``weights.<name>`` at
    ``end`` (``unit`` epochs or steps); because it is a function of the optimizer step, a
    resumed run picks it up mid-ramp at the right value. A family's ramp moves the family's
    factor, a part's its own. Evaluation engines pass no epoch length: an epoch-unit ramp then
    reads as finished (its final weight).
    """
    loss_config = config.get("loss")
    weights = loss_config.get("weights", {}) if loss_config is not None else {}
    ramps = loss_config.get("ramps", {}) if loss_config is not None else {}

    def final(name: str, default: float) -> float:
        value = weights.get(name)
        return default if value is None else float(value)

    schedules = {}
    for term in as_loss_terms(terms):
        own = _ramped(term.name, final(term.name, term.share), ramps, steps_per_epoch)
        if term.family == term.name:
            schedules[term.name] = own
            continue
        family_weight = final(term.family, 1.0)
        if _is_constant(term.name, ramps) and _is_constant(term.family, ramps):
            # One float32 constant: family 1 x share 1/2 is exactly 1/2, so the default total
            # is the single term's mean bit for bit where the parts' mean is exact.
            value = family_weight * final(term.name, term.share)
            schedules[term.name] = schedules_lib.ramp("constant", value, value, 0, 0)
            continue
        family = _ramped(term.family, family_weight, ramps, steps_per_epoch)
        schedules[term.name] = lambda step, own=own, family=family: family(step) * own(step)

    def weights_at(step: jax.Array) -> dict[str, jax.Array]:
        return {term: schedule(step) for term, schedule in schedules.items()}

    return weights_at


def weighted_loss(
    terms: dict[str, jax.Array],
    weights: dict[str, jax.Array],
    specs: Sequence[str | LossTerm] = (),
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """``(loss, per_example, metrics)`` from unweighted per-example terms (each (n,)).

    ``per_example = sum_t weights[t] * terms[t]`` and ``loss`` its mean over the local rows;
    ``metrics`` logs every term unweighted (``loss/<t>``) and weighted
    (``loss/<t>_weighted``) and its weight (``loss_weight/<t>``). With ``specs`` naming
    families of parts, each family is logged too: ``loss/<family>``, the parts' mean at their
    shares (the single term's value before the split), and ``loss/<family>_weighted``, the
    family's part of the loss.
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
    for family, parts in _families(specs).items():
        metrics[f"loss/{family}"] = jnp.mean(family_term(terms, parts))
        metrics[f"loss/{family}_weighted"] = sum(
            metrics[f"loss/{part.name}_weighted"] for part in parts
        )
    return jnp.mean(per_example), per_example, metrics


def _families(specs: Sequence[str | LossTerm]) -> dict[str, list[LossTerm]]:
    families: dict[str, list[LossTerm]] = {}
    for term in as_loss_terms(specs):
        if term.family != term.name:
            families.setdefault(term.family, []).append(term)
    return families


def family_term(terms: dict[str, jax.Array], parts: Sequence[LossTerm]) -> jax.Array:
    """The parts' mean at their shares, per example: the single term before the split."""
    return sum(part.share * terms[part.name].astype(jnp.float32) for part in parts)


def reported_terms(
    terms: dict[str, jax.Array], specs: Sequence[str | LossTerm]
) -> dict[str, jax.Array]:
    """``terms`` plus each family's :func:`family_term` under the family's name: what the step
    hands the test phase as ``LossOutput.terms`` (written as ``term_<name>.npy``), so the
    per-example outputs keep the single term next to its parts. Reported, never weighted."""
    return {**terms, **{f: family_term(terms, p) for f, p in _families(specs).items()}}


def check_loss_config(config: Any, terms: Sequence[str | LossTerm]) -> None:
    """Start-up checks of ``config.loss`` against the method's terms (``TERMS`` or
    ``terms(config)``): every weight or ramp must name a term or a family of parts. A config
    declares the parts of the crops it was written for (``configs/base.py`` ``loss_terms``);
    after a command-line change of the crops, a part's field that is still unset (weight None,
    constant ramp) is left alone, a set one is refused."""
    loss_config = config.get("loss")
    if loss_config is None:
        return
    specs = as_loss_terms(terms)
    known = {t.name for t in specs} | {t.family for t in specs}
    names = [t.name for t in specs]
    weights, ramps = loss_config.get("weights", {}), loss_config.get("ramps", {})
    unset = {
        "weights": lambda name: weights.get(name) is None,
        "ramps": lambda name: ramps[name].get("kind") == "constant",
    }
    for field in ("weights", "ramps"):
        unknown = sorted(
            name
            for name in loss_config.get(field, {}).keys()
            if name not in known and not unset[field](name)
        )
        if unknown:
            raise ValueError(
                f"loss.{field} names {unknown}, which method.name={config.method.name!r} does "
                f"not have with this config; its loss terms are {names}"
                + (f" (parts of {sorted(known - set(names))})" if known - set(names) else "")
                + "."
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
