"""The evaluation engines: weighted kNN and linear classification of frozen features.

``run_knn`` is VISSL's nearest-neighbour benchmark (``tools/nearest_neighbor_test.py``,
``vissl/utils/knn_utils.py``; ``configs/config/benchmark/nearest_neighbor/
eval_resnet_8gpu_in1k_kNN.yaml``: TOPK 200, SIGMA 0.1) and DINO's ``eval_knn.py``: the
features of the train split are the memory bank, those of the test split the queries, each
query votes with its ``k`` nearest neighbours weighted by ``exp(cosine / T)`` (jssl.knn).
Features come from an earlier ``extract_features`` run (``knn.features_dir``, read
memory-mapped) or are computed here from ``init.checkpoint``.

``run_linear_eval`` (in jssl/engines/linear_eval.py) trains linear heads on a frozen trunk.

Both write ``workdir/results.json`` and TensorBoard scalars under ``workdir/tensorboard``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from clu import metric_writers

from jssl import data, features, knn, methods, parallel, pooling, weights
from jssl.engines import extract, monitor, train

PyTree = Any


def run_knn(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """kNN top-1/top-5 of ``config.knn.layer`` for every k in ``config.knn.ks``.

    Returns (and writes to ``workdir/results.json``)::

        {"layer": "avgpool", "temperature": 0.1, "num_train": n, "num_test": m,
         "k200": {"top1": 71.2, "top5": 88.0}, ...}
    """
    kcfg = config.knn
    ks = tuple(kcfg.ks) or (kcfg.k,)
    train.write_config(config, workdir)
    layer = kcfg.layer
    if kcfg.features_dir:
        bank = load_features(kcfg.features_dir, kcfg.train_split, [layer])
        queries = load_features(kcfg.features_dir, kcfg.test_split, [layer])
    else:
        parallel.check_batch_divisible(kcfg.batch_size)
        mesh = parallel.make_mesh()
        forward = trunk_forward(config, mesh)
        pool = {layer: pooling.get_pool(kcfg.pool, layer)}

        def collect(split: str) -> features.Features:
            batches = data.build_eval_dataset(
                config.data,
                split,
                batch_size=kcfg.batch_size,
                process_index=jax.process_index(),
                process_count=jax.process_count(),
            ).as_numpy_iterator()
            return features.collect_features(forward, batches, [layer], mesh, pool=pool)

        bank, queries = collect(kcfg.train_split), collect(kcfg.test_split)

    bank_feats = _flat(bank.features[layer])
    query_feats = _flat(queries.features[layer])
    num_classes = int(max(bank.labels.max(), queries.labels.max())) + 1
    results: dict[str, Any] = {
        "layer": layer,
        "temperature": float(kcfg.temperature),
        "num_train": len(bank.labels),
        "num_test": len(queries.labels),
    }
    writer = make_writer(workdir)
    for k in ks:
        acc = knn.knn_accuracy(
            bank_feats,
            bank.labels,
            query_feats,
            queries.labels,
            num_classes=num_classes,
            k=k,
            temperature=kcfg.temperature,
        )
        acc = {name: float(value) for name, value in acc.items()}
        results[f"k{k}"] = acc
        logging.info("kNN %s k=%d T=%g: %s", layer, k, kcfg.temperature, acc)
        writer.write_scalars(0, {f"knn/{layer}/k{k}/{name}": v for name, v in acc.items()})
    writer.flush()
    write_results(workdir, results)
    return results


def run_linear_eval(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Linear heads on frozen features; see jssl/engines/linear_eval.py."""
    from jssl.engines import linear_eval

    return linear_eval.run(config, workdir)


def load_features(features_dir: str, split: str, layers: Sequence[str]) -> features.Features:
    """Features written by ``extract_features`` (``<dir>/<split>/<layer>_{features,targets,
    inds}.npy``, VISSL's layout), the feature arrays memory-mapped so a bank larger than RAM
    streams from disk. Rows are checked to be the same examples in every layer."""
    if os.path.isdir(os.path.join(features_dir, "features")):  # an extract_features workdir
        features_dir = os.path.join(features_dir, "features")
    # The directory extract_features writes the split to ("train[:10%]" -> "train").
    split_dir = os.path.join(features_dir, os.path.basename(extract.output_dir("", split)))
    feats: dict[str, np.ndarray] = {}
    labels = indices = None
    for layer in layers:
        prefix = os.path.join(split_dir, f"{layer}_")
        path = prefix + "features.npy"
        if not os.path.exists(path):
            available = _available(split_dir)
            raise FileNotFoundError(
                f"No features of layer {layer!r} for split {split!r}: {path} does not exist "
                f"(found: {available or 'nothing'}). Extract them first with "
                "--config=configs/extract_features.py, or point the features directory at an "
                "extract_features workdir's features/ folder."
            )
        feats[layer] = np.load(path, mmap_mode="r")
        layer_labels = np.load(prefix + "targets.npy").reshape(-1).astype(np.int32)
        layer_indices = np.load(prefix + "inds.npy").reshape(-1).astype(np.int64)
        if not len(layer_labels) == len(layer_indices) == len(feats[layer]):
            raise ValueError(
                f"{prefix}*.npy disagree in length: features {len(feats[layer])}, targets "
                f"{len(layer_labels)}, inds {len(layer_indices)}; re-run the extraction."
            )
        if indices is None:
            labels, indices = layer_labels, layer_indices
        elif not np.array_equal(indices, layer_indices):
            raise ValueError(
                f"The rows of {layer!r} and {layers[0]!r} in {split_dir} are "
                "different examples; extract all layers in one run."
            )
    return features.Features(feats, labels, indices)


def trunk_forward(
    config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh
) -> Callable[[jax.Array], Mapping[str, jax.Array]]:
    """Eval-mode taps of the model in ``init.checkpoint`` on a sharded image batch."""
    model, variables = load_frozen_model(config, mesh)
    apply = jax.jit(lambda v, images: model.apply(v, images, train=False))
    return lambda images: apply(variables, images)


def load_frozen_model(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh):
    """(flax model, replicated variables) of the online network in ``init.checkpoint``."""
    if not config.init.checkpoint:
        raise ValueError(
            f"engine={config.engine!r} evaluates a trained model: set "
            "--config.init.checkpoint to a jssl workdir (or checkpoint step dir, or a VISSL "
            ".torch / torchvision .pth file), or use features already extracted to disk."
        )
    model = methods.get(config).model
    variables = weights.load_variables(config.init.checkpoint, config, mesh=mesh)
    logging.info("Evaluating the frozen weights of %s.", config.init.checkpoint)
    return model, variables


def write_results(workdir: str, results: Mapping[str, Any]) -> None:
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        monitor.save_json(os.path.join(workdir, "results.json"), dict(results))
        logging.info("Results written to %s", os.path.join(workdir, "results.json"))


def make_writer(workdir: str) -> metric_writers.MetricWriter:
    return metric_writers.create_default_writer(
        os.path.join(workdir, "tensorboard"), just_logging=jax.process_index() > 0
    )


def _flat(x: np.ndarray) -> np.ndarray:
    # A reshape of a C-ordered memmap is a view: nothing is read yet.
    return x.reshape(len(x), -1)


def _available(directory: str) -> list[str]:
    if not os.path.isdir(directory):
        return []
    return sorted(f[: -len("_features.npy")] for f in os.listdir(directory) if "_features" in f)
