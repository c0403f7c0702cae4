"""The cluster engine: k-means of extracted features on the devices, scored against the labels
(``jssl.evaluation.clustering``: NMI, ARI, Hungarian-matched accuracy).

For every layer in ``cluster.layers`` the features of ``cluster.train_split`` (an
``extract_features`` run's, ``cluster.features_dir``) are clustered into ``cluster.num_clusters``
clusters (0: the number of classes) and scored on that split; with ``cluster.test_split`` the
fitted centroids also assign the test split's features, scored the same way. Labels never
reach the clustering: they only score it. ``workdir/results.json`` holds the scores next to the
protocol (features, splits, every k-means setting, the restart kept and every restart's
inertia); TensorBoard gets ``cluster/<layer>/<split>/<score>``.
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections
from absl import logging

from jssl import parallel
from jssl.engines import svm as svm_engine
from jssl.evaluation import clustering, svm
from jssl.evaluation.results import make_writer, write_results


def validate(config: ml_collections.ConfigDict) -> None:
    """The cluster engine's start-up checks, run before anything is written to the workdir."""
    svm_engine.require_section(config, "cluster", "configs/cluster.py")
    ccfg = config.cluster
    check = {"num_clusters": 0, "restarts": 1, "max_iters": 1, "chunk_rows": 1}
    for name, low in check.items():
        value = ccfg[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(
                f"cluster.{name}={value!r} must be an integer >= {low}"
                + (" (0: the number of classes)." if name == "num_clusters" else ".")
            )
    tol = ccfg.tol
    if (
        isinstance(tol, bool)
        or not isinstance(tol, (int, float))
        or not (math.isfinite(tol) and tol >= 0)
    ):
        raise ValueError(f"cluster.tol={tol!r} must be a finite number >= 0 (sklearn: 1e-4).")
    if ccfg.init not in clustering.INITS:
        raise ValueError(f"cluster.init={ccfg.init!r} is not one of {clustering.INITS}.")
    if not isinstance(ccfg.features_dir, str) or not ccfg.features_dir:
        raise ValueError(
            "cluster.features_dir is empty: run --config=configs/extract_features.py first and "
            "pass its workdir, e.g. --config.cluster.features_dir=runs/demo_features."
        )
    layers = tuple(ccfg.layers)
    if not layers or not all(isinstance(layer, str) and layer for layer in layers):
        raise ValueError(f"cluster.layers={layers!r} must name extracted layers.")
    if not isinstance(ccfg.train_split, str) or not ccfg.train_split:
        raise ValueError(f"cluster.train_split={ccfg.train_split!r} must name a split.")
    for layer in layers:
        for field, split in _splits(ccfg).items():
            data = svm.load_split(ccfg.features_dir, split, layer, field)
            if data.multi_label:
                raise ValueError(
                    f"cluster: the targets of {split!r} are multi-label; NMI, ARI and matched "
                    "accuracy need one class per example."
                )
            svm.require_two_classes(
                data,
                f"{field}={split!r} (layer {layer!r})",
                field,
                "NMI, ARI and matched accuracy against a single class score 100 (or 0) "
                "whatever the clustering",
            )
            if split == ccfg.train_split and ccfg.num_clusters > len(data):
                raise ValueError(
                    f"cluster.num_clusters={ccfg.num_clusters} is more than the {len(data)} "
                    f"examples of {split!r}."
                )


def _splits(ccfg) -> dict[str, str]:
    """{field: split} of the splits scored: the train split, and the test split if set."""
    splits = {"cluster.train_split": ccfg.train_split}
    if ccfg.test_split:
        splits["cluster.test_split"] = ccfg.test_split
    return splits


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """k-means of every layer; returns (and writes) the results::

    {"evaluator": "cluster", "layers": {"avgpool": {"protocol": {...},
     "train": {"nmi", "ari", "accuracy", "num_examples", "inertia"}, "test": {...}}}}
    """
    validate(config)
    ccfg = config.cluster
    mesh = parallel.make_mesh()
    writer = make_writer(workdir)
    results: dict[str, Any] = {"evaluator": "cluster", "layers": {}}
    for layer in ccfg.layers:
        train = svm.load_split(ccfg.features_dir, ccfg.train_split, layer, "cluster.train_split")
        classes = int(train.targets.max()) + 1
        k = ccfg.num_clusters or classes
        data = clustering.shard_rows(
            train.features, mesh, normalize=ccfg.normalize, chunk_rows=ccfg.chunk_rows
        )
        fit = clustering.kmeans(
            data,
            k,
            seed=config.seed,
            restarts=ccfg.restarts,
            max_iters=ccfg.max_iters,
            tol=ccfg.tol,
            init=ccfg.init,
        )
        record: dict[str, Any] = {
            "protocol": _protocol(config, layer, train, k, classes, fit, mesh),
            "train": {
                **clustering.cluster_scores(train.targets, fit.assignments),
                "inertia": fit.inertia,
            },
        }
        if ccfg.test_split:
            test = svm.load_split(ccfg.features_dir, ccfg.test_split, layer, "cluster.test_split")
            test_data = clustering.shard_rows(
                test.features, mesh, normalize=ccfg.normalize, chunk_rows=ccfg.chunk_rows
            )
            assigned, inertia = clustering.assign(test_data, fit.centroids)
            record["test"] = {
                **clustering.cluster_scores(test.targets, assigned),
                "inertia": inertia,
            }
        for split in ("train", "test"):
            if split in record:
                s = record[split]
                line = (
                    f"k-means {layer} ({k} clusters) on {split}: NMI {s['nmi']:.2f}, ARI "
                    f"{s['ari']:.2f}, matched accuracy {s['accuracy']:.2f}"
                )
                logging.info(line)
                print(line, flush=True)
                scores = {name: s[name] for name in ("nmi", "ari", "accuracy")}
                writer.write_scalars(
                    0, {f"cluster/{layer}/{split}/{n}": v for n, v in scores.items()}
                )
        results["layers"][layer] = record
    writer.flush()
    write_results(workdir, results)
    return results


def _protocol(config, layer, train, k, classes, fit, mesh) -> dict[str, Any]:
    ccfg = config.cluster
    return {
        "features": svm_engine.features_record(ccfg.features_dir, layer),
        "train_split": ccfg.train_split,
        "test_split": ccfg.test_split or None,
        "num_train": len(train),
        "feature_dims": int(train.features.shape[1]),
        "num_classes": classes,
        "num_clusters": k,
        "num_clusters_from": "cluster.num_clusters" if ccfg.num_clusters else "the classes",
        "normalization": "x / max(||x||_2, 1e-12)" if ccfg.normalize else "none",
        "algorithm": (
            "Lloyd's k-means on the devices (rows sharded over the data axis), squared "
            "Euclidean distance; stops when no assignment changes or the centroids' squared "
            "shift is within tol * mean per-dimension variance (sklearn's rule); an empty "
            "cluster keeps its centroid"
        ),
        "settings": {
            "init": ccfg.init,
            "restarts": ccfg.restarts,
            "max_iters": ccfg.max_iters,
            "tol": ccfg.tol,
            "seed": config.seed,
            "chunk_rows": ccfg.chunk_rows,
            "devices": int(mesh.devices.size),
        },
        "selection": (
            "of the restarts, the lowest inertia on the train split (first of equals); labels "
            "are used only to score"
        ),
        "restart_kept": fit.restart,
        "inertias": fit.inertias,
        "iterations": fit.iterations,
        "converged": fit.converged,
        "test_assignment": (
            "each test example to its nearest train centroid" if ccfg.test_split else None
        ),
        "scores": (
            "nmi: sklearn normalized_mutual_info_score (arithmetic); ari: adjusted_rand_score; "
            "accuracy: the one-to-one cluster-to-class matching with the most agreeing "
            "examples (scipy linear_sum_assignment), unmatched clusters wrong; all in %"
        ),
    }
