"""SSL methods: the contract every method meets, and the registry ``METHODS``.

A method is a module ``jssl.methods.<name>`` exposing ``make(config, steps_per_epoch) ->
Method``, its loss terms (``TERMS``, or ``terms(config)``), optionally ``check_config`` and
``make_images(config)`` (TensorBoard pictures, ``jssl.training.summaries``). A :class:`Method`
is pure functions that the one train step calls: ``forward`` (every model application) and
``objective`` (the UNWEIGHTED loss terms per example, from the forward's embeddings, laid out
``(crops, n, ...)``, the state and the batch without its images) run per replica under
``jax.shard_map`` over the ``data`` axis and see the parameters whole; ``after_update`` (EMA
teachers, queues, centres) runs after the optimizer on the global arrays with no collectives,
so its carry must be the same on every device. The step weighs the terms once for every
method (:func:`loss`) and checks the outputs at trace time. Fields: :class:`Forward`,
:class:`Objective`, :class:`Method`; docs/design.md#extension-points; weights, ramps and
per-crop term families: docs/operations.md#loss-terms-and-parameter-groups.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import ml_collections

METHODS = (
    "moco",
    "mocov3",
    "simclr",
    "swav",
    "deepclusterv2",
    "byol",
    "simsiam",
    "barlow_twins",
    "vicreg",
    "dino",
    "ibot",
    "dinov2",
    "msn",
    "mae",
    "supervised",
)


class Forward(NamedTuple):
    """What a method's ``forward`` returns; the first three fields are required.

    embeddings: what the objective reads, a pytree whose every leaf is ``(crops, n, ...)``
      (the head outputs of every crop, the teacher's, the predictor's), carrying the gradient
      back to the parameters.
    features: stop-gradient trunk features (avgpool) of crop 0, ``(n, ...)``: the online
      probe's input and the test phase's ``features``.
    batch_stats: the online model's new batch-norm statistics (``{}`` where it has none); the
      step averages them over devices and stores them.
    head: the head's output for crop 0, ``(n, d)``: the test phase's ``embeddings``; None where
      it is too wide to write (DINO's 65536 logits).
    carry: a dict for ``after_update`` (the teacher's batch-norm statistics, averaged over the
      data axis), or None; the same on every device.
    """

    embeddings: Any
    features: jax.Array
    batch_stats: Any
    head: jax.Array | None = None
    carry: dict[str, Any] | None = None


class Objective(NamedTuple):
    """What a method's ``objective`` returns; ``terms`` is required.

    terms: the unweighted loss terms, ``{name: (n,)}`` per local example (a batch-level term
      broadcast to every row), named as ``loss_terms(config)``.
    metrics: batch-mean scalars to log (averaged over devices by the step).
    carry: a dict for ``after_update`` (keys to enqueue, the batch's centre), or None; the
      same on every device (gathered or averaged over the data axis).
    per_example_metrics: ``{name: (n,)}`` (a classifier's top-1 hits, in %): the test phase
      reports their mean over the real rows of the split, exactly, in place of the batch mean
      of the same name in ``metrics`` (which the train logs keep).
    """

    terms: dict[str, jax.Array]
    metrics: dict[str, jax.Array] | None = None
    carry: dict[str, Any] | None = None
    per_example_metrics: dict[str, jax.Array] | None = None


class LossOutput(NamedTuple):
    """What :func:`loss` (the step's composition of a method's forward and objective) returns
    besides the scalar loss; methods do not build it.

    metrics: the objective's metrics and, per term, ``loss/<t>``, ``loss/<t>_weighted`` and
      ``loss_weight/<t>`` (and each family's, ``common.weighted_loss``).
    batch_stats, features: the forward's. embeddings: the forward's ``head``.
    carry: the forward's and the objective's carries in one dict, for ``after_update``.
    per_example_loss: the weighted sum of the terms per local example, so the test phase
      averages over real rows only.
    terms: the objective's terms, plus each family's mean at the parts' shares under the
      family's name (``common.reported_terms``: reported, not weighted again).
    per_example_metrics: the objective's.
    """

    metrics: dict[str, jax.Array]
    batch_stats: Any = None
    carry: Any = None
    features: jax.Array | None = None
    embeddings: jax.Array | None = None
    per_example_loss: jax.Array | None = None
    terms: dict[str, jax.Array] | None = None
    per_example_metrics: dict[str, jax.Array] | None = None


class Method(NamedTuple):
    # (rng, sample_images) -> TrainState fields: dict(params, batch_stats, ema_params,
    # ema_batch_stats, method_state); the optimizer state is added by the caller.
    init: Callable[..., dict[str, Any]]
    # (params, state, batch, rng, train) -> Forward; differentiated w.r.t. params. train=False
    # is evaluation mode (running BN statistics; nothing to update).
    forward: Callable[..., Forward]
    # (embeddings, state, batch without images, train) -> Objective.
    objective: Callable[..., Objective]
    # The flax module whose taps the evaluation reads (online trunk + heads).
    model: Any
    # (state, carry) -> state, after the optimizer step and the BN-statistics update: EMA
    # teacher, queues, prototype normalisation. None: nothing to do.
    after_update: Callable[..., Any] | None = None
    # (parameter path prefix, steps): parameters the optimizer holds fixed for their first
    # steps (VISSL TEMP_FROZEN_PARAMS_ITER_MAP; SwAV's prototypes).
    frozen_params: tuple[tuple[str, int], ...] = ()
    # (method_state key, axis): leaves split over the data axis along that axis, with or
    # without parallel.shard_params, where the device count divides it (DeepCluster v2's
    # memory bank); forward and objective see the device's part, after_update the whole.
    split_state: tuple[tuple[str, int], ...] = ()
    # Set by :func:`get` from the config, for every method alike: the name, the loss terms
    # (``common.LossTerm``s) and ``step -> {term: weight}`` (``common.loss_weights``).
    name: str = ""
    terms: tuple[Any, ...] = ()
    weights_at: Callable[[jax.Array], dict[str, jax.Array]] | None = None

    @property
    def loss(self) -> Callable[..., tuple[jax.Array, LossOutput]]:
        """``(params, state, batch, rng, train=True) -> (loss, LossOutput)``: :func:`loss`."""
        return functools.partial(loss, self)


def _module(config: ml_collections.ConfigDict):
    name = config.method.name
    if name not in METHODS:
        raise ValueError(
            f"method.name={name!r} is not one of the methods jssl has: {', '.join(METHODS)}. "
            "Pick one with --config=configs/<method>.py (or --config.method.name)."
        )
    return importlib.import_module(f"jssl.methods.{name}")


def check_config(config: ml_collections.ConfigDict) -> None:
    """The method's start-up checks (``check_config`` of its module, where it has one)."""
    from jssl import data, models
    from jssl.methods import common

    module = _module(config)
    # Every crop the trunk sees: the eval image (test phase, kNN monitor) and each group's
    # training crops (SwAV's and DINO's small ones included).
    models.check_input_size(config.model, config.data.image_size, "data.image_size")
    crop_sizes = tuple(config.data.augment.crop_sizes)
    for group in data.crop_groups(config.data):
        if crop_sizes:
            models.check_input_size(config.model, group.size, "data.augment.crop_sizes", crop_sizes)
        else:
            models.check_input_size(config.model, group.size, "data.image_size")
    common.check_loss_config(config, loss_terms(config))
    if hasattr(module, "check_config"):
        module.check_config(config)


def loss_terms(config: ml_collections.ConfigDict) -> tuple[Any, ...]:
    """The method's loss terms under ``config`` as ``common.LossTerm``s: its module's
    ``terms(config)`` where it defines one, else its static ``TERMS``."""
    from jssl.methods import common

    module = _module(config)
    if hasattr(module, "terms"):
        return common.as_loss_terms(module.terms(config))
    return common.as_loss_terms(module.TERMS)


def get(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    """Imports ``jssl.methods.<config.method.name>``, builds its Method and gives it the loss
    terms and their weights under ``config``.

    ``steps_per_epoch`` (the trainer passes it) lets a method turn epochs of its config into
    steps (SwAV's queue start, a weight's ramp in epochs); evaluation engines leave it None.
    """
    from jssl.methods import common

    method = _module(config).make(config, steps_per_epoch=steps_per_epoch)
    terms = loss_terms(config)
    return method._replace(
        name=config.method.name,
        terms=terms,
        weights_at=common.loss_weights(config, terms, steps_per_epoch),
    )


def loss(
    method: Method, params: Any, state: Any, batch: dict, rng: jax.Array, train: bool = True
) -> tuple[jax.Array, LossOutput]:
    """``(loss, LossOutput)``: the method's forward, then :func:`objective_loss` on its
    embeddings; what the train step differentiates w.r.t. ``params``."""
    out = method.forward(params, state, batch, rng, train)
    check_forward(method, out, batch["crops"][0].shape[0])
    # The objective sees the differentiated parameters (a last layer it applies learns).
    state = state.replace(params=params)
    value, weighted = objective_loss(method, out.embeddings, state, batch, train)
    return value, weighted._replace(
        batch_stats=out.batch_stats,
        features=out.features,
        embeddings=out.head,
        carry=merged_carry(method, out.carry, weighted.carry),
    )


def objective_loss(
    method: Method, embeddings: Any, state: Any, batch: dict, train: bool = True
) -> tuple[jax.Array, LossOutput]:
    """The method's objective on ``embeddings`` (a forward's, or any of the same layout), its
    terms weighed at ``state.step``: ``(loss, LossOutput)`` without the forward's fields.
    ``batch`` reaches the objective without its images."""
    from jssl.methods import common

    if method.weights_at is None:
        raise ValueError(
            f"Method {method.name!r} has no loss weights: build it with "
            "jssl.methods.get(config, steps_per_epoch), not with its module's make()."
        )
    aux = {k: v for k, v in batch.items() if k not in ("crops", "image")}
    out = method.objective(embeddings, state, aux, train)
    _check_objective(method, out, jax.tree.leaves(embeddings)[0].shape[1])
    # The weighted sum in the order of the method's terms, whatever the objective's dict order.
    terms = {t.name: out.terms[t.name] for t in method.terms}
    value, per_example, term_metrics = common.weighted_loss(
        terms, method.weights_at(state.step), method.terms
    )
    return value, LossOutput(
        metrics={**(out.metrics or {}), **term_metrics},
        carry=out.carry,
        per_example_loss=per_example,
        terms=common.reported_terms(terms, method.terms),
        per_example_metrics=out.per_example_metrics,
    )


def _shape_error(method: Method, what: str, shape: Any, wanted: str) -> ValueError:
    return ValueError(
        f"Method {method.name!r}: {what} has shape {shape}, but the contract "
        f"(jssl/methods/__init__.py) wants {wanted}."
    )


def check_forward(method: Method, out: Any, n: int) -> None:
    """Trace-time checks of a forward's output against the contract (shapes only: free)."""
    if not isinstance(out, Forward):
        raise TypeError(
            f"Method {method.name!r}: forward returned {type(out).__name__}; it must return "
            "jssl.methods.Forward(embeddings=..., features=..., batch_stats=...)."
        )
    leaves = jax.tree.leaves(out.embeddings)
    if not leaves:
        raise ValueError(f"Method {method.name!r}: Forward.embeddings holds no array.")
    for path, leaf in jax.tree_util.tree_leaves_with_path(out.embeddings):
        if leaf.ndim < 2 or leaf.shape[1] != n:
            name = f"Forward.embeddings{jax.tree_util.keystr(path)}"
            raise _shape_error(method, name, leaf.shape, f"(crops, {n}, ...)")
    for field in ("features", "head"):
        value = getattr(out, field)
        if value is not None and (value.ndim < 1 or value.shape[0] != n):
            raise _shape_error(method, f"Forward.{field}", value.shape, f"({n}, ...)")
    if out.features is None:
        raise ValueError(f"Method {method.name!r}: Forward.features is None (the probe's input).")


def _check_objective(method: Method, out: Any, n: int) -> None:
    if not isinstance(out, Objective):
        raise TypeError(
            f"Method {method.name!r}: objective returned {type(out).__name__}; it must return "
            "jssl.methods.Objective(terms=...)."
        )
    names = [t.name for t in method.terms]
    if not isinstance(out.terms, dict) or sorted(out.terms) != sorted(names):
        got = sorted(out.terms) if isinstance(out.terms, dict) else type(out.terms).__name__
        raise ValueError(
            f"Method {method.name!r}: the objective's terms are {got}, but its loss terms "
            f"under this config (TERMS or terms(config)) are {names}."
        )
    per_example = {f"terms[{k!r}]": v for k, v in out.terms.items()}
    per_example.update(
        {f"per_example_metrics[{k!r}]": v for k, v in (out.per_example_metrics or {}).items()}
    )
    for name, value in per_example.items():
        if value.shape != (n,):
            raise _shape_error(method, f"Objective.{name}", value.shape, f"({n},), per example")


def merged_carry(method: Method, *carries: dict | None) -> dict | None:
    """The forward's and the objective's carries as one dict (None where both are)."""
    given = [c for c in carries if c is not None]
    if not given:
        return None
    merged: dict[str, Any] = {}
    for carry in given:
        if not isinstance(carry, dict) or set(carry) & set(merged):
            raise ValueError(
                f"Method {method.name!r}: a carry must be a dict, and the forward's and the "
                f"objective's keys must differ; got {[sorted(c) for c in given]}."
            )
        merged.update(carry)
    return merged
