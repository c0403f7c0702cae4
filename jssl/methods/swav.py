"""SwAV (Caron et al. 2020, "Unsupervised Learning of Visual Features by Contrasting Cluster
Assignments"), as VISSL trains it (configs/config/pretrain/swav/swav_8node_resnet.yaml,
vissl/losses/swav_loss.py, vissl/hooks/swav_hooks.py, vissl/models/heads/swav_prototypes_head.py).

Per step: every crop (crop groups, e.g. 2x224 + 6x96) goes through the online network, one
trunk pass per resolution; the L2-normalised embeddings are scored against each set of unit
prototypes. The codes of the ``crops_for_assign`` crops come from Sinkhorn-Knopp over the
global batch (``jssl.losses.sinkhorn_knopp``), and every other crop predicts them; one term per
assignment crop (:func:`terms`). After the optimizer step the prototypes are normalised again
(VISSL's NormalizePrototypesHook); for ``freeze_prototypes_iters`` steps they are held fixed.
The optional queue (``queue_length``) holds the assignment crops' embeddings of earlier global
batches, one replicated FIFO of which each device feeds Sinkhorn its slice.

Recipes and deliberate differences: docs/methods.md#swav.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jssl import losses, models, parallel
from jssl.methods import Forward, Method, Objective, common
from jssl.models.resnet import torch_linear_kernel_init
from jssl.parallel import DATA_AXIS


def terms(config: ml_collections.ConfigDict) -> tuple[common.LossTerm, ...]:
    """One term per assignment crop: ``swapped_prediction_crop<a>`` for each ``a`` of
    ``method.crops_for_assign``, the swapped loss whose targets are crop ``a``'s codes (VISSL
    swav_loss.py: the ``loss`` of one ``crop_id``, averaged over the predicting crops and the
    prototype sets), each weighing 1 / len(crops_for_assign) by default: their sum is SwAV's
    loss, the mean over assignment crops. ``loss.weights.swapped_prediction`` scales them all."""
    return common.crop_terms("swapped_prediction", config.method.crops_for_assign)


class Prototypes(nn.Module):
    """One bias-free linear layer per prototype set (VISSL SwAVPrototypesHead
    ``prototypes{i}``); kernels are (embedding dim, K), a prototype per column."""

    num_prototypes: tuple[int, ...]

    @nn.compact
    def __call__(self, z: jax.Array) -> list[jax.Array]:
        return [
            nn.Dense(
                k, use_bias=False, kernel_init=torch_linear_kernel_init, name=f"prototypes{i}"
            )(z)
            for i, k in enumerate(self.num_prototypes)
        ]


def entropy_fractions(probs: jax.Array, axis_name: str | None = None) -> tuple:
    """``(mean entropy of a row, entropy of the mean row)`` of the distributions ``probs``
    (..., K) over the rows of every replica, each over log K: SwAV's collapse statistics of
    its predicted assignments. Both are 1 for uniform predictions (the embeddings all alike),
    and the second is 0 when every image goes to the same prototype."""
    probs = jnp.asarray(probs, jnp.float32).reshape(-1, probs.shape[-1])

    def entropy(p):
        return -jnp.sum(p * jnp.log(jnp.maximum(p, 1e-30)), axis=-1)

    rows = jnp.asarray(probs.shape[0], jnp.float32)
    total, per_row = jnp.sum(probs, axis=0), jnp.sum(entropy(probs))
    if axis_name is not None:
        total, per_row, rows = jax.lax.psum((total, per_row, rows), axis_name)
    log_k = np.log(probs.shape[-1])
    return per_row / rows / log_k, entropy(total / rows) / log_k


def normalize_prototypes(prototypes: Any) -> Any:
    """Each prototype (a kernel column) scaled to unit L2 norm."""
    return jax.tree.map(lambda w: losses.l2_normalize(w, axis=0), prototypes)


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    mcfg = config.method
    model = models.build_model(
        config.model, bn_axis_name=DATA_AXIS if config.model.sync_bn else None
    )
    num_prototypes = tuple(int(k) for k in mcfg.num_prototypes)
    prototypes = Prototypes(num_prototypes)
    embedding_dim = config.model.head_dims[-1]
    assign = tuple(int(c) for c in mcfg.crops_for_assign)
    queue_length = int(mcfg.queue_length)
    # Without the epoch length (evaluation engines) the queue is never used: eval mode.
    queue_start = int(round(mcfg.queue_start_epoch * steps_per_epoch)) if steps_per_epoch else 0
    normalize = mcfg.normalize_prototypes
    term_specs = terms(config)

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        model_rng, proto_rng = jax.random.split(rng)
        variables = model.init(model_rng, images, train=False)
        proto = prototypes.init(proto_rng, jnp.zeros((1, embedding_dim)))["params"]
        if normalize:
            proto = normalize_prototypes(proto)
        method_state = {}
        if queue_length:
            method_state = {
                "queue": jnp.zeros((len(assign), queue_length, embedding_dim), jnp.float32),
                "queue_ptr": jnp.zeros((), jnp.int32),
                "queue_filled": jnp.zeros((), jnp.int32),  # rows holding real embeddings
            }
        return dict(
            params={**variables["params"], "prototypes": proto},
            batch_stats=variables.get("batch_stats", {}),
            method_state=method_state,
        )

    def local_queue(state) -> jax.Array:
        """This device's slice of the replicated queue: (len(assign), L / devices, d)."""
        queue = state.method_state["queue"]
        size = queue.shape[1] // jax.lax.psum(1, DATA_AXIS)
        start = jax.lax.axis_index(DATA_AXIS) * size
        return jax.lax.dynamic_slice_in_dim(queue, start, size, axis=1)

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        count = common.num_crops(batch)
        model_params = {k: v for k, v in params.items() if k != "prototypes"}
        out, batch_stats = common.forward_crops(
            model, model_params, state.batch_stats, batch["crops"], train, rng, batch.get("index")
        )
        z = losses.l2_normalize(out["head"].astype(jnp.float32))  # (C * n, d), crop-major
        scores = prototypes.apply({"params": params["prototypes"]}, z)
        n = z.shape[0] // count
        return Forward(
            embeddings={
                "scores": tuple(common.split_crops(s, count) for s in scores),  # (C, n, K)
                # What the queue receives: the assignment crops' embeddings, no gradient.
                "assigned": jax.lax.stop_gradient(
                    jnp.stack([z[c * n : (c + 1) * n] for c in assign])
                ),
            },
            features=out["avgpool"][:n],
            batch_stats=batch_stats,
            head=z[:n],
        )

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        scores = embeddings["scores"]
        use_queue = train and queue_length > 0
        if use_queue:
            queued = jax.lax.stop_gradient(local_queue(state))
            on = (state.step >= queue_start) & (state.method_state["queue_filled"] >= queue_length)
            # The state's prototypes are the parameters' values; the queue's scores take no
            # gradient either way.
            queue_scores = prototypes.apply(
                {"params": jax.lax.stop_gradient(state.params["prototypes"])}, queued
            )
        hard = (state.step < mcfg.hard_assignment_iters) if train else False
        per_crop, metrics = 0.0, {}
        for i, set_scores in enumerate(scores):
            if i:  # one prototype set's Sinkhorn loops after the other's (parallel.after)
                set_scores = parallel.after(set_scores, per_crop)
            set_per_crop, set_metrics = losses.swav_crop_losses(
                set_scores,
                crops_for_assign=assign,
                temperature=mcfg.temperature,
                epsilon=mcfg.epsilon,
                num_iters=mcfg.sinkhorn_iterations,
                queue_scores=queue_scores[i] if use_queue else None,
                use_queue=on if use_queue else False,
                axis_name=DATA_AXIS,
                hard_assignment=hard,
                use_double_precision=mcfg.use_double_precision,
            )
            per_crop = per_crop + set_per_crop.astype(jnp.float32)  # (A, n)
            suffix = "" if len(scores) == 1 else str(i)
            metrics.update({f"{k}{suffix}": v for k, v in set_metrics.items()})
            # The collapse monitor's (jssl.training.collapse), of the assignment crops.
            predicted = jax.nn.softmax(set_scores[np.array(assign)] / mcfg.temperature)
            entropy, mean_entropy = entropy_fractions(predicted, DATA_AXIS)
            metrics[f"collapse/assignment{suffix}_entropy"] = entropy
            metrics[f"collapse/assignment{suffix}_mean_entropy"] = mean_entropy
        carry = None
        if use_queue:
            metrics["queue_on"] = on.astype(jnp.float32)
            # Every replica enqueues the assignment crops of the global batch: (A, N, d).
            new = parallel.after(embeddings["assigned"], per_crop)  # after the Sinkhorn loops
            carry = {"queue": jax.lax.all_gather(new, DATA_AXIS, axis=1, tiled=True)}
        # Each assignment crop's loss, averaged over the prototype sets (VISSL SwAVLoss.forward).
        per_crop = per_crop / len(scores)
        crop_terms = {term.name: per_crop[a] for a, term in enumerate(term_specs)}
        return Objective(terms=crop_terms, metrics=metrics, carry=carry)

    def after_update(state, carry):
        params = state.params
        if normalize:
            params = dict(params, prototypes=normalize_prototypes(params["prototypes"]))
        method_state = state.method_state
        if carry is not None:
            queue, ptr = method_state["queue"], method_state["queue_ptr"]
            new = carry["queue"]  # (A, global batch, d)
            # queue_length % global batch == 0 is checked at start-up: no write wraps.
            queue = jax.lax.dynamic_update_slice(queue, new.astype(queue.dtype), (0, ptr, 0))
            method_state = {
                "queue": queue,
                "queue_ptr": (ptr + new.shape[1]) % queue.shape[1],
                "queue_filled": jnp.minimum(
                    method_state["queue_filled"] + new.shape[1], queue.shape[1]
                ),
            }
        return state.replace(params=params, method_state=method_state)

    frozen = (("prototypes", int(mcfg.freeze_prototypes_iters)),)
    return Method(
        init=init,
        forward=forward,
        objective=objective,
        after_update=after_update,
        model=model,
        frozen_params=frozen if mcfg.freeze_prototypes_iters > 0 else (),
    )


