"""Representation-quality monitors run by the train engine: kNN accuracy (before the first
step, in test phases and at the end, with the line comparing the last with the first), the
online probe's test accuracy, per-example evaluation outputs and a PCA picture of the
embeddings.

Every pass reads a split through ``evaluation.batches.eval_batches`` (centre crop, each example
exactly once, the last batch padded with ``mask`` False rows), so results cover the whole split
and do not depend on augmentation draws. The test phase is one pass over the test split: each
batch goes through the eval step once, for the method's loss (the centre crop fed as every
view), the per-example outputs and the kNN queries, searched in the kNN engine's sharded bank
(``knn_sharded``), so no process holds the bank or all query features. More:
docs/evaluation.md, "During pre-training".
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from absl import logging

from jssl import data, parallel
from jssl.evaluation import knn_sharded
from jssl.evaluation.batches import eval_batches
from jssl.evaluation.results import load_json, save_json
from jssl.training import probe, summaries
from jssl.training.step import make_eval_step

# kNN layers the method already returns per example (its LossOutput fields), under these names.
_METHOD_OUTPUTS = {"avgpool": "features", "head": "embeddings"}


def make_test_step(config: ml_collections.ConfigDict, method, mesh) -> Callable:
    """The eval step ``test_phase`` expects: every crop is the eval image (resized to the
    crop group's size), and the kNN layer
    is among its per-example outputs (so the kNN queries come from the same forward)."""
    layer = config.knn.layer
    taps = (layer,) if config.knn.enabled and layer not in _METHOD_OUTPUTS else ()
    groups = [(g.num_crops, g.size) for g in data.crop_groups(config.data)]
    return make_eval_step(method, mesh, crop_groups=groups, taps=taps)


def build_bank(config: ml_collections.ConfigDict, forward, state, mesh) -> knn_sharded.ShardedBank:
    """``config.knn.layer`` features of ``knn.train_split`` (eval transform), kept sharded."""
    kcfg = config.knn
    bank = knn_sharded.build_bank(
        (
            (forward(state, batch.batch["image"])[kcfg.layer], batch)
            for batch in eval_batches(config.data, kcfg.train_split, kcfg.batch_size, mesh)
        ),
        mesh,
    )
    logging.info(
        "kNN bank: %d examples of %s (%d-d), sharded", bank.num_examples, kcfg.layer, bank.dim
    )
    return bank


class _Queries:
    """The kNN search (``knn_sharded.QueryTopK``) of streamed query batches, plus the online
    probe's hits on the same features (real rows)."""

    def __init__(self, config: ml_collections.ConfigDict, bank: knn_sharded.ShardedBank, state):
        self.config = config
        self.top_k = knn_sharded.QueryTopK(bank, config.knn.k)
        self.probe_params = None
        if state.probe and config.knn.layer == "avgpool":
            self.probe_params = jax.device_get(state.probe["params"])
        self.probe_hits = {"top1": 0.0, "top5": 0.0}

    @property
    def needs_features_on_host(self) -> bool:
        return self.probe_params is not None

    def add(self, queries: jax.Array, meta: dict, host_features: np.ndarray | None = None):
        self.top_k.add(queries, meta)
        keep = meta["mask"]
        if self.probe_params is not None and keep.any():
            acc = probe.accuracy(self.probe_params, host_features[keep], meta["label"][keep])
            for name in self.probe_hits:
                self.probe_hits[name] += acc[name] * int(keep.sum())

    def result(self) -> dict[str, float]:
        kcfg = self.config.knn
        neighbours = self.top_k.finish()
        result = neighbours.accuracy(kcfg.k, kcfg.temperature)
        num_queries = len(neighbours.query_labels)
        if self.probe_params is not None and num_queries:
            result.update({f"probe_{k}": v / num_queries for k, v in self.probe_hits.items()})
        result = {k: float(v) for k, v in result.items()}
        logging.info("kNN (%s, k=%d, T=%g): %s", kcfg.layer, kcfg.k, kcfg.temperature, result)
        return result


def knn_eval(config: ml_collections.ConfigDict, forward, state, mesh) -> dict[str, float]:
    """Weighted kNN (Wu et al. 2018) of ``config.knn.layer`` features: the train split is the
    bank, the test split the queries; eval-mode network. With the online probe on, its
    accuracy on the same test features is added as ``probe_top1``/``probe_top5``."""
    kcfg = config.knn
    queries = _Queries(config, build_bank(config, forward, state, mesh), state)
    for batch, meta in eval_batches(config.data, kcfg.test_split, kcfg.batch_size, mesh):
        feats = forward(state, batch["image"])[kcfg.layer]
        host = parallel.global_to_host(feats) if queries.needs_features_on_host else None
        queries.add(feats, meta, host)
    return queries.result()


def knn_baseline(config, forward, state, mesh, *, workdir: str, writer, resumed: bool):
    """The kNN accuracy before the first step (of the random init, or of init.checkpoint's
    weights), the figure a pre-training run must beat; kept in the workdir so that resumed
    runs print it too (None when a resumed workdir has none)."""
    path = os.path.join(workdir, "knn_random_init.json")
    if resumed:
        return load_json(path)
    baseline = knn_eval(config, forward, state, mesh)
    save_json(path, baseline)
    writer.write_scalars(0, {f"knn/random_init_{k}": v for k, v in baseline.items()})
    return baseline


def final_knn(config, forward, state, mesh, *, step: int, last_test: tuple[int, dict]) -> dict:
    """The kNN accuracy of the trained state at ``step``, reusing the last test phase's
    results (``last_test``: its step and results) when it measured this very state."""
    tested_at, results = last_test
    if tested_at == step:
        return {k[4:]: v for k, v in results.items() if k.startswith("knn_")}
    return knn_eval(config, forward, state, mesh)


def knn_comparison(config: ml_collections.ConfigDict, learned: dict, baseline: dict) -> str:
    """Logs, and prints on process 0, the line comparing the learned kNN top-1 with the
    baseline's; returns it."""
    # Started from weights, the baseline (measured before the first step) is those weights.
    start = "init.checkpoint" if config.init.checkpoint else "random init"
    line = (
        f"kNN top-1 on {config.knn.test_split} ({config.knn.layer}, k={config.knn.k}): "
        f"learned {learned['top1']:.1f}% vs {start} {baseline['top1']:.1f}%"
    )
    logging.info(line)
    if jax.process_index() == 0:
        print(line, flush=True)
    return line


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
    """VISSL's test phase: one pass over ``data.test_split`` in eval mode.

    ``eval_step`` is ``make_test_step(config, method, mesh)`` (or ``make_eval_step``):
    the test loss is the method's loss with the centre crop fed as every view, averaged over
    the real examples. With ``knn.enabled`` the kNN monitor's queries are the same pass's
    ``knn.layer`` features (when ``knn.test_split`` is the test split; otherwise kNN runs its
    own pass over ``knn.test_split``). With ``config.eval_outputs`` the per-example outputs of
    every test example, sorted by index, are written to ``workdir/eval/epoch_<n>/`` (edflow's
    eval_op) with a PCA picture of the embeddings coloured by class.
    """
    kcfg = config.knn
    split = config.data.test_split
    same_pass = kcfg.enabled and kcfg.test_split == split
    queries = (
        _Queries(config, build_bank(config, forward, state, mesh), state) if same_pass else None
    )
    query_key = _METHOD_OUTPUTS.get(kcfg.layer, kcfg.layer)
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    outputs, num_examples = [], 0
    for batch, meta in eval_batches(config.data, split, config.data.batch_size, mesh):
        totals, per_example = eval_step(state, batch)
        for name, (value, weight) in jax.device_get(totals).items():
            sums[name] = sums.get(name, 0.0) + float(value)
            weights[name] = weights.get(name, 0.0) + float(weight)
        keep = meta["mask"]
        num_examples += int(keep.sum())
        if queries is not None:
            if query_key not in per_example:  # an eval step built without the kNN layer
                per_example = dict(
                    per_example, **{query_key: forward(state, batch["image"])[kcfg.layer]}
                )
            need_host = config.eval_outputs or queries.needs_features_on_host
            host = parallel.global_to_host(per_example) if need_host else None
            queries.add(per_example[query_key], meta, host[query_key] if host else None)
        elif config.eval_outputs:
            host = parallel.global_to_host(per_example)
        if config.eval_outputs:
            rows = {k: np.asarray(v)[keep] for k, v in host.items()}
            outputs.append(dict(rows, labels=meta["label"][keep], inds=meta["index"][keep]))
    result = {name: sums[name] / weights[name] for name in sums if weights[name] > 0}
    result["num_examples"] = num_examples
    if queries is not None:
        result.update({f"knn_{k}": v for k, v in queries.result().items()})
    elif kcfg.enabled:
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
