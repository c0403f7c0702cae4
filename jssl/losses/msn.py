"""MSN's loss (Assran et al. 2022, "Masked Siamese Networks for Label-Efficient Learning",
Sec. 3, Eq. 1-2; facebookresearch/msn ``src/losses.py`` ``init_msn_loss`` and
``distributed_sinkhorn``): anchors and targets are compared to learned prototypes by cosine
similarity, the targets' soft assignments are sharpened (and balanced by Sinkhorn), and the
anchors' assignments are pulled towards them by cross-entropy, with a mean-entropy
maximisation (me-max) regulariser over the anchors of the global batch.

Inputs are cosines (the forward L2-normalises projections and prototypes): ``(V, n, K)`` for the
V anchor views and ``(n, K)`` for the one target view of the n local images. A prototype's
probability is ``softmax(cos / temperature)`` mixed with the uniform by ``label_smoothing``
(the reference's ``@ proto_labels``, one-hot labels smoothed), for anchors and targets alike.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jssl.losses._util import _num_replicas, _psum
from jssl.losses.swav import sinkhorn_knopp


def msn_log_probabilities(
    cosines: jax.Array, temperature: float, label_smoothing: float = 0.0
) -> jax.Array:
    """``log((1 - s) * softmax(cos / T) + s / K)`` over the last axis (the reference's
    ``snn``: ``softmax(q @ p.T / tau) @ proto_labels`` with labels smoothed by s)."""
    log_p = jax.nn.log_softmax(cosines.astype(jnp.float32) / temperature, axis=-1)
    if label_smoothing:
        k = cosines.shape[-1]
        log_p = jnp.logaddexp(math.log1p(-label_smoothing) + log_p, math.log(label_smoothing / k))
    return log_p


def msn_targets(
    target_cosines: jax.Array,
    temperature: float,
    sharpen: float | jax.Array,
    *,
    label_smoothing: float = 0.0,
    use_sinkhorn: bool = True,
    sinkhorn_iterations: int = 3,
    axis_name: str | None = None,
) -> jax.Array:
    """The targets ``(n, K)``, without gradient: the target view's probabilities sharpened,
    ``p**(1 / sharpen)`` renormalised per row (the reference's ``sharpen``, T 0.25: with
    temperature 0.1 a softmax at 0.025), then with ``use_sinkhorn`` balanced over the prototypes
    of the GLOBAL batch by ``sinkhorn_iterations`` Sinkhorn-Knopp steps (``distributed_sinkhorn``:
    each prototype's mass over every device to 1/K, each sample's to 1/N, rows summing to 1).

    The Sinkhorn steps are :func:`jssl.losses.sinkhorn_knopp` on the log of the sharpened rows
    at epsilon 1, i.e. the reference's multiplicative iteration on those rows, in the log
    domain."""
    log_p = msn_log_probabilities(
        jax.lax.stop_gradient(target_cosines), temperature, label_smoothing
    )
    log_sharp = jax.nn.log_softmax(log_p / sharpen, axis=-1)
    if use_sinkhorn:
        return sinkhorn_knopp(log_sharp, 1.0, sinkhorn_iterations, axis_name)
    return jnp.exp(log_sharp)


def msn_terms(
    anchor_cosines: jax.Array,
    target_cosines: jax.Array,
    *,
    temperature: float = 0.1,
    sharpen: float | jax.Array = 0.25,
    label_smoothing: float = 0.0,
    use_sinkhorn: bool = True,
    sinkhorn_iterations: int = 3,
    axis_name: str | None = None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """MSN's terms, unweighted, per local image (the reference's ``loss``, ``rloss``,
    ``sloss``):

      cross_entropy  H(target, anchor) of each anchor view against its image's target,
                     averaged over the V views: (n,); its mean over images is the
                     reference's mean over all anchors
      me_max         log K - H(mean anchor probability over the V * N anchors of the global
                     batch): the negative entropy of the mean prediction, shifted to be >= 0
                     (the reference's ``- sum(log(avg ** -avg)) + log K``), broadcast to (n,)
      entropy        the anchors' own mean entropy, averaged over the views: (n,) (the
                     reference's ``use_entropy``; its recipes weigh it 0)

    The mean over the global batch is a ``psum`` over ``axis_name``, so the value and its
    gradient do not depend on the device count.

    Args:
      anchor_cosines: (V, n, K) cosines of the anchor views' projections to the prototypes.
      target_cosines: (n, K) cosines of the target view's (no gradient flows into them).
      temperature: the cosines' softmax temperature (the reference's ``tau``, 0.1).
      sharpen: the targets' sharpening exponent's inverse (``T``, 0.25); may be traced.
      label_smoothing, use_sinkhorn, sinkhorn_iterations, axis_name: see :func:`msn_targets`.

    Returns:
      ``(terms, metrics)``: the three terms above, and batch means to log: ``num_targets``
      (prototypes that are some image's most likely target over the global batch, the
      reference's ``np``), ``max_target`` (the mean largest target probability, ``max_t``),
      ``mean_anchor_entropy`` (the entropy of the mean anchor probability, log K at best).
    """
    if anchor_cosines.ndim != 3 or anchor_cosines.shape[1:] != target_cosines.shape:
        raise ValueError(
            f"msn_terms: anchors (V, n, K) and targets (n, K) must share n and K; got "
            f"{anchor_cosines.shape} and {target_cosines.shape}."
        )
    views, n, k = anchor_cosines.shape
    targets = msn_targets(
        target_cosines,
        temperature,
        sharpen,
        label_smoothing=label_smoothing,
        use_sinkhorn=use_sinkhorn,
        sinkhorn_iterations=sinkhorn_iterations,
        axis_name=axis_name,
    )
    log_p = msn_log_probabilities(anchor_cosines, temperature, label_smoothing)  # (V, n, K)
    p = jnp.exp(log_p)
    cross_entropy = -jnp.mean(jnp.sum(targets[None] * log_p, axis=-1), axis=0)
    entropy = -jnp.mean(jnp.sum(p * log_p, axis=-1), axis=0)
    count = views * n * _num_replicas(axis_name)
    mean_p = _psum(jnp.sum(p, axis=(0, 1)), axis_name) / count  # (K,), the global batch's
    mean_entropy = -jnp.sum(mean_p * jnp.log(jnp.maximum(mean_p, jnp.finfo(jnp.float32).tiny)))
    me_max = math.log(k) - mean_entropy
    chosen = jax.nn.one_hot(jnp.argmax(targets, axis=-1), k, dtype=jnp.float32)
    used = _psum(jnp.sum(chosen, axis=0), axis_name) > 0
    terms = {
        "cross_entropy": cross_entropy,
        "me_max": jnp.broadcast_to(me_max, (n,)),
        "entropy": entropy,
    }
    metrics = {
        "num_targets": jnp.sum(used.astype(jnp.float32)),
        "max_target": jnp.mean(jnp.max(targets, axis=-1)),
        "mean_anchor_entropy": jax.lax.stop_gradient(mean_entropy),
    }
    return terms, metrics
