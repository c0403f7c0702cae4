"""The one compiled train step (and its evaluation twin), generic over methods.

``(state, batch) -> (state, metrics)``: the method's forward and objective composed and its
loss terms weighed (``jssl.methods.loss``, the same for every method), gradients averaged
over the ``data`` axis, the optax update, then the method's ``after_update`` (EMA teacher,
queue, batch-norm statistics). The per-replica body runs under ``jax.shard_map`` so that
methods use named collectives; the whole thing is one ``jax.jit`` with the state donated.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jssl import methods, parallel
from jssl.methods import Method
from jssl.methods.common import mean_over_devices
from jssl.models import remat
from jssl.parallel import DATA_AXIS
from jssl.training import accumulation, collapse
from jssl.training import probe as online_probe
from jssl.training.finite import all_finite
from jssl.training.last_reduce import reduce_last
from jssl.training.state import TrainState


def make_train_step(
    method: Method,
    tx: optax.GradientTransformation,
    schedule: Callable[[jax.Array], jax.Array],
    mesh: Mesh,
    probe_config: Any = None,
    augment: Callable[[Any], Any] | None = None,
    accumulation_steps: int = 1,
    state_specs: TrainState | None = None,
    statistics_at: Callable[[jax.Array], jax.Array] | None = None,
    finite_update: str = "auto",
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """Builds the jitted, state-donating train step over ``mesh``.

    With ``probe_config`` (the run's config, probe enabled) the online linear probe is
    trained in the same step on the method's stop-gradient ``Forward.features``.

    The step is called as ``step(state, batch)`` or ``step(state, batch, stop)``, where
    ``stop`` is :func:`stop_flags` of this process's SIGTERM flag: the step returns
    ``metrics["stop"]``, the flag's maximum over every device of every process, so all
    processes agree on when to stop without a collective of their own outside the step.

    ``augment`` (jssl.data.device_augment.make_batch_augment, data.augment.on_device) turns
    the host's uint8 crops into the method's views first, per example, so per replica.

    ``accumulation_steps`` > 1 computes the loss and gradient over that many micro-batches of
    each replica's examples, exactly as over the whole batch (jssl.training.accumulation).

    ``state_specs`` (``jssl.training.state.specs_of`` the state; None: all replicated) is how
    the state is laid out. Leaves split over the data axis (``parallel.shard_params``) are
    gathered whole for the forward pass and their gradients reduce-scattered back to each
    device's part; the optimizer and ``after_update`` then run on the global arrays outside
    the per-replica code, where XLA partitions them like the state (a LARS trust ratio's norm
    is over the whole leaf).

    ``statistics_at`` (``collapse.log_steps``: the engine's log steps) adds the collapse
    statistics of the head output and trunk features over the global batch to the metrics
    (jssl.training.collapse), computed only when ``statistics_at(steps done after this one)``;
    0 on the other steps.

    ``finite_update`` is how a non-finite step keeps the previous state: ``"cond"``, one XLA
    conditional (on CPU a fifth fewer HLO instructions than the selects, the cheapest to
    compile), or ``"select"``, both outcomes computed and one chosen per leaf, which the device
    runs without the host: a GPU conditional copies its predicate to the host and waits for it
    (XLA's ``gpu/runtime/conditional_thunk.cc``), a sync each step that keeps the host from
    running ahead to the next batch. ``"auto"``: ``"cond"`` on a CPU mesh, else ``"select"``.
    The figures are in docs/design.md.
    """
    replicas = mesh.shape[DATA_AXIS]
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    use_cond = _guard_by_cond(finite_update, on_cpu)

    def per_replica(state: TrainState, batch: Any, stop: jax.Array):
        # The state's split leaves whole, as every method's forward expects them, but those
        # that rematerialised blocks gather themselves (remat.gathering; own marks them).
        state = state.replace(
            params=parallel.gather(state.params, specs.params, own.params),
            ema_params=parallel.gather(state.ema_params, specs.ema_params, own.ema_params),
        )
        if augment is not None:
            batch = augment(batch)
        # Same key on every replica: methods that need agreement (shuffle-BN's permutation)
        # get it for free; per-replica randomness folds in jax.lax.axis_index(DATA_AXIS).
        rng = jax.random.fold_in(state.rng, state.step)
        with blocks_gather():
            # jssl.methods.loss: weighted(objective(forward(params))), differentiated w.r.t.
            # params.
            if accumulation_steps > 1:
                (loss, out), grads = accumulation.value_and_grad(
                    method, state.params, state, batch, rng, accumulation_steps
                )
            else:
                grad_fn = jax.value_and_grad(functools.partial(methods.loss, method), has_aux=True)
                (loss, out), grads = grad_fn(state.params, state, batch, rng)
        # Equal local batches, so the mean of per-replica means is the global mean.
        grads = parallel.mean_to_shards(grads, specs.params, replicas, own.params)
        metrics = dict(out.metrics)
        rows = None
        if statistics_at is not None:
            # The same on every replica (over the global batch); the SVD, and except on CPU
            # the gather (see jssl.training.last_reduce), run only at the steps asked for.
            rows = {"head": out.embeddings, "features": out.features}
            if replicas > 1 and not on_cpu:
                metrics.update(
                    collapse.step_statistics(statistics_at(state.step + 1), rows, DATA_AXIS)
                )
                rows = None
        batch_stats = None
        if out.batch_stats is not None:
            # Per-device statistics (sync_bn=False) differ; their mean keeps the replicated
            # state consistent (with sync_bn they are equal and this is a no-op).
            batch_stats = mean_over_devices(out.batch_stats)
        new_probe = None
        checked = (loss, grads)
        if probe_config is not None and state.probe:
            new_probe, probe_metrics = online_probe.update(
                probe_config, state.probe, out.features, batch["label"], DATA_AXIS
            )
            metrics.update(probe_metrics)
            checked = (*checked, probe_metrics["probe/loss"])
        # A split gradient's part is checked on every device: one non-finite part flags all.
        # The flag waits for the batch statistics and the carry too (jssl.training.last_reduce).
        finite = all_finite(checked)
        if replicas > 1:
            finite = parallel.after(finite, batch_stats, out.carry)
        loss, metrics, finite, metrics["stop"], rows = reduce_last(
            loss, metrics, finite, stop, replicas, rows
        )
        if rows is not None:
            metrics.update(collapse.step_statistics(statistics_at(state.step + 1), rows, None))
        return grads, (loss, metrics, batch_stats, out.carry, new_probe, finite)

    def step(state: TrainState, batch: Any, stop: jax.Array):
        grads, (loss, metrics, batch_stats, carry, new_probe, finite) = sharded(state, batch, stop)

        def updated(state):
            param_updates, opt_state = tx.update(grads, state.opt_state, state.params)
            new_state = state.replace(
                step=state.step + 1,
                params=optax.apply_updates(state.params, param_updates),
                opt_state=opt_state,
            )
            if batch_stats is not None:
                new_state = new_state.replace(batch_stats=batch_stats)
            if method.after_update is not None:
                new_state = method.after_update(new_state, carry)
            if new_probe is not None:
                new_state = new_state.replace(probe=new_probe)
            return new_state

        def kept(state):
            first_bad = jnp.where(state.nonfinite_step >= 0, state.nonfinite_step, state.step)
            return state.replace(nonfinite_step=first_bad)

        # A non-finite loss or gradient (the method's or the online probe's) keeps the
        # previous state and records the step, so the host can stop with a precise message
        # and the last checkpoint stays valid; so do the steps after it until the host stops,
        # which leaves the state of the last good step to save.
        healthy = finite & (state.nonfinite_step < 0)
        if use_cond:
            new_state = jax.lax.cond(healthy, updated, kept, state)
        else:
            new_state = _select_per_leaf(healthy, updated(state), kept(state))
        metrics = dict(metrics, loss=loss, learning_rate=schedule(state.step))
        return new_state, metrics

    specs = sharded = jitted = recorder = None
    own = types.SimpleNamespace(params=None, ema_params=None)  # set by build

    def blocks_gather():
        if not any(jax.tree.leaves((own.params, own.ema_params))):
            return contextlib.nullcontext()
        return remat.gathering(recorder, DATA_AXIS)

    def build(state: TrainState, batch: Any):
        """The jitted step for the state's layout: ``state_specs``, else all replicated."""
        nonlocal specs, sharded, jitted, recorder, own
        specs = jax.tree.map(lambda _: P(), state) if state_specs is None else state_specs
        split = {
            (name, i)
            for name in ("params", "ema_params")
            for i, spec in enumerate(
                jax.tree.leaves(getattr(specs, name), is_leaf=lambda x: isinstance(x, P))
            )
            if parallel.sharded_dim(spec) is not None
        }
        recorder = _record_blocks(method, state, batch, mesh, augment) if split else None
        keys = recorder.leaves() & split if recorder is not None else set()
        own = _marked(state, keys)
        if recorder is not None:
            logging.info(
                "Split parameters gathered block by block (model.remat): %d of %d; the "
                "others whole before the forward pass.",
                len(keys),
                len(split),
            )
        sharded = jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(specs, P(DATA_AXIS), P(DATA_AXIS)),
            out_specs=(specs.params, P()),
            # Replicated values are kept consistent by the explicit means above (pmap style).
            check_vma=False,
        )
        shardings = (parallel.named(mesh, specs), parallel.replicated(mesh))
        jitted = jax.jit(step, donate_argnums=0, out_shardings=shardings)
        return jitted

    no_stop = None  # made at the first call: a compile-only mesh (no arrays) never calls

    def train_step(state: TrainState, batch: Any, stop: jax.Array | None = None):
        nonlocal no_stop
        if stop is None:
            no_stop = stop = stop_flags(mesh, False) if no_stop is None else no_stop
        return (jitted or build(state, batch))(state, batch, stop)

    def trace(state: TrainState, batch: Any, stop: jax.Array):
        """``jax.jit``'s trace of ``step(state, batch, stop)`` (shapes or arrays), to lower
        ahead of time, for the host's platform or another."""
        return (jitted or build(state, batch)).trace(state, batch, stop)

    def lower(state: TrainState, batch: Any, stop: jax.Array):
        return trace(state, batch, stop).lower()

    train_step.lower = lower
    train_step.trace = trace
    return train_step


FINITE_UPDATES = ("auto", "cond", "select")


def _guard_by_cond(finite_update: str, on_cpu: bool) -> bool:
    """Whether the step's non-finite guard is one conditional (else selects per leaf)."""
    if finite_update not in FINITE_UPDATES:
        raise ValueError(
            f"finite_update={finite_update!r}: use one of {FINITE_UPDATES} ('auto': a "
            "conditional on CPU, selects per leaf on accelerators)."
        )
    return finite_update == "cond" or (finite_update == "auto" and on_cpu)


def _select_per_leaf(healthy: jax.Array, updated: TrainState, kept: TrainState) -> TrainState:
    """``updated`` where ``healthy``, else ``kept``, leaf by leaf. A leaf that both share (the
    same traced value: the rng, a field the update leaves alone) is taken as it is, so only the
    leaves the update or the guard changed get a select. ``lax.select`` (``jnp.where`` without
    its type promotion) fails, as the cond would, on a leaf whose dtype the update changed.
    Each select is elementwise between leaves of one sharding, so the state keeps its layout
    (and the jit's out_shardings)."""

    def choose(new, old):
        return new if new is old else jax.lax.select(healthy, new, old)

    return jax.tree.map(choose, updated, kept)


def _record_blocks(method: Method, state, batch, mesh: Mesh, augment):
    """remat.recording of the method's loss traced once on whole parameters (shapes only):
    which leaves of ``params`` and ``ema_params`` reach a rematerialised block unchanged."""
    trees = ("params", "ema_params")
    found = {}

    def body(state, batch):
        ids = {
            id(leaf): (name, i)
            for name in trees
            for i, leaf in enumerate(jax.tree.leaves(getattr(state, name)))
        }
        if augment is not None:
            batch = augment(batch)
        rng = jax.random.fold_in(state.rng, state.step)
        with remat.recording(ids) as found["recorder"]:
            methods.loss(method, state.params, state, batch, rng)
        return jnp.zeros(())

    def shapes(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)

    traced = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(jax.tree.map(lambda _: P(), state), P(DATA_AXIS)),
        out_specs=P(),
        check_vma=False,
    )
    jax.eval_shape(traced, shapes(state), shapes(batch))
    return found["recorder"]


def _marked(state, keys: set):
    """A TrainState whose params and ema_params are trees of bools: the leaves in ``keys``."""
    marks = {}
    for name in ("params", "ema_params"):
        tree = getattr(state, name)
        leaves, treedef = jax.tree.flatten(tree)
        marks[name] = jax.tree.unflatten(treedef, [(name, i) in keys for i in range(len(leaves))])
    return state.replace(**marks)


def stop_flags(mesh: Mesh, requested: bool) -> jax.Array:
    """This process's stop request as the step's ``stop`` input: one int32 per device,
    sharded on the data axis (each process fills its own devices' entries)."""
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    local = np.full((len(mesh.local_devices),), int(requested), np.int32)
    return jax.make_array_from_process_local_data(sharding, local)


def make_eval_step(
    method: Method,
    mesh: Mesh,
    *,
    crop_groups: Sequence[tuple[int, int]] = ((2, 0),),
    taps: Sequence[str] = (),
) -> Callable[[TrainState, Any], tuple]:
    """The method's loss on an evaluation batch, in evaluation mode (BN running statistics,
    no state updates), with the per-example outputs the test phase writes.

    The batch is the evaluation pipeline's ``{"image", "label", "index", "mask"}`` (one
    centre crop per example, padding rows with ``mask`` False). The image is fed as every
    crop of every crop group, ``crop_groups`` being ``(num_crops, size)`` pairs (size 0: the
    image's own; others are resized to), so the test loss is the method's loss on identical
    centre-crop views: it measures the encoders' agreement on clean images, not the
    augmentation-invariance the training loss measures.

    Returns ``(totals, per_example)``:

    - ``totals``: ``{name: (weighted_sum, weight)}`` summed over the global batch, so the
      caller averages over a whole split with sum(weighted_sum) / sum(weight). ``loss`` is
      exact over the real rows (the method's ``per_example_loss`` times ``mask``). The
      method's batch-mean metrics cannot be split per example, so they count only for local
      (per-device) batches without padding rows; its ``per_example_metrics`` are exact.
    - ``per_example`` (sharded like the batch): ``per_example_loss``, ``embeddings`` (head
      output), ``features`` (trunk avgpool) when the method provides them, the unweighted
      loss terms as ``term_<name>`` (``loss/<name>`` in ``totals`` is exact too), and each layer of
      ``taps`` from the same eval-mode forward of the online model (XLA computes the
      network once: it is the method's query forward on the same image), as float32.
    """
    per_example_keys = ("per_example_loss", "embeddings", "features")
    taps = tuple(taps)

    def per_replica(state: TrainState, batch: Any):
        image = batch["image"]
        mask = batch["mask"].astype(jnp.float32)
        method_batch = dict(batch, crops=_as_crops(image, crop_groups))
        loss, out = methods.loss(method, state.params, state, method_batch, state.rng, False)
        metrics = out.metrics
        outputs = {
            k: getattr(out, k).astype(jnp.float32)
            for k in per_example_keys
            if getattr(out, k) is not None
        }
        if taps:
            variables = {"params": state.params, "batch_stats": state.batch_stats}
            tapped = method.model.apply(variables, image, train=False)
            missing = [layer for layer in taps if layer not in tapped]
            if missing:
                raise KeyError(f"unknown layer(s) {missing}; the model taps {sorted(tapped)}")
            outputs.update({layer: tapped[layer].astype(jnp.float32) for layer in taps})

        count = jnp.sum(mask)
        # A local batch with padding rows has batch means polluted by them: weight 0.
        full = jnp.where(count == mask.shape[0], count, 0.0)
        totals = {name: (value * full, full) for name, value in metrics.items()}
        if out.per_example_loss is not None:
            per_example_loss = out.per_example_loss.astype(jnp.float32)
            totals["loss"] = (jnp.sum(per_example_loss * mask), count)
        else:
            totals["loss"] = (loss * full, full)
        for name, term in (out.terms or {}).items():
            term = term.astype(jnp.float32)
            outputs[f"term_{name}"] = term
            totals[f"loss/{name}"] = (jnp.sum(term * mask), count)
        for name, value in (out.per_example_metrics or {}).items():
            totals[name] = (jnp.sum(value.astype(jnp.float32) * mask), count)
        return jax.lax.psum(totals, DATA_AXIS), outputs

    sharded = jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(P(), P(DATA_AXIS)),
        out_specs=(P(), P(DATA_AXIS)),
        check_vma=False,
    )
    # Without the optimizer state, which is not read: a state split over the devices
    # (parallel.shard_params) is gathered whole for the shard_map, the rest of it only.
    return jax.jit(lambda state, batch: sharded(state.replace(opt_state={}), batch))


def _as_crops(image: jax.Array, crop_groups: Sequence[tuple[int, int]]) -> tuple:
    """``image`` (n, H, W, 3) as every crop of each group: (n, num_crops, S, S, 3) arrays."""
    out = []
    for count, size in crop_groups:
        n, h, w, c = image.shape
        resized = image
        if size and (size, size) != (h, w):
            resized = jax.image.resize(image, (n, size, size, c), "linear", antialias=True)
        out.append(jnp.broadcast_to(resized[:, None], (n, count, *resized.shape[1:])))
    return tuple(out)


def make_forward(method: Method, mesh: Mesh) -> Callable[[TrainState, jax.Array], dict]:
    """Eval-mode taps of the online model on a globally sharded image batch."""

    def forward(state: TrainState, images: jax.Array) -> dict[str, jax.Array]:
        variables = {"params": state.params, "batch_stats": state.batch_stats}
        return method.model.apply(variables, images, train=False)

    # Eval mode has no cross-example coupling, so plain jit over sharded inputs suffices; the
    # module's bn_axis_name is never used with use_running_average=True.
    return jax.jit(forward)
