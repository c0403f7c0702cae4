"""Pure loss functions of the SSL methods. No model code: inputs are embeddings."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def l2_normalize(x: jax.Array, axis: int = -1, eps: float = 1e-12) -> jax.Array:
    """x / max(||x||, eps), as torch.nn.functional.normalize (the references use it)."""
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True))
    return x / jnp.maximum(norm, eps)


def info_nce_with_queue(
    query: jax.Array, key: jax.Array, queue: jax.Array, temperature: float
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
    """MoCo's InfoNCE loss (He et al. 2020, Eq. 1; VISSL vissl/losses/moco_loss.py).

    Args:
      query: (n, d) online-encoder embeddings (normalised here).
      key: (n, d) momentum-encoder embeddings of the other view, the positives (normalised
        here; the caller stops their gradient).
      queue: (K, d) L2-normalised keys of earlier batches, the negatives.
      temperature: logits are divided by it.

    Returns:
      The mean cross-entropy of classifying the positive (index 0) among 1 + K logits,
      per-batch diagnostics (accuracy of that classification, mean positive/negative
      cosine similarity), and the (n,) per-example losses.
    """
    query = l2_normalize(query.astype(jnp.float32))
    key = l2_normalize(key.astype(jnp.float32))
    pos = jnp.sum(query * key, axis=-1, keepdims=True)  # (n, 1)
    neg = query @ queue.astype(jnp.float32).T  # (n, K)
    logits = jnp.concatenate([pos, neg], axis=1) / temperature
    per_example = jax.nn.logsumexp(logits, axis=1) - logits[:, 0]
    metrics = {
        "contrastive_acc": jnp.mean((jnp.argmax(logits, axis=1) == 0).astype(jnp.float32)),
        "pos_similarity": jnp.mean(pos),
        "neg_similarity": jnp.mean(neg),
    }
    return jnp.mean(per_example), metrics, per_example
