"""Representation-quality monitors run by the train engine: kNN accuracy and test phases."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections
from absl import logging

from jssl import data, features, knn, parallel, summaries


def knn_eval(config: ml_collections.ConfigDict, forward, state, mesh) -> dict[str, float]:
    """Weighted kNN (Wu et al. 2018) of ``config.knn.layer`` features: the train split is the
    bank, the test split the queries; eval-mode network, every example exactly once."""
    kcfg = config.knn
    layer = kcfg.layer

    def collect(split: str) -> features.Features:
        batches = data.build_eval_dataset(
            config.data,
            split,
            batch_size=kcfg.batch_size,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        ).as_numpy_iterator()
        return features.collect_features(
            lambda images: forward(state, images), batches, [layer], mesh
        )

    bank, queries = collect(kcfg.train_split), collect(kcfg.test_split)
    num_classes = int(max(bank.labels.max(), queries.labels.max())) + 1
    result = knn.knn_accuracy(
        bank.features[layer].reshape(len(bank.labels), -1),
        bank.labels,
        queries.features[layer].reshape(len(queries.labels), -1),
        queries.labels,
        num_classes=num_classes,
        k=kcfg.k,
        temperature=kcfg.temperature,
    )
    logging.info("kNN (%s, k=%d, T=%g): %s", layer, kcfg.k, kcfg.temperature, result)
    return {k: float(v) for k, v in result.items()}


def test_phase(config: ml_collections.ConfigDict, eval_step, forward, state, mesh) -> dict:
    """VISSL's test phase: the method's loss on the test split (eval mode, fixed views),
    plus the kNN monitor when enabled."""
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
    collected = [
        eval_step(state, parallel.host_batch_to_global(b, mesh))
        for b in batches.as_numpy_iterator()
    ]
    result = summaries.mean_metrics(collected) if collected else {}
    if config.knn.enabled:
        result.update({f"knn_{k}": v for k, v in knn_eval(config, forward, state, mesh).items()})
    logging.info("Test phase: %s", result)
    return result


def save_json(path: str, value: Any) -> None:
    if jax.process_index() == 0:
        with open(path, "w") as f:
            json.dump(value, f, indent=2)


def load_json(path: str) -> Any | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
