"""The online linear probe: a linear classifier on stop-gradient trunk features, trained in
the same compiled step as the SSL method with its own optimizer, so a run shows
representation quality while it pre-trains (BYOL, Grill et al. 2020, App. C; solo-learn's
online classifier). Its gradients never reach the trunk.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from jssl.data import sources


def enabled(config: ml_collections.ConfigDict) -> bool:
    return config.probe.num_classes > 0


def optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    # Adam rather than solo-learn's SGD: its step does not depend on the scale of the trunk's
    # features, which differs between trunks, widths and training stages (measured: SGD at
    # lr 0.1 oscillated at chance on the demo's unnormalised 128-d avgpool features).
    p = config.probe
    return optax.adamw(p.learning_rate, weight_decay=p.weight_decay)


def init(config: ml_collections.ConfigDict, feature_dim: int) -> dict[str, Any]:
    """Zero-initialised weights (a linear model needs no symmetry breaking) and their
    optimizer state; {} when the probe is off."""
    if not enabled(config):
        return {}
    params = {
        "kernel": jnp.zeros((feature_dim, config.probe.num_classes), jnp.float32),
        "bias": jnp.zeros((config.probe.num_classes,), jnp.float32),
    }
    return {"params": params, "opt_state": optimizer(config).init(params)}


def logits(params: dict, features: jax.Array) -> jax.Array:
    return features.astype(jnp.float32) @ params["kernel"] + params["bias"]


def update(
    config: ml_collections.ConfigDict,
    probe: dict,
    features: jax.Array,
    labels: jax.Array,
    axis_name: str,
) -> tuple[dict, dict[str, jax.Array]]:
    """One probe step on this replica's features; gradients averaged over ``axis_name``, the
    metrics this replica's (the train step averages them with its own)."""
    features = jax.lax.stop_gradient(features.reshape(features.shape[0], -1))

    def loss_fn(params):
        out = logits(params, features)
        loss = optax.softmax_cross_entropy_with_integer_labels(out, labels).mean()
        return loss, out

    (loss, out), grads = jax.value_and_grad(loss_fn, has_aux=True)(probe["params"])
    grads = jax.lax.pmean(grads, axis_name)
    updates, opt_state = optimizer(config).update(grads, probe["opt_state"], probe["params"])
    metrics = {
        "probe/loss": loss,
        "probe/train_top1": jnp.mean((jnp.argmax(out, -1) == labels).astype(jnp.float32)) * 100,
    }
    new = {"params": optax.apply_updates(probe["params"], updates), "opt_state": opt_state}
    return new, metrics


def accuracy(params: dict, features: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Top-1/top-5 (%) of the probe on already extracted features (host side)."""
    scores = features.reshape(len(features), -1) @ np.asarray(params["kernel"])
    scores = scores + np.asarray(params["bias"])
    top = np.argsort(-scores, axis=1)[:, :5]
    return {
        "top1": float(np.mean(top[:, 0] == labels) * 100),
        "top5": float(np.mean(np.any(top == labels[:, None], axis=1)) * 100),
    }


def check_num_classes(config: ml_collections.ConfigDict) -> None:
    """The online probe's classifier must cover every label of the training data; a label
    past ``probe.num_classes`` would make its loss NaN from the first step."""
    if not enabled(config):
        return
    found = dataset_num_classes(config.data, config.data.train_split)
    if found is not None and found > config.probe.num_classes:
        raise ValueError(
            f"The train split has {found} classes but probe.num_classes="
            f"{config.probe.num_classes}: set --config.probe.num_classes={found} (or 0 to turn "
            "the online probe off)."
        )


def dataset_num_classes(data_config: ml_collections.ConfigDict, split: str) -> int | None:
    """Classes of the split's labels: TFDS metadata, an image folder's class folders, or the
    demo set's (None where the source does not say)."""
    return sources.resolve_split(data_config, split).num_classes
