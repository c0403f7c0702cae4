"""The knn engine: weighted kNN classification of frozen features.

It is VISSL's nearest-neighbour benchmark (``tools/nearest_neighbor_test.py``,
``vissl/utils/knn_utils.py``; ``configs/config/benchmark/nearest_neighbor/
eval_resnet_8gpu_in1k_kNN.yaml``: TOPK 200, SIGMA 0.1) and DINO's ``eval_knn.py``: the
features of the train split are the memory bank, those of the test split the queries, each
query votes with its ``k`` nearest neighbours weighted by ``exp(cosine / T)`` (jssl.evaluation.knn).
Features come from an earlier ``extract_features`` run (``knn.features_dir``, read
memory-mapped) or are computed here from ``init.checkpoint``.

It writes ``workdir/results.json`` and TensorBoard scalars under ``workdir/tensorboard``.
``check_config`` holds the start-up checks of ``config.knn``, for this engine and for the kNN
monitor of the train engine alike.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from jssl import models, parallel
from jssl.evaluation import evaluators, knn, knn_sharded, pooling
from jssl.evaluation.batches import eval_batches
from jssl.evaluation.feature_store import load_features
from jssl.evaluation.frozen import trunk_forward
from jssl.evaluation.results import make_writer, write_results

PyTree = Any


def check_config(config: ml_collections.ConfigDict, *, monitor: bool = False) -> None:
    """Start-up checks of ``config.knn``: settings that would make the accuracy meaningless
    (a temperature <= 0 or non-finite, k < 1) or fail late raise ValueError naming the field.
    ``monitor=True`` checks what the train engine's kNN monitor reads (``knn.k``, not ``ks``,
    and it always computes features)."""
    kcfg = config.knn
    temperature = kcfg.temperature
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"knn.temperature={temperature!r} must be a number > 0, e.g. 0.07.")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"knn.temperature={temperature} must be a finite number > 0: each neighbour votes "
            "with weight exp(cosine / T), which T = 0 makes infinite, T < 0 largest for the "
            "farthest neighbours and T = inf the same for all, so the accuracy would mean "
            "nothing. Set --config.knn.temperature=0.07 (DINO) or 0.1 (VISSL)."
        )
    if monitor or not tuple(kcfg.ks):  # the engine falls back to knn.k when ks is empty
        field, ks = "knn.k", (kcfg.k,)
    else:
        field, ks = "knn.ks", tuple(kcfg.ks)
    example = "'(20, 200)'" if field == "knn.ks" else "20"
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"{field}={kcfg[field[4:]]!r}: every k must be an integer >= 1 (the number of "
                f"neighbours that vote); set e.g. --config.{field}={example}."
            )
    meanings = {
        "layer": "a trunk tap, e.g. 'avgpool'",
        "train_split": "the split of the memory bank, e.g. 'train'",
        "test_split": "the split of the queries, e.g. 'test'",
    }
    for name, meaning in meanings.items():
        if not isinstance(kcfg[name], str) or not kcfg[name]:
            raise ValueError(f"knn.{name}={kcfg[name]!r} must name {meaning}.")
    if monitor or not kcfg.features_dir:  # features computed here: batches of knn.batch_size
        batch = kcfg.batch_size
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(
                f"knn.batch_size={batch!r} must be an integer >= 1 (the global batch of the "
                "feature pass): set --config.knn.batch_size=256."
            )
        devices, processes = jax.device_count(), jax.process_count()
        for count, what in ((devices, "devices"), (processes, "processes")):
            if batch % count:
                raise ValueError(
                    f"knn.batch_size={batch} is not divisible by the {count} {what}; set "
                    f"--config.knn.batch_size to a multiple of {count}."
                )


def validate(config: ml_collections.ConfigDict) -> None:
    """The knn engine's start-up checks, run before anything is written to the workdir."""
    check_config(config)
    kcfg = config.knn
    if kcfg.features_dir:
        return
    if not config.init.checkpoint:
        raise ValueError(
            "engine='knn' evaluates a trained model: set --config.init.checkpoint to a jssl "
            "workdir (or a checkpoint, or a VISSL .torch / torchvision .pth file), or "
            "--config.knn.features_dir to an extract_features workdir."
        )
    models.check_input_size(config.model, config.data.image_size, "data.image_size")
    pooling.get_pool(kcfg.pool, kcfg.layer)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """kNN top-1/top-5 of ``config.knn.layer`` for every k in ``config.knn.ks``.

    Returns (and writes to ``workdir/results.json``)::

        {"layer": "avgpool", "temperature": 0.1, "num_train": n, "num_test": m,
         "k200": {"top1": 71.2, "top5": 88.0}, ...}
    """
    validate(config)
    if not config.knn.features_dir:  # read the step the record names, not "the newest"
        config = copy.deepcopy(config)
        config.init.checkpoint = evaluators.resolve(config.init.checkpoint)
    kcfg = config.knn
    ks = tuple(kcfg.ks) or (kcfg.k,)
    layer = kcfg.layer
    writer = make_writer(workdir)
    results: dict[str, Any] = {"layer": layer, "temperature": float(kcfg.temperature)}
    results["protocol"] = _protocol(config)
    if kcfg.features_dir:
        bank = load_features(kcfg.features_dir, kcfg.train_split, [layer])
        queries = load_features(kcfg.features_dir, kcfg.test_split, [layer])
        num_classes = int(max(bank.labels.max(), queries.labels.max())) + 1
        results.update(num_train=len(bank.labels), num_test=len(queries.labels))
        bank_feats, query_feats = _flat(bank.features[layer]), _flat(queries.features[layer])

        def accuracy(k: int) -> dict[str, float]:
            return knn.knn_accuracy(
                bank_feats,
                bank.labels,
                query_feats,
                queries.labels,
                num_classes=num_classes,
                k=k,
                temperature=kcfg.temperature,
            )
    else:
        accuracy, counts = _sharded_knn(config, max(ks))
        results.update(counts)

    for k in ks:
        acc = {name: float(value) for name, value in accuracy(k).items()}
        results[f"k{k}"] = acc
        shown = ", ".join(f"{name} {value:.2f}" for name, value in acc.items())
        logging.info("kNN %s k=%d T=%g: %s", layer, k, kcfg.temperature, shown)
        writer.write_scalars(0, {f"knn/{layer}/k{k}/{name}": v for name, v in acc.items()})
    writer.flush()
    write_results(workdir, results)
    return results


