"""Representation-quality monitors run by the train engine: kNN accuracy, the online probe's
test accuracy, per-example evaluation outputs and a 2-D picture of the embeddings."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from jssl import data, features, knn, parallel, probe, summaries


def clean_features(config: ml_collections.ConfigDict, forward, state, mesh, split: str):
    """``config.knn.layer`` features of un-augmented images of ``split``, each example once."""
    batches = data.build_eval_dataset(
        config.data,
        split,
        batch_size=config.knn.batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    ).as_numpy_iterator()
    return features.collect_features(
        lambda images: forward(state, images), batches, [config.knn.layer], mesh
    )


def knn_eval(config: ml_collections.ConfigDict, forward, state, mesh) -> dict[str, float]:
    """Weighted kNN (Wu et al. 2018) of ``config.knn.layer`` features: the train split is the
    bank, the test split the queries; eval-mode network. With the online probe on, its
    accuracy on the same test features is added as ``probe_top1``/``probe_top5``."""
    kcfg = config.knn
    layer = kcfg.layer
    bank = clean_features(config, forward, state, mesh, kcfg.train_split)
    queries = clean_features(config, forward, state, mesh, kcfg.test_split)
    num_classes = int(max(bank.labels.max(), queries.labels.max())) + 1
    query_features = queries.features[layer].reshape(len(queries.labels), -1)
    result = knn.knn_accuracy(
        bank.features[layer].reshape(len(bank.labels), -1),
        bank.labels,
        query_features,
        queries.labels,
        num_classes=num_classes,
        k=kcfg.k,
        temperature=kcfg.temperature,
    )
    result = {k: float(v) for k, v in result.items()}
    if state.probe and layer == "avgpool":
        params = jax.device_get(state.probe["params"])
        acc = probe.accuracy(params, query_features, queries.labels)
        result.update({f"probe_{k}": v for k, v in acc.items()})
    logging.info("kNN (%s, k=%d, T=%g): %s", layer, kcfg.k, kcfg.temperature, result)
    return result


def test_phase(
    config: ml_collections.ConfigDict,
    eval_step,
    forward,
    state,
    mesh,
    *,
    workdir: str,
    epoch: int,
    writer=None,
    step: int = 0,
) -> dict:
    """VISSL's test phase: the method's loss on the test split (eval mode, views fixed by
    the seed), plus the kNN monitor when enabled. With ``config.eval_outputs`` the
    per-example outputs are written to ``workdir/eval/epoch_<n>/`` (edflow's eval_op) with a
    PCA picture of the embeddings coloured by class."""
    test_data = config.data.copy_and_resolve_references()
    with test_data.unlocked():
        test_data.train_split = config.data.test_split
        test_data.train_subset = -1
    batches = data.build_train_dataset(
        test_data,
        seed=config.seed,
        epoch=0,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    collected, outputs = [], []
    for host_batch in batches.as_numpy_iterator():
        batch = parallel.host_batch_to_global(host_batch, mesh)
        metrics, per_example = eval_step(state, batch)
        collected.append(metrics)
        if config.eval_outputs:
            per_example = dict(per_example, labels=batch["label"], inds=batch["index"])
            outputs.append(parallel.global_to_host(per_example))
    result = summaries.mean_metrics(collected) if collected else {}
    if config.knn.enabled:
        result.update({f"knn_{k}": v for k, v in knn_eval(config, forward, state, mesh).items()})
    if outputs:
        write_eval_outputs(os.path.join(workdir, "eval", f"epoch_{epoch}"), outputs, writer, step)
    logging.info("Test phase after epoch %d: %s", epoch, result)
    return result


def write_eval_outputs(directory: str, outputs: list[dict], writer, step: int) -> None:
    """Saves per-example arrays sorted by dataset index, loadable with ``np.load``."""
    merged = {k: np.concatenate([o[k] for o in outputs]) for k in outputs[0]}
    order = np.argsort(merged["inds"], kind="stable")
    merged = {k: v[order] for k, v in merged.items()}
    picture_source = merged.get("features", merged.get("embeddings"))
    if jax.process_index() != 0:
        return
    os.makedirs(directory, exist_ok=True)
    for name, value in merged.items():
        np.save(os.path.join(directory, f"{name}.npy"), value)
    if picture_source is not None:
        picture = summaries.embedding_picture(picture_source, merged["labels"])
        summaries.save_png(os.path.join(directory, "embedding_pca.png"), picture)
        if writer is not None:
            writer.write_images(step, {"embedding_pca": picture[None]})
    logging.info("Per-example test outputs (%d examples) written to %s", len(order), directory)


def save_json(path: str, value: Any) -> None:
    if jax.process_index() == 0:
        with open(path, "w") as f:
            json.dump(value, f, indent=2)


def load_json(path: str) -> Any | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
