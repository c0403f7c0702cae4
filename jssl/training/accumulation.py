"""Exact gradient accumulation: the method's loss over the whole batch, its memory per
micro-batch (``optim.accumulation_steps``).

Averaging micro-batch losses changes a method whose loss couples the examples of a batch (its
negatives, DINO's centre, SwAV's Sinkhorn, Barlow Twins' and VICReg's statistics would see a
fraction of it). This composes the method's forward and objective the other way round, as the
"gradient cache" does (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under
Memory Limited Setup"): every micro-batch is embedded keeping no activations (``lax.map``); the
objective runs once on the whole batch's embeddings and gives the loss and its gradient with
respect to them (and to the parameters it applies itself, DINO's last layer); then each
micro-batch is forwarded again and back-propagated with its slice of that gradient
(``lax.scan``). Loss, metrics, the ``after_update`` carry and gradient are one pass's; the cost
is one extra forward. Batch norm in train mode normalises each micro-batch on its own. More:
docs/operations.md, "Batches larger than the devices hold".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jssl import methods
from jssl.methods import LossOutput, Method


def check_config(config) -> None:
    """Each device's share of data.batch_size must split into optim.accumulation_steps."""
    steps = config.optim.get("accumulation_steps", 1)
    per_device = config.data.batch_size // jax.device_count()
    if steps < 1 or per_device % steps:
        raise ValueError(
            f"optim.accumulation_steps={steps} must be >= 1 and divide each device's share of "
            f"data.batch_size ({config.data.batch_size} over {jax.device_count()} devices: "
            f"{per_device} examples); pick a divisor of {per_device}."
        )


def value_and_grad(
    method: Method, params: Any, state: Any, batch: dict, rng: jax.Array, steps: int
) -> tuple[tuple[jax.Array, LossOutput], Any]:
    """``((loss, LossOutput), grads)`` of ``methods.loss(method, params, ...)`` over ``batch``
    (this replica's examples), computed over ``steps`` micro-batches of its rows in order.

    The new batch statistics and the forward's carry (a teacher's statistics) are the mean of
    the micro-batches'. Per-example draws (drop path, masks) are keyed by the example's index
    (``jssl.methods.common.example_keys``), so they are the same in any micro-batch."""
    n = batch["crops"][0].shape[0]
    if n % steps:
        raise ValueError(
            f"The local batch of {n} examples does not split into "
            f"optim.accumulation_steps={steps} equal micro-batches."
        )
    micro = jax.tree.map(lambda x: _split(x, steps), batch)

    def embed(micro_batch):
        out = method.forward(params, state, micro_batch, rng, True)
        methods.check_forward(method, out, n // steps)
        return out

    forwards = jax.lax.map(embed, micro)  # every leaf (steps, ...)
    embeddings = jax.tree.map(_join_crops, forwards.embeddings)

    def objective(embeddings, params):
        return methods.objective_loss(method, embeddings, state.replace(params=params), batch, True)

    (value, weighted), (cotangent, objective_grads) = jax.value_and_grad(
        objective, argnums=(0, 1), has_aux=True
    )(embeddings, params)
    # The objective's loss value and metrics before the first micro-batch: nothing below needs
    # them, and XLA computed DINO's cross-entropy after the backward passes, keeping its
    # (crops, n, 65536) logits alive through them (benchmarks/memory.py: 16% of the step's
    # temporaries on ViT-L/16).
    value, weighted, cotangent, objective_grads = jax.lax.optimization_barrier(
        (value, weighted, cotangent, objective_grads)
    )
    micro_cotangents = jax.tree.map(lambda g: _split_crops(g, steps), cotangent)

    def backward(grads, xs):
        micro_batch, micro_cotangent = xs

        def embeddings_of(params):
            return method.forward(params, state, micro_batch, rng, True).embeddings

        _, pullback = jax.vjp(embeddings_of, params)
        (micro_grads,) = pullback(micro_cotangent)
        return jax.tree.map(jnp.add, grads, micro_grads), None

    grads, _ = jax.lax.scan(backward, objective_grads, (micro, micro_cotangents))

    mean = lambda tree: jax.tree.map(lambda x: jnp.mean(x, axis=0), tree)  # noqa: E731
    out = weighted._replace(
        batch_stats=mean(forwards.batch_stats),
        features=_join_rows(forwards.features),
        embeddings=None if forwards.head is None else _join_rows(forwards.head),
        carry=methods.merged_carry(
            method, None if forwards.carry is None else mean(forwards.carry), weighted.carry
        ),
    )
    return (value, out), grads


def _split(x: jax.Array, steps: int) -> jax.Array:
    """(n, ...) -> (steps, n / steps, ...): micro-batch j holds rows j*m .. (j+1)*m - 1."""
    return x.reshape(steps, x.shape[0] // steps, *x.shape[1:])


def _join_rows(x: jax.Array) -> jax.Array:
    """(steps, m, ...) -> (steps * m, ...), the rows back in the batch's order."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _join_crops(x: jax.Array) -> jax.Array:
    """(steps, crops, m, ...) -> (crops, steps * m, ...): the contract's embeddings layout."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _split_crops(x: jax.Array, steps: int) -> jax.Array:
    """(crops, n, ...) -> (steps, crops, n / steps, ...), the inverse of ``_join_crops``."""
    x = x.reshape(x.shape[0], steps, x.shape[1] // steps, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)