def check_config(config: ml_collections.ConfigDict) -> None:
    """Start-up checks that would otherwise fail deep inside the step (or silently)."""
    from jssl import data

    mcfg = config.method
    total = data.total_crops(config.data)
    assign = tuple(mcfg.crops_for_assign)
    if total < 2:
        raise ValueError(
            f"data.augment.num_crops={tuple(config.data.augment.num_crops)}: SwAV predicts the "
            "codes of one crop from the others, so it needs at least two crops per image."
        )
    if not assign or any(not 0 <= int(c) < total for c in assign) or len(set(assign)) < len(assign):
        raise ValueError(
            f"method.crops_for_assign={assign} must name distinct crop indices in [0, {total}) "
            f"(there are {total} crops, data.augment.num_crops="
            f"{tuple(config.data.augment.num_crops)}); SwAV assigns from the two large crops, "
            "--config.method.crops_for_assign='(0, 1)'."
        )
    if not tuple(mcfg.num_prototypes) or any(int(k) < 1 for k in mcfg.num_prototypes):
        raise ValueError(
            f"method.num_prototypes={tuple(mcfg.num_prototypes)} must list one or more positive "
            "prototype counts (SwAV on ImageNet: (3000,))."
        )
    for field in ("temperature", "epsilon"):
        if mcfg[field] <= 0:
            raise ValueError(f"method.{field}={mcfg[field]} must be positive.")
    if mcfg.sinkhorn_iterations < 1:
        raise ValueError(
            f"method.sinkhorn_iterations={mcfg.sinkhorn_iterations} must be >= 1 (SwAV: 3)."
        )
    queue, batch = mcfg.queue_length, config.data.batch_size
    if queue < 0 or (queue and queue % batch):
        raise ValueError(
            f"method.queue_length={queue} must be 0 (no queue) or a multiple of "
            f"data.batch_size={batch} (whole global batches are enqueued), e.g. "
            f"--config.method.queue_length={max(1, round(queue / batch)) * batch}."
        )
    if mcfg.use_double_precision and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            "method.use_double_precision=True needs float64 in JAX: launch with "
            "JAX_ENABLE_X64=1, or keep it False (the log-domain Sinkhorn does not underflow "
            "in float32)."
        )
