"""The train engine's check that a run is finite, before every save and at every log step.

The train step records the first step whose loss or gradients were non-finite and from then
on keeps the state as it was before it (jssl.training.step), but an update can still leave a
non-finite state behind a finite loss, e.g. batch-norm running variances that overflow. So the
state itself is checked too, field by field, and a non-finite one is never saved.
``all_finite`` is the one flag both compute. ``Guard`` keeps the last two steps' host batches,
so that a step whose inputs held NaN or Inf is reported by its examples, not as a learning
rate problem, and the state before it saved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jssl.checkpoints import manager as checkpoint
from jssl.training.state import TrainState

# The fields of floating-point values; step, rng and nonfinite_step are integers.
FIELDS = (
    "params",
    "batch_stats",
    "opt_state",
    "ema_params",
    "ema_batch_stats",
    "method_state",
    "probe",
)
# Leaves of at least this many elements are checked where they lie instead of being copied
# into the concatenation: Barlow Twins' and VICReg's 8192x8192 projector layers.
_CHECK_IN_PLACE = 1 << 22


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every floating-point leaf of ``tree`` is finite, as one scalar
    (the train step's guard on its loss and gradients, and this module's check of the state).

    One check over the concatenation of the leaves, not one per leaf: XLA's CPU backend compiles
    each per-leaf reduction as its own kernel (0.6-0.8 s of a ResNet-18 step's compile on 2
    cores). The copy is made after the backward pass has freed its activations, so peak memory
    does not grow, except for the largest leaves, which are checked in place.
    """
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    flags = [jnp.all(jnp.isfinite(x)) for x in leaves if x.size >= _CHECK_IN_PLACE]
    small = [jnp.ravel(x) for x in leaves if x.size < _CHECK_IN_PLACE]
    if small:
        flags.append(jnp.all(jnp.isfinite(jnp.concatenate(small))))
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


@jax.jit
def _finite_fields(state: TrainState) -> dict[str, jax.Array]:
    return {name: all_finite(getattr(state, name)) for name in FIELDS}


def nonfinite_fields(state: TrainState) -> list[str]:
    """The names of the fields of ``state`` that hold inf or NaN ([] when all is finite)."""
    flags = jax.device_get(_finite_fields(state))
    return [name for name in FIELDS if not flags[name]]


class NonFiniteLossError(FloatingPointError):
    pass


class NonFiniteInputError(NonFiniteLossError):
    """The loss was non-finite because examples of the step's batch held NaN or Inf."""


def check(
    state: TrainState,
    step: int,
    steps_per_epoch: int,
    newest_checkpoint: Callable[[], str],
    bad_inputs: Callable[[TrainState, int], str] | None = None,
) -> None:
    """Raises NonFiniteLossError if the step saw a non-finite loss or gradient, or if a field
    of ``state`` (at ``step``) holds inf or NaN. ``newest_checkpoint()`` describes the newest
    checkpoint saved ("" when there is none), for the message; ``bad_inputs(state, step)``
    the non-finite inputs of that step ("" when they were finite or are gone), raised as
    NonFiniteInputError instead."""
    bad = int(jax.device_get(state.nonfinite_step))
    fields = nonfinite_fields(state) if bad < 0 else []
    if bad < 0 and not fields:
        return
    found = bad_inputs(state, bad) if bad >= 0 and bad_inputs is not None else ""
    if found:
        raise NonFiniteInputError(found)
    if bad >= 0:
        what = (
            f"The loss or gradients (of the method or of the online probe) became non-finite "
            f"at step {bad} (epoch {bad // steps_per_epoch}). Training stopped; the parameters "
            "from before that step are kept"
        )
    else:
        what = (
            f"The training state was found non-finite at step {step} (epoch "
            f"{(step - 1) // steps_per_epoch}): {', '.join(fields)} hold inf or NaN although "
            "the loss and gradients were finite (e.g. overflowing batch-norm running "
            "variances). Training stopped without saving it"
        )
    newest = newest_checkpoint()
    kept = (
        f"the newest checkpoint, {newest}, is finite (no non-finite state is ever saved)"
        if newest
        else "no checkpoint had been saved yet"
    )
    raise NonFiniteLossError(
        f"{what}; {kept}. Try a lower --config.optim.base_lr, warmup "
        "(--config.optim.warmup_epochs), or --config.debug.nans=True to find the op (a config "
        "change: use a new --workdir, or --config.checkpoint.allow_config_change=True)."
    )


