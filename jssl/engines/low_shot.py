"""The low_shot engine: VISSL's low-shot SVM benchmark on extracted features
(``tools/train_svm_low_shot.py``, ``vissl/utils/svm_utils/svm_low_shot_trainer.py``,
``extra_scripts/create_low_shot_samples.py``; the protocol is ``jssl.evaluation.low_shot``'s).

For every layer in ``svm.layers``, every k in ``low_shot.ks`` and ``low_shot.num_samples``
seeded samples of the train split, per-class SVMs (the ``svm.*`` settings) train on the sample
and are tested on the whole test split. ``workdir/results.json`` holds, per layer and k, the
mean, std, min and max over the samples (and each sample's figure), how each cost was chosen,
and the protocol; TensorBoard gets ``low_shot/<layer>/k<k>/<metric>``.
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections
from absl import logging

from jssl.engines import svm as svm_engine
from jssl.evaluation import low_shot, svm
from jssl.evaluation.results import make_writer, write_results

REFERENCE = (
    "VISSL tools/train_svm_low_shot.py, vissl/utils/svm_utils/svm_low_shot_trainer.py, "
    "extra_scripts/create_low_shot_samples.py"
)


def validate(config: ml_collections.ConfigDict) -> None:
    """The low_shot engine's start-up checks, run before anything is written to the workdir:
    the fields, then every k against every class's train examples."""
    svm_engine.require_section(config, "svm", "configs/low_shot.py")
    svm_engine.require_section(config, "low_shot", "configs/low_shot.py")
    svm.check_settings(config.svm)
    svm_engine.check_inputs(config)
    lcfg = config.low_shot
    ks = tuple(lcfg.ks)
    if not ks or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in ks):
        raise ValueError(
            f"low_shot.ks={ks!r} must be integers >= 1 (examples per class), e.g. VISSL's "
            f"--config.low_shot.ks='{low_shot.DEFAULT_KS}'."
        )
    if len(set(ks)) != len(ks):
        raise ValueError(f"low_shot.ks={ks!r} lists a k twice.")
    samples = lcfg.num_samples
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"low_shot.num_samples={samples!r} must be an integer >= 1 (VISSL: 5).")
    if lcfg.cost_selection not in low_shot.SELECTIONS:
        raise ValueError(
            f"low_shot.cost_selection={lcfg.cost_selection!r} is not one of "
            f"{low_shot.SELECTIONS}: choose the cost by cross-validation on each sample (one "
            "for all classes, or one per class), or use low_shot.cost."
        )
    cost = lcfg.cost
    if (
        isinstance(cost, bool)
        or not isinstance(cost, (int, float))
        or not (math.isfinite(cost) and cost > 0)
    ):
        raise ValueError(f"low_shot.cost={cost!r} must be a finite number > 0, e.g. 1.0.")
    for layer, (train, test) in svm_engine.load_pairs(config).items():
        svm.resolve_metric(config.svm.metric, train.multi_label)
        where = f"svm.train_split={config.svm.train_split!r} (layer {layer!r})"
        svm.require_two_classes(
            train, where, "svm.train_split", "one-vs-rest SVMs need at least two"
        )
        classes = svm.num_classes(train, test)
        if train.multi_label and classes < 2:
            raise ValueError(
                f"The multi-label targets of {where} have one class: a low-shot sample draws "
                "(C - 1) * k = 0 negatives, so its SVM has nothing to tell the class from. "
                "Evaluate features of a dataset with two classes or more (svm.train_split)."
            )
        low_shot.check_ks(train.targets, ks, classes)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Low-shot SVMs of every layer and k; returns (and writes) the results::

    {"evaluator": "low_shot", "reference": ..., "layers": {"res5": {"protocol": {...},
     "k1": {"k": 1, "metric": "mAP", "value": {"mean", "std", "min", "max"},
            "mAP": {"mean", "std", "min", "max", "samples"}, "cost_selection": ...,
            "chosen_costs": {...}, "test_per_cost": {...}}, ...}}}
    """
    validate(config)
    lcfg = config.low_shot
    settings = svm.Settings.from_config(config.svm, config.seed)
    ks = tuple(lcfg.ks)
    writer = make_writer(workdir)
    results: dict[str, Any] = {"evaluator": "low_shot", "reference": REFERENCE, "layers": {}}
    for layer, (train, test) in svm_engine.load_pairs(config).items():
        logging.info(
            "Low-shot SVM %s: k in %s, %d samples each, %d costs",
            layer,
            ks,
            lcfg.num_samples,
            len(settings.costs),
        )
        figures = low_shot.evaluate(
            train,
            test,
            settings,
            ks=ks,
            num_samples=lcfg.num_samples,
            selection=lcfg.cost_selection,
            fixed_cost=float(lcfg.cost),
            metric=config.svm.metric,
        )
        record = {"protocol": _protocol(config, layer, train, test), **figures}
        results["layers"][layer] = record
        for k, fig in figures.items():
            v = fig["value"]
            line = (
                f"Low-shot {layer} k={fig['k']}: {fig['metric']} {v['mean']:.2f} +- "
                f"{v['std']:.2f} (min {v['min']:.2f}, max {v['max']:.2f}) over "
                f"{lcfg.num_samples} samples"
            )
            logging.info(line)
            print(line, flush=True)
            writer.write_scalars(0, {f"low_shot/{layer}/{k}/{fig['metric']}": v["mean"]})
    writer.flush()
    write_results(workdir, results)
    return results


def _protocol(config: ml_collections.ConfigDict, layer: str, train, test) -> dict[str, Any]:
    lcfg = config.low_shot
    record = svm_engine.protocol(config, "svm", layer, train, test)
    if train.multi_label:
        sampling = (
            "for each class on its own, k train rows with target 1 and (C - 1) * k with "
            "target 0, without replacement (VISSL's generate_voc07_low_shot_samples); the "
            "class's SVM trains on those rows"
        )
    else:
        sampling = (
            "k train rows of every class, without replacement (VISSL's "
            "generate_places_low_shot_samples); each class's SVM is one-vs-rest on the k * C rows"
        )
    record.update(
        ks=list(lcfg.ks),
        num_samples=lcfg.num_samples,
        sampling=sampling,
        sample_key=(
            "numpy Generator(SeedSequence([seed, sample, k])), samples numbered 1.."
            f"{lcfg.num_samples}, seed {config.seed}: the same samples for the same seed"
        ),
        cost_selection=lcfg.cost_selection,
        cost=float(lcfg.cost),
        spread="mean, std (population), min and max of the samples' figures",
        test_per_cost=(
            "each cost's test figure averaged over the samples, as VISSL's aggregate_stats "
            "tabulates them; VISSL reports the best of these for each k, a choice made on the "
            "test split, so they are listed for comparison and select nothing here"
        ),
    )
    return record
