"""Rematerialisation of trunk blocks (``model.remat``): a block's activations are recomputed
in the backward pass instead of kept from the forward, trading compute for memory as VISSL's
activation checkpointing and big_vision's ``nn.remat`` do. The parameters, their names and the
results are unchanged (checkpoints of either setting load into the other). Policies: ``none``;
``full`` keeps only each block's input; ``dots`` also keeps its matmul outputs.

A recomputed block without batch norm (a ViT's) hands its weight gradients on together with
its input's gradient (one optimisation barrier, :func:`_tied`), so XLA's GPU scheduler cannot
defer the weight-gradient products and keep every block's activations alive meanwhile; blocks
with train-mode batch norm go without it. With a split state a block gathers its own
parameters inside the recomputed region (:func:`gathering`), and its gradient comes back
reduce-scattered; the step finds the leaves that reach a block unchanged by tracing the
method's loss once (:func:`recording`). Measurements and the whole story:
docs/operations.md#batches-larger-than-the-devices-hold.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
from flax import traverse_util

POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
}


def check(remat: str) -> None:
    if remat not in POLICIES:
        raise ValueError(
            f"model.remat={remat!r}: use one of {', '.join(POLICIES)} (e.g. "
            "--config.model.remat=full to recompute each block in the backward pass)."
        )


def wrap(block: type[nn.Module], remat: str, static_argnums: tuple[int, ...] = ()):
    """``block`` itself for "none", else its rematerialised version under the policy.
    ``static_argnums`` count ``self`` as 0 (a ViT block's ``train`` flag is 2)."""
    check(remat)
    if remat == "none":
        return block
    # The gather of a split state's leaves (_gather_in) inside the recomputed region; an
    # identity unless the step asks for it (gathering).
    # (mutable: flax's map_variables initialises a block with batch norm this way only.)
    own = nn.map_variables(block, "params", trans_in_fn=_gather_in, mutable=True)
    return _tied(nn.remat(own, policy=POLICIES[remat], static_argnums=static_argnums))


@dataclasses.dataclass
class _Recorder:
    """What the blocks saw while the step traced the method's loss once: per block leaf
    (the block's scope path, the leaf's path in it), the state's leaves that reached it
    unchanged (``ids``: ``id`` of a state leaf -> its key) and the shapes it had."""

    ids: dict[int, Any]
    seen: dict[tuple, list] = dataclasses.field(default_factory=dict)

    def leaves(self) -> set:
        """Keys of the state's leaves that reach blocks unchanged, at block leaves of one shape
        (two shapes at one block path: none of its leaves is left to the block). A block's
        parameters feed that block alone; a split one read elsewhere too would arrive there
        split, and flax's shape check would stop the trace."""
        keys = set()
        for uses in self.seen.values():
            if len({shape for shape, _ in uses}) == 1:
                keys.update(key for _, key in uses if key is not None)
        return keys

    def shapes(self) -> dict[tuple, tuple]:
        return {k: uses[0][0] for k, uses in self.seen.items() if len({u[0] for u in uses}) == 1}


@dataclasses.dataclass
class _Plan:
    shapes: dict[tuple, tuple]  # (block path, leaf path) -> the whole leaf's shape
    axis: str


_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("jssl_remat_gather", default=None)
_DIMS: contextvars.ContextVar = contextvars.ContextVar("jssl_remat_gather_dims", default=None)


@contextlib.contextmanager
def recording(ids: dict[int, Any]) -> Iterator[_Recorder]:
    """While the step traces the method's loss on whole parameters: which of them (``ids``:
    ``id(leaf)`` -> a key of the caller's) reach a rematerialised block unchanged."""
    recorder = _Recorder(ids)
    token = _CONTEXT.set(recorder)
    try:
        yield recorder
    finally:
        _CONTEXT.reset(token)


@contextlib.contextmanager
def gathering(recorder: _Recorder, axis: str) -> Iterator[None]:
    """While the step traces its per-device body: a block whose leaves arrive as this
    device's part of the recorded whole shape gathers them over ``axis`` itself."""
    token = _CONTEXT.set(_Plan(recorder.shapes(), axis))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def _gather_dims(module: nn.Module) -> dict[tuple, int]:
    """The leaves (path in the block -> split dimension) that ``module`` must gather, and
    under :func:`recording` what it sees."""
    context = _CONTEXT.get()
    if context is None or module.is_initializing():
        return {}
    params = traverse_util.flatten_dict(dict(module.variables.get("params", {})))
    path = tuple(module.scope.path)
    if isinstance(context, _Recorder):
        for name, leaf in params.items():
            use = (tuple(leaf.shape), context.ids.get(id(leaf)))
            context.seen.setdefault((path, name), []).append(use)
        return {}
    dims = {}
    for name, leaf in params.items():
        whole = context.shapes.get((path, name))
        if whole is not None and tuple(leaf.shape) != whole:
            (dim,) = [d for d, (a, b) in enumerate(zip(leaf.shape, whole, strict=True)) if a != b]
            dims[name] = dim
    return dims


def _gather_in(variables: Any) -> Any:
    """map_variables' input transform: the leaves :func:`_gather_dims` named, whole."""
    dims = _DIMS.get()
    if not dims:
        return variables
    axis = _CONTEXT.get().axis
    flat = traverse_util.flatten_dict(dict(variables["params"]))
    for name, dim in dims.items():
        flat[name] = jax.lax.all_gather(flat[name], axis, axis=dim, tiled=True)
    return {**variables, "params": traverse_util.unflatten_dict(flat)}


def _tied(block: type[nn.Module]) -> type[nn.Module]:
    """``block`` whose backward pass returns its parameters' and its input's gradients through
    one optimisation barrier (the module docstring says why). Same parameters, outputs and
    gradients; the other arguments (flags, drop-path keys) are not differentiated."""

    class Tied(block):
        def __call__(self, x, *args, **kwargs):
            dims = _gather_dims(self)

            def apply(module, x):
                token = _DIMS.set(dims)
                try:
                    return block.__call__(module, x, *args, **kwargs)
                finally:
                    _DIMS.reset(token)

            def forward(module, x):
                return nn.vjp(apply, module, x)  # (output, its vjp as the residual)

            def backward(vjp_fn, cotangent):
                return jax.lax.optimization_barrier(vjp_fn(cotangent))

            if self.is_mutable_collection("batch_stats") and "batch_stats" in self.variables:
                # Batch norm in train mode: flax's custom_vjp would close over the running
                # statistics, which a second call of the trunk in one loss (SimSiam's views,
                # one after the other) passes in as tracers of the first: JAX rejects the
                # leak. Such a block (ResNet, RegNet) is recomputed without the barrier.
                return apply(self, x)
            return nn.custom_vjp(apply, forward, backward)(self, x)

    Tied.__name__ = Tied.__qualname__ = block.__name__
    return Tied
