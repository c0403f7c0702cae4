"""Rematerialisation of trunk blocks (``model.remat``): a block's activations are recomputed
in the backward pass instead of kept from the forward, trading compute for memory as VISSL's
activation checkpointing and big_vision's ``nn.remat`` do. The parameters, their names and the
results are unchanged (checkpoints of either setting load into the other).

Policies: ``none``; ``full`` keeps only each block's input; ``dots`` also keeps the outputs of
its matrix multiplications (a ViT's attention and MLP projections), so the backward pass
recomputes only the cheap elementwise work between them.
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
    return nn.remat(block, policy=POLICIES[remat], static_argnums=static_argnums)