def _protocol(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """What the figures depend on (results.json records it next to them)."""
    kcfg = config.knn
    record = evaluators.protocol(config, "knn", evaluators.EVALUATORS["knn"], online=False)
    record.update(
        layer=kcfg.layer,
        pool=kcfg.pool if not kcfg.features_dir else "as extracted",
        bank=kcfg.train_split,
        queries=kcfg.test_split,
        vote="each of the k nearest train features (cosine) votes exp(cosine / T) for its label",
    )
    if kcfg.features_dir:
        from jssl.engines import svm as svm_engine

        record["features"] = svm_engine.features_record(kcfg.features_dir, kcfg.layer)
        record["checkpoint_step"] = record["features"].get("checkpoint_step")
    return json.loads(json.dumps(record, default=str))


def _sharded_knn(config: ml_collections.ConfigDict, max_k: int):
    """kNN from ``init.checkpoint`` with the bank sharded over devices (``knn_sharded``, the kNN
    monitor's search): one top-``max_k`` search serves every k. Returns
    ``(accuracy(k) -> {"top1", "top5"}, {"num_train", "num_test"})``."""
    kcfg = config.knn
    mesh = parallel.make_mesh()
    forward = trunk_forward(config, mesh, (kcfg.layer,))
    pool = jax.jit(pooling.get_pool(kcfg.pool, kcfg.layer))

    def features(split: str):
        for batch in eval_batches(config.data, split, kcfg.batch_size, mesh):
            yield pool(forward(batch.batch["image"])[kcfg.layer]), batch

    bank = knn_sharded.build_bank(features(kcfg.train_split), mesh)
    neighbours = knn_sharded.search(bank, features(kcfg.test_split), max_k)

    def accuracy(k: int) -> dict[str, float]:
        return neighbours.accuracy(k, kcfg.temperature)

    return accuracy, {"num_train": bank.num_examples, "num_test": len(neighbours.query_labels)}


def _flat(x: np.ndarray) -> np.ndarray:
    # A reshape of a C-ordered memmap is a view: nothing is read yet.
    return x.reshape(len(x), -1)
