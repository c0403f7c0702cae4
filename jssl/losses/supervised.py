"""Supervised: cross-entropy with label smoothing and a temperature, summed over several outputs
(VISSL's ``cross_entropy_multiple_output_single_target``), and top-k hits (VISSL's accuracy
meter)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from jssl.losses._util import l2_normalize


def cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    label_smoothing: float = 0.0,
    temperature: float = 1.0,
    normalize_output: bool = False,
) -> jax.Array:
    """Per-example cross-entropy of integer ``labels`` under ``logits`` (n, K), (n,).

    VISSL's ``CrossEntropyMultipleOutputSingleTargetCriterion`` for one output
    (vissl/losses/cross_entropy_multiple_output_single_target.py): the output is L2-normalised
    per row if ``normalize_output``, then divided by ``temperature``; with ``label_smoothing``
    s the target is ``(1 - s) * one_hot + s / K`` (its ``apply_label_smoothing``) and the loss
    ``-sum(target * log_softmax(logits))``; s = 0 is the plain cross-entropy.
    """
    logits = logits.astype(jnp.float32)
    if normalize_output:
        logits = l2_normalize(logits)
    log_probs = jax.nn.log_softmax(logits / temperature, axis=-1)
    num_classes = logits.shape[-1]
    targets = (1.0 - label_smoothing) * jax.nn.one_hot(labels, num_classes) + (
        label_smoothing / num_classes
    )
    return -jnp.sum(targets * log_probs, axis=-1)


def multi_output_cross_entropy(
    outputs: Mapping[str, jax.Array] | Sequence[jax.Array],
    labels: jax.Array,
    label_smoothing: float = 0.0,
    temperature: float = 1.0,
    normalize_output: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """VISSL's ``cross_entropy_multiple_output_single_target``: every output (a head's logits,
    e.g. linear classifiers on several feature taps) against the same ``labels``, each with
    :func:`cross_entropy`, the loss their SUM (VISSL ``loss += self._losses[i](pred / T,
    target)``; not a mean, so each output trains as if it were alone where they share no
    parameters).

    ``outputs``: ``{name: (n, K_name)}`` (or a list, named "0", "1", ...; the output sizes may
    differ). Returns ``(loss, {name: (n,) per-example cross-entropy})``: the loss is the sum over
    outputs of their mean over the local examples.
    """
    if not isinstance(outputs, Mapping):
        outputs = {str(i): logits for i, logits in enumerate(outputs)}
    if not outputs:
        raise ValueError("multi_output_cross_entropy needs at least one output.")
    per_output = {
        name: cross_entropy(logits, labels, label_smoothing, temperature, normalize_output)
        for name, logits in outputs.items()
    }
    return sum(jnp.mean(ce) for ce in per_output.values()), per_output


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
