"""MoCo v2 (He et al. 2020, "Momentum Contrast for Unsupervised Visual Representation
Learning"; Chen et al. 2020, "Improved Baselines ..."), as in VISSL's MoCo hook and
vissl/losses/moco_loss.py.

Per step: the query encoder embeds view 1; the momentum (key) encoder, an EMA of the query
encoder, embeds view 2 (shuffle-BN across devices with per-device BN); InfoNCE against a
queue of earlier keys; the keys of the whole global batch are enqueued. The EMA runs after
the optimizer update of step t and so equals MoCo's update at the start of step t+1 (both are
m * key + (1 - m) * query_after_step_t). The initial queue is random unit vectors, as VISSL's.
Recipe and deliberate differences: docs/methods.md#moco-v2.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jssl import losses, models
from jssl.methods import Forward, Method, Objective, common
from jssl.parallel import DATA_AXIS

TERMS = ("info_nce",)


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    mcfg = config.method
    sync_bn = config.model.sync_bn
    model = models.build_model(config.model, bn_axis_name=DATA_AXIS if sync_bn else None)
    embedding_dim = config.model.head_dims[-1]
    shuffle_bn = mcfg.shuffle_bn and not sync_bn

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        params_rng, queue_rng = jax.random.split(rng)
        variables = model.init(params_rng, images, train=False)
        queue = losses.l2_normalize(
            jax.random.normal(queue_rng, (mcfg.queue_size, embedding_dim), jnp.float32)
        )
        return dict(
            params=variables["params"],
            batch_stats=variables.get("batch_stats", {}),
            # The key encoder starts as a copy of the query encoder (MoCo Alg. 1).
            ema_params=jax.tree.map(jnp.copy, variables["params"]),
            ema_batch_stats=jax.tree.map(jnp.copy, variables.get("batch_stats", {})),
            method_state={"queue": queue, "queue_ptr": jnp.zeros((), jnp.int32)},
        )

    key_model = common.without_drop_path(model)  # the momentum encoder: no stochastic depth

    def key_embeddings(state, images, rng, train):
        if train and shuffle_bn:
            images, unshuffle = _shuffle_across_devices(images, rng)
        out, ema_batch_stats = common.apply_model(
            key_model, state.ema_params, state.ema_batch_stats, images, train
        )
        keys = out["head"]
        if train and shuffle_bn:
            keys = unshuffle(keys)
        return keys, ema_batch_stats

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        view_q, view_k = common.views(batch)
        drop_keys = common.view_drop_keys(model, rng, batch, 0, train)
        out, batch_stats = common.apply_model(
            model, params, state.batch_stats, view_q, train, drop_keys
        )
        keys, ema_batch_stats = key_embeddings(state, view_k, rng, train)
        keys = jax.lax.stop_gradient(losses.l2_normalize(keys.astype(jnp.float32)))
        return Forward(
            embeddings={"query": out["head"][None], "key": keys[None]},
            features=out["avgpool"],
            batch_stats=batch_stats,
            head=out["head"],
            carry={"ema_batch_stats": common.mean_over_devices(ema_batch_stats)},
        )

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        keys = embeddings["key"][0]
        _, metrics, info_nce = losses.info_nce_with_queue(
            embeddings["query"][0], keys, state.method_state["queue"], mcfg.temperature
        )
        return Objective(
            terms={"info_nce": info_nce},
            metrics=metrics,
            # The queue is shared, so every replica enqueues the keys of the global batch.
            carry={"keys": jax.lax.all_gather(keys, DATA_AXIS, tiled=True)},
        )

    def after_update(state, carry):
        queue, ptr = state.method_state["queue"], state.method_state["queue_ptr"]
        keys = carry["keys"]
        # queue_size % global batch == 0 is checked at start-up, so a write never wraps.
        queue = jax.lax.dynamic_update_slice(queue, keys.astype(queue.dtype), (ptr, 0))
        ptr = (ptr + keys.shape[0]) % queue.shape[0]
        return state.replace(
            ema_params=common.ema(state.params, state.ema_params, mcfg.momentum),
            ema_batch_stats=carry["ema_batch_stats"],
            method_state={"queue": queue, "queue_ptr": ptr},
        )

    return Method(
        init=init, forward=forward, objective=objective, after_update=after_update, model=model
    )


def check_config(config: ml_collections.ConfigDict) -> None:
    """Start-up checks that would otherwise fail deep inside the step."""
    crops = tuple(config.data.augment.num_crops)
    if sum(crops) != 2:
        raise ValueError(
            f"data.augment.num_crops={crops}: MoCo takes two crops of each image (a query and "
            "a key); set --config.data.augment.num_crops=2 (one group of two crops)."
        )
    queue, batch = config.method.queue_size, config.data.batch_size
    if queue % batch:
        raise ValueError(
            f"method.queue_size={queue} must be a multiple of data.batch_size={batch} "
            "(MoCo enqueues whole global batches); change either with --config.method.queue_size "
            "or --config.data.batch_size."
        )


def _shuffle_across_devices(images: jax.Array, rng: jax.Array):
    """MoCo's shuffle-BN: the key encoder sees a random global permutation of the batch, so
    per-device batch-norm statistics of keys and queries come from different samples.

    Every replica draws the same permutation from the shared rng, gathers all images, runs
    its slice, and ``unshuffle`` restores the local keys' original order.
    """
    local = images.shape[0]
    index = jax.lax.axis_index(DATA_AXIS)
    everything = jax.lax.all_gather(images, DATA_AXIS, tiled=True)
    perm = jax.random.permutation(rng, everything.shape[0])
    mine = jax.lax.dynamic_slice_in_dim(everything[perm], index * local, local)

    def unshuffle(keys: jax.Array) -> jax.Array:
        gathered = jax.lax.all_gather(keys, DATA_AXIS, tiled=True)  # in permuted order
        restored = gathered[jnp.argsort(perm)]
        return jax.lax.dynamic_slice_in_dim(restored, index * local, local)

    return mine, unshuffle
