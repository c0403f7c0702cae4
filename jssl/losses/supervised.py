"""Supervised: cross-entropy with label smoothing, and top-k hits (VISSL's accuracy meter)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def cross_entropy(logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0) -> jax.Array:
    """Per-example cross-entropy of integer ``labels`` under ``logits`` (n, K), (n,).

    VISSL's ``cross_entropy_multiple_output_single_target`` (SmoothCrossEntropy) with one
    output: with ``label_smoothing`` s the target is ``(1 - s) * one_hot + s / K`` and the loss
    ``-sum(target * log_softmax(logits))``; s = 0 is the plain cross-entropy.
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    num_classes = logits.shape[-1]
    targets = (1.0 - label_smoothing) * jax.nn.one_hot(labels, num_classes) + (
        label_smoothing / num_classes
    )
    return -jnp.sum(targets * log_probs, axis=-1)


def top_k_hits(
    logits: jax.Array, labels: jax.Array, ks: Sequence[int] = (1, 5)
) -> dict[int, jax.Array]:
    """``{k: (n,) float 1.0 where the label is among the k highest logits, else 0.0}``.

    VISSL's ``accuracy_list_meter`` (topk_values [1, 5]) counts these hits over the test set;
    per example, so that padding rows can be left out exactly. k above the number of classes
    counts every example (as top-5 of a 3-class problem would).
    """
    k_max = min(max(ks), logits.shape[-1])
    _, top = jax.lax.top_k(logits.astype(jnp.float32), k_max)
    match = top == labels[:, None]
    return {k: jnp.any(match[:, : min(k, k_max)], axis=-1).astype(jnp.float32) for k in ks}
