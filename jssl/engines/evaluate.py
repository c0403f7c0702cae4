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
import re
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
import tensorflow_datasets as tfds
from absl import logging
from clu import metric_writers

from jssl import data, features, knn, knn_sharded, methods, parallel, pooling, weights
from jssl.engines import extract, monitor

PyTree = Any


def run_knn(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """kNN top-1/top-5 of ``config.knn.layer`` for every k in ``config.knn.ks``.

    Returns (and writes to ``workdir/results.json``)::

        {"layer": "avgpool", "temperature": 0.1, "num_train": n, "num_test": m,
         "k200": {"top1": 71.2, "top5": 88.0}, ...}
    """
    kcfg = config.knn
    ks = tuple(kcfg.ks) or (kcfg.k,)
    layer = kcfg.layer
    writer = make_writer(workdir)
    results: dict[str, Any] = {"layer": layer, "temperature": float(kcfg.temperature)}
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


def _sharded_knn(config: ml_collections.ConfigDict, max_k: int):
    """kNN from ``init.checkpoint`` with the bank sharded over devices (jssl.knn's memory
    bound): one top-``max_k`` search per query batch serves every k. Returns
    ``(accuracy(k) -> {"top1", "top5"}, {"num_train", "num_test"})``."""
    kcfg = config.knn
    parallel.check_batch_divisible(kcfg.batch_size)
    mesh = parallel.make_mesh()
    forward = trunk_forward(config, mesh, (kcfg.layer,))
    pool = jax.jit(pooling.get_pool(kcfg.pool, kcfg.layer))

    def batches(split: str):
        ds = data.build_eval_dataset(
            config.data,
            split,
            batch_size=kcfg.batch_size,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        for host_batch in ds.as_numpy_iterator():
            mask = np.asarray(host_batch["mask"], bool)
            meta = (np.asarray(host_batch["label"], np.int32), mask)
            image, labels, mask = parallel.host_batch_to_global((host_batch["image"], *meta), mesh)
            yield pool(forward(image)[kcfg.layer]), labels, mask

    builder = knn_sharded.BankBuilder(mesh)
    for feats, labels, mask in batches(kcfg.train_split):
        builder.add(feats, labels, mask)
    bank = builder.finish()
    k_search = max(1, min(max_k, bank.num_examples))
    sims, neighbours, query_labels = [], [], []
    for feats, labels, mask in batches(kcfg.test_split):
        top_sims, top_labels = knn_sharded.sharded_top_k(bank, feats, k_search)
        keep, labels = parallel.global_to_host((mask, labels))
        keep = np.asarray(keep, bool)
        sims.append(top_sims[keep])
        neighbours.append(top_labels[keep])
        query_labels.append(np.asarray(labels)[keep])
    sims, neighbours = np.concatenate(sims), np.concatenate(neighbours)
    query_labels = np.concatenate(query_labels)
    num_classes = int(max(bank.max_label, query_labels.max(initial=-1))) + 1

    def accuracy(k: int) -> dict[str, float]:
        if k > bank.num_examples:
            logging.warning("kNN: k=%d exceeds the bank size %d.", k, bank.num_examples)
        return knn.vote_accuracy(
            sims,
            neighbours,
            query_labels,
            num_classes=num_classes,
            k=min(k, k_search),
            temperature=kcfg.temperature,
        )

    return accuracy, {"num_train": bank.num_examples, "num_test": len(query_labels)}


def run_linear_eval(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Linear heads on frozen features; see jssl/engines/linear_eval.py."""
    from jssl.engines import linear_eval

    return linear_eval.run(config, workdir)


def load_features(features_dir: str, split: str, layers: Sequence[str]) -> features.Features:
    """Features written by ``extract_features`` (``<dir>/<name>/<layer>_{features,targets,
    inds}.npy``, VISSL's layout), the feature arrays memory-mapped so a bank larger than RAM
    streams from disk. Rows are checked to be the same examples in every layer.

    A whole split ("test") reads ``<dir>/test``. A TFDS slice ("test[:5]", "test[10:20]",
    "test[:10%]") selects exactly its examples, by the stored indices, from the directory of
    that slice or of any extraction of the same split that covers it (the whole split
    included), as recorded in the directories' ``split.json``; a slice no directory covers,
    or one asked of directories without ``split.json`` (which cannot say which examples they
    hold), is refused.
    """
    if os.path.isdir(os.path.join(features_dir, "features")):  # an extract_features workdir
        features_dir = os.path.join(features_dir, "features")
    match = re.fullmatch(r"(.*?)\[.*\].*", split)
    if not match:
        return _read_layers(
            os.path.join(features_dir, extract.split_dir_name(split)), split, layers
        )

    base = match.group(1)
    infos = _split_infos(features_dir, base)
    if not infos:
        raise FileNotFoundError(
            f"No features of split {base!r} in {features_dir} record which examples they hold "
            f"(no {extract.SPLIT_INFO} beside them), so the slice {split!r} cannot be selected. "
            f"Extract it with --config.extract.splits='{split}' (or the whole split), or ask "
            f"for the whole split {base!r}."
        )
    base_size = infos[0][1]["base_num_examples"]
    start, end = _absolute_bounds(split, base, base_size)
    covering = [
        (name, info) for name, info in infos if info["start"] <= start and end <= info["end"]
    ]
    if not covering:
        held = ", ".join(f"{name} [{i['start']}:{i['end']}]" for name, i in infos)
        raise FileNotFoundError(
            f"No extracted features of {base!r} cover {split!r} (examples [{start}:{end}]); "
            f"{features_dir} holds {held}. Extract it with --config.extract.splits='{split}'."
        )
    # The exact slice if it was extracted, else the smallest extraction that holds it.
    name, info = min(covering, key=lambda c: (c[1]["end"] - c[1]["start"], c[0]))
    stored = _read_layers(os.path.join(features_dir, name), split, layers)
    if np.any(np.diff(stored.indices) <= 0):
        raise ValueError(
            f"The inds.npy of {os.path.join(features_dir, name)} are not sorted and unique, as "
            "extract_features writes them; re-run the extraction."
        )
    # Indices are sorted, so the slice is a contiguous range of rows: memmaps stay memmaps.
    lo, hi = np.searchsorted(stored.indices, [start, end])
    selected = features.Features(
        {layer: x[lo:hi] for layer, x in stored.features.items()},
        stored.labels[lo:hi],
        stored.indices[lo:hi],
    )
    complete = info["num_examples"] == info["end"] - info["start"]
    if complete and len(selected) != end - start:
        raise ValueError(
            f"{os.path.join(features_dir, name)} should hold examples [{info['start']}:"
            f"{info['end']}] of {base!r} but its inds.npy does not; re-run the extraction."
        )
    logging.info("Features of %s: rows [%d:%d) of %s/%s", split, lo, hi, features_dir, name)
    return selected


def _absolute_bounds(split: str, base: str, base_size: int) -> tuple[int, int]:
    """[start, end) of a TFDS slice spec, with TFDS's own parsing and rounding."""
    sizes = {base: types.SimpleNamespace(num_examples=base_size)}
    try:
        instructions = tfds.core.ReadInstruction.from_spec(split).to_absolute(sizes)
    except (AttributeError, AssertionError, ValueError, KeyError) as e:
        raise ValueError(
            f"Cannot select {split!r} from extracted features: use one slice of one split in "
            f"examples or percent, e.g. '{base}[:5]', '{base}[10:20]', '{base}[:10%]' ({e})."
        ) from e
    if len(instructions) != 1 or instructions[0].splitname != base:
        raise ValueError(f"Split {split!r}: use a single slice of one split, e.g. '{base}[:5]'.")
    absolute = instructions[0]
    start = absolute.from_ or 0
    end = base_size if absolute.to is None else absolute.to
    return start, end


def _split_infos(features_dir: str, base: str) -> list[tuple[str, dict]]:
    """(directory name, split.json) of every extraction of ``base`` under ``features_dir``."""
    found = []
    if not os.path.isdir(features_dir):
        return found
    for name in sorted(os.listdir(features_dir)):
        info = monitor.load_json(os.path.join(features_dir, name, extract.SPLIT_INFO))
        if info is not None and info.get("base") == base:
            found.append((name, info))
    return found


def _read_layers(split_dir: str, split: str, layers: Sequence[str]) -> features.Features:
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
    config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, layers: Sequence[str]
) -> Callable[[jax.Array], Mapping[str, jax.Array]]:
    """Eval-mode taps of the model in ``init.checkpoint`` on a sharded image batch."""
    model, variables = load_frozen_model(config, mesh, layers)
    apply = jax.jit(lambda v, images: model.apply(v, images, train=False))
    return lambda images: apply(variables, images)


def load_frozen_model(
    config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, layers: Sequence[str]
):
    """(flax model, replicated variables) of the online network in ``init.checkpoint``: the
    trunk alone unless ``layers`` asks for the ``head`` output, so a workdir of any method
    (its own head, predictor or prototypes) is evaluated with the trunk's model fields."""
    if not config.init.checkpoint:
        raise ValueError(
            f"engine={config.engine!r} evaluates a trained model: set "
            "--config.init.checkpoint to a jssl workdir (or checkpoint step dir, or a VISSL "
            ".torch / torchvision .pth file), or use features already extracted to disk."
        )
    trunk_only = "head" not in layers
    model = weights.trunk_model(config) if trunk_only else methods.get(config).model
    variables = weights.load_variables(
        config.init.checkpoint, config, mesh=mesh, trunk_only=trunk_only
    )
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