def nonfinite_rows(host_batch: dict) -> np.ndarray:
    """Which examples (rows) of a host batch hold NaN or Inf in their crops (one
    ``(n, crops, S, S, 3)`` array per crop group; uint8 crops are always finite)."""
    groups = [np.asarray(group) for group in host_batch["crops"]]
    rows = np.zeros(len(groups[0]), bool)
    for group in groups:
        if np.issubdtype(group.dtype, np.inexact):
            rows |= ~np.isfinite(group.reshape(len(group), -1)).all(axis=1)
    return rows


def nonfinite_examples(host_batch: dict) -> tuple[list[int], list[int]]:
    """(dataset indices, positions in the global batch) of every process's examples of this
    step that hold NaN or Inf; the indices are [] where the batches have no ``index``."""
    rows = nonfinite_rows(host_batch)
    index = np.asarray(host_batch.get("index", np.full(len(rows), -1)))
    if jax.process_count() > 1:
        rows, index = (np.ravel(multihost_utils.process_allgather(x)) for x in (rows, index))
    positions = np.flatnonzero(rows)
    indices = [int(i) for i in index[positions] if i >= 0]
    return indices, [int(p) for p in positions]


class Guard:
    """The train engine's ``check``, naming the newest checkpoint of its workdir, with the host
    batches of the last two steps kept: the loop checks each step's loss one step late, so the
    batch of a non-finite step is still at hand. When its inputs held NaN or Inf, the message
    names those examples, and the state from before that step (which the step kept) is saved
    first, so that no step trained before it is lost."""

    def __init__(self, manager, workdir: str, steps_per_epoch: int):
        self.manager, self.workdir, self.steps_per_epoch = manager, workdir, steps_per_epoch
        self.recent: dict[int, tuple[int, int, dict]] = {}

    def keep(self, step: int, epoch: int, index: int, host_batch: dict) -> None:
        """Keeps batch ``index`` of ``epoch``, trained as ``step`` (steps done after it)."""
        self.recent = {s: kept for s, kept in self.recent.items() if s == step - 1}
        self.recent[step] = (epoch, index, host_batch)

    def __call__(self, state: TrainState, step: int) -> None:
        check(state, step, self.steps_per_epoch, self.newest_checkpoint, self.bad_inputs)

    def newest_checkpoint(self) -> str:
        checkpoint.finish(self.manager)  # the save in flight counts
        saved = checkpoint.saved_steps(self.workdir)
        return f"step {saved[-1]} in {checkpoint.checkpoint_dir(self.workdir)}" if saved else ""

    def bad_inputs(self, state: TrainState, bad: int) -> str:
        """The message for step ``bad`` (0-based) when its inputs were not finite, after
        saving ``state`` (from before it) at that batch's position; else ""."""
        if bad + 1 not in self.recent:
            return ""
        epoch, index, host_batch = self.recent[bad + 1]
        indices, positions = nonfinite_examples(host_batch)
        if not positions:
            return ""
        fields = nonfinite_fields(state)
        if bad == 0:
            kept = "no step had been trained yet, so nothing was saved"
        elif fields:
            kept = f"the state was not saved ({', '.join(fields)} hold inf or NaN)"
        else:
            cleared = state.replace(nonfinite_step=jnp.full_like(state.nonfinite_step, -1))
            position = checkpoint.DataPosition(epoch, index)
            checkpoint.save(self.manager, cleared, position, force=True)
            checkpoint.finish(self.manager)
            kept = (
                f"the state from before it was saved as the checkpoint of step {bad} in "
                f"{checkpoint.checkpoint_dir(self.workdir)} (a rerun resumes at that batch), "
                "so no trained step is lost"
            )
        which = f"index {_few(indices)} (" if indices else ""
        return (
            f"The inputs of step {bad} (epoch {epoch}, batch {index} of the epoch) are not "
            f"finite: the examples with {which}positions {_few(positions)} of the global "
            f"batch{')' if indices else ''} hold NaN or Inf, so the loss was not finite. "
            f"Training stopped without applying that step; {kept}. Fix or leave out those "
            "examples (in batches= or data.*) and rerun the same command to resume."
        )


def _few(values: list[int], most: int = 10) -> str:
    shown = ", ".join(str(v) for v in values[:most])
    return shown + (f" and {len(values) - most} more" if len(values) > most else "")
