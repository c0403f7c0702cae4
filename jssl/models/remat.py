"""Rematerialisation of trunk blocks (``model.remat``): a block's activations are recomputed
in the backward pass instead of kept from the forward, trading compute for memory as VISSL's
activation checkpointing and big_vision's ``nn.remat`` do. The parameters, their names and the
results are unchanged (checkpoints of either setting load into the other).

Policies: ``none``; ``full`` keeps only each block's input; ``dots`` also keeps the outputs of
its matrix multiplications (a ViT's attention and MLP projections), so the backward pass
recomputes only the cheap elementwise work between them.

A rematerialised block's backward pass also hands its parameters' gradients and its input's
gradient on together (an optimisation barrier over both), so each block's weight gradients
are computed before the backward pass moves to the block below. Without it XLA's GPU
scheduler, overlapping the asynchronous gradient all-reduce with the backward pass, defers the
weight-gradient products and keeps every block's recomputed activations and activation
gradients alive until then. DINO ViT-L/16 at batch 1024 on 8 H100s (``benchmarks/memory.py
--compiler h100``, compiled ahead of time): temporaries per device 128 GiB without remat; with
``full``, 81.5 GiB without the barrier and 10.8 GiB with it.
"""

from __future__ import annotations

import flax.linen as nn
import jax

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
    return _tied(nn.remat(block, policy=POLICIES[remat], static_argnums=static_argnums))


def _tied(block: type[nn.Module]) -> type[nn.Module]:
    """``block`` whose backward pass returns its parameters' and its input's gradients through
    one optimisation barrier (the module docstring says why). Same parameters, outputs and
    gradients; the other arguments (flags, drop-path keys) are not differentiated."""

    class Tied(block):
        def __call__(self, x, *args, **kwargs):
            def apply(module, x):
                return block.__call__(module, x, *args, **kwargs)

            def forward(module, x):
                return nn.vjp(apply, module, x)  # (output, its vjp as the residual)

            def backward(vjp_fn, cotangent):
                return jax.lax.optimization_barrier(vjp_fn(cotangent))

            return nn.custom_vjp(apply, forward, backward)(self, x)

    Tied.__name__ = Tied.__qualname__ = block.__name__
    return Tied
