"""DeepCluster-v2 (Caron et al. 2020, "Unsupervised Learning of Visual Features by Contrasting
Cluster Assignments", Sec. 4 and App. A), as VISSL trains it (vissl/losses/deepclusterv2_loss.py,
vissl/hooks/deepclusterv2_hooks.py, configs/config/pretrain/deepcluster_v2/) and as the SwAV
repository's main_deepclusterv2.py does.

Per step: every crop's normalised embedding is scored against each head's centroids and
trained with cross-entropy (``temperature``) to predict its example's cluster (one term,
``cluster_prediction``). A memory bank (``method_state["bank"]``) keeps the ``crops_for_mb``
embeddings of every training example by dataset index, its rows split over the devices
(``Method.split_state``). At each epoch's start spherical k-means (``jssl.losses.kmeans``)
re-clusters the rows written the epoch before, inside the jitted step, so centroids and
assignments live in the state; the first ``memory_fill_epochs`` only fill the bank.

Recipes, the first epoch and deliberate differences: docs/methods.md#deepcluster-v2.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jssl import data, losses, models, parallel
from jssl.methods import Forward, Method, Objective, common
from jssl.parallel import DATA_AXIS

TERMS = ("cluster_prediction",)
_CENTROID_STREAM = 0x6B6D  # folded into the state's key for k-means' initial centroids


def bank_size(config: ml_collections.ConfigDict) -> int:
    """Rows of the memory bank: ``method.num_examples``, or (0) the train split's examples
    after ``data.train_subset`` (VISSL ``num_train_samples``, auto-filled)."""
    given = int(config.method.num_examples)
    return given if given > 0 else data.num_examples(config.data, config.data.train_split)


def bank_rows(config: ml_collections.ConfigDict) -> int:
    """The bank array's rows: ``bank_size`` rounded up to whole global batches, which every
    device count divides (the rows past the dataset are never written nor clustered after
    epoch 0)."""
    batch = int(config.data.batch_size)
    return -(-bank_size(config) // batch) * batch


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    mcfg = config.method
    model = models.build_model(
        config.model, bn_axis_name=DATA_AXIS if config.model.sync_bn else None
    )
    num_clusters = tuple(int(k) for k in mcfg.num_clusters)
    crops_for_mb = tuple(int(c) for c in mcfg.crops_for_mb)
    num_banks, num_heads = len(crops_for_mb), len(num_clusters)
    embedding_dim = int(config.model.head_dims[-1])
    # Evaluation engines pass no epoch length and never train: no bank to size.
    num_rows = bank_rows(config) if steps_per_epoch else int(mcfg.num_examples)
    # The bank's rows as the devices hold them (jssl.training.state.partition_specs).
    shards = jax.device_count() if num_rows % jax.device_count() == 0 else 1
    epoch_steps = int(steps_per_epoch or 1)
    temperature, kmeans_iters = float(mcfg.temperature), int(mcfg.kmeans_iters)

    def cluster(memory: dict[str, Any], key: jax.Array, epoch: jax.Array) -> dict[str, Any]:
        """``memory`` with every head's k-means over the bank's rows written in ``epoch - 1``
        (-1: the random start), its centroids, the assignments of every example (-1 for the
        rows left out) and the non-empty clusters per head; ``key``: (seed, epoch)."""
        written = memory["bank_epoch"] == epoch - 1
        centroids, assignments, nonempty = {}, [], []
        for h, k in enumerate(num_clusters):
            bank = memory["bank"][h % num_banks]
            head_key = jax.random.fold_in(key, h)
            start = losses.initial_centroids(head_key, bank, k, written)
            if assignments:  # one head's k-means loop after the other's (parallel.after)
                start = parallel.after(start, assignments[-1])
            new, assigned, sizes = losses.kmeans(bank, start, kmeans_iters, written, shards=shards)
            centroids[f"head{h}"] = new
            assignments.append(assigned)
            nonempty.append(jnp.sum(sizes > 0).astype(jnp.int32))
        return dict(
            memory,
            centroids=centroids,
            assignments=jnp.stack(assignments),
            nonempty_clusters=jnp.stack(nonempty),
        )

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        if num_rows < 1:
            raise ValueError(
                "DeepCluster-v2's memory bank needs the number of training examples: build the "
                "method with jssl.methods.get(config, steps_per_epoch), or set "
                "method.num_examples."
            )
        model_rng, bank_rng, cluster_rng = jax.random.split(rng, 3)
        variables = model.init(model_rng, images, train=False)
        bank = jax.random.normal(bank_rng, (num_banks, num_rows, embedding_dim), jnp.float32)
        memory = {
            "bank": losses.l2_normalize(bank),  # random unit rows until written
            "bank_epoch": jnp.full((num_rows,), -1, jnp.int32),  # -1: the random start
        }
        # Epoch 0's clusters: of the random start (the memory pass trains on none of them).
        memory = cluster(memory, cluster_rng, jnp.zeros((), jnp.int32))
        return dict(
            params=variables["params"],
            batch_stats=variables.get("batch_stats", {}),
            method_state=memory,
        )

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        count = common.num_crops(batch)
        out, batch_stats = common.forward_crops(
            model, params, state.batch_stats, batch["crops"], train, rng, batch.get("index")
        )
        z = losses.l2_normalize(out["head"].astype(jnp.float32))  # (C * n, d), crop-major
        n = z.shape[0] // count
        return Forward(
            embeddings=common.split_crops(z, count),  # (C, n, d)
            features=out["avgpool"][:n],
            batch_stats=batch_stats,
            head=z[:n],
        )

    def nearest(z, centroids) -> jax.Array:
        """(H, n): each head's centroid nearest to the embedding of crop h % len(crops_for_mb)."""
        return jnp.stack(
            [
                jnp.argmax(z[crops_for_mb[h % num_banks]] @ centroids[f"head{h}"].T, axis=-1)
                for h in range(num_heads)
            ]
        ).astype(jnp.int32)

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        z = embeddings  # (C, n, d), unit rows
        memory = state.method_state
        centroids, carry = memory["centroids"], None
        if train:
            index = batch["index"].astype(jnp.int32)
            targets = memory["assignments"][:, index]  # (H, n)
            carry = {
                # Every replica writes the global batch's rows: (banks, N, d) and (N,).
                "bank_rows": jax.lax.all_gather(
                    jax.lax.stop_gradient(jnp.stack([z[c] for c in crops_for_mb])),
                    DATA_AXIS,
                    axis=1,
                    tiled=True,
                ),
                "bank_index": jax.lax.all_gather(index, DATA_AXIS, tiled=True),
            }
        else:
            targets = nearest(z, centroids)
        per_example, metrics = losses.cluster_prediction_loss(
            z, [centroids[f"head{h}"] for h in range(num_heads)], targets, temperature
        )
        metrics["nonempty_clusters"] = jnp.mean(memory["nonempty_clusters"].astype(jnp.float32))
        return Objective(terms={"cluster_prediction": per_example}, metrics=metrics, carry=carry)

    def after_update(state, carry):
        if carry is None:
            return state
        memory = state.method_state
        epoch = state.step // epoch_steps  # the epoch of the next step
        index = carry["bank_index"]
        bank = memory["bank"].at[:, index].set(carry["bank_rows"].astype(memory["bank"].dtype))
        # The rows of the step just taken belong to the epoch it was in.
        stamp = ((state.step - 1) // epoch_steps).astype(jnp.int32)
        memory = dict(memory, bank=bank, bank_epoch=memory["bank_epoch"].at[index].set(stamp))
        key = jax.random.fold_in(jax.random.fold_in(state.rng, _CENTROID_STREAM), epoch)
        memory = jax.lax.cond(
            state.step % epoch_steps == 0,
            lambda m: cluster(m, key, epoch),
            lambda m: m,
            memory,
        )
        return state.replace(method_state=memory)

    # The memory pass: every parameter held fixed while the bank fills (VISSL init_memory).
    fill_steps = int(mcfg.memory_fill_epochs) * epoch_steps if steps_per_epoch else 0
    return Method(
        init=init,
        forward=forward,
        objective=objective,
        after_update=after_update,
        model=model,
        frozen_params=(("trunk", fill_steps), ("head", fill_steps)) if fill_steps else (),
        split_state=(("bank", 1),),
    )


def check_config(config: ml_collections.ConfigDict) -> None:
    """Start-up checks that would otherwise fail deep inside the step (or silently)."""
    mcfg = config.method
    total = data.total_crops(config.data)
    crops_for_mb = tuple(mcfg.crops_for_mb)
    if (
        not crops_for_mb
        or any(not 0 <= int(c) < total for c in crops_for_mb)
        or len(set(crops_for_mb)) < len(crops_for_mb)
    ):
        raise ValueError(
            f"method.crops_for_mb={crops_for_mb} must name distinct crop indices in [0, {total}) "
            f"(there are {total} crops, data.augment.num_crops="
            f"{tuple(config.data.augment.num_crops)}); DeepCluster-v2 banks the two large "
            "crops, --config.method.crops_for_mb='(0, 1)'."
        )
    if not tuple(config.model.head_dims):
        raise ValueError(
            "model.head_dims=() leaves no projection head: DeepCluster-v2 clusters the head's "
            "embeddings; VISSL's recipe uses --config.model.head_dims='(2048, 2048, 128)'."
        )
    num_clusters = tuple(mcfg.num_clusters)
    if not num_clusters or any(int(k) < 1 for k in num_clusters):
        raise ValueError(
            f"method.num_clusters={num_clusters} must list one or more positive cluster counts "
            "(VISSL on ImageNet: (3000, 3000, 3000))."
        )
    if mcfg.temperature <= 0:
        raise ValueError(f"method.temperature={mcfg.temperature} must be positive (VISSL: 0.1).")
    if mcfg.memory_fill_epochs < 0:
        raise ValueError(
            f"method.memory_fill_epochs={mcfg.memory_fill_epochs} must be >= 0 (1: VISSL's "
            "forward pass of the random network that fills the memory bank)."
        )
    if mcfg.kmeans_iters < 0:
        raise ValueError(f"method.kmeans_iters={mcfg.kmeans_iters} must be >= 0 (VISSL: 10).")
    if mcfg.num_examples < 0:
        raise ValueError(
            f"method.num_examples={mcfg.num_examples} must be 0 (the train split's size) or "
            "the number of training examples (every batch['index'] below it)."
        )
    # k-means draws its initial centroids among the rows written in one epoch.
    per_epoch = (bank_size(config) // config.data.batch_size) * config.data.batch_size
    if max(int(k) for k in num_clusters) > per_epoch:
        raise ValueError(
            f"method.num_clusters={num_clusters}: k-means needs at least as many examples as "
            f"clusters, but an epoch holds {per_epoch} (data.batch_size="
            f"{config.data.batch_size}); use fewer clusters."
        )
