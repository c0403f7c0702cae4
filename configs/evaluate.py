r"""Evaluation of a trained model by a list of evaluators (``config.evals``), once or on each
checkpoint of a training run as it appears (docs/evaluation.md, "Evaluators as config").

  python launch.py --config=configs/moco.py:demo --workdir=runs/demo          # train first
  python launch.py --config=configs/evaluate.py:demo --workdir=runs/demo_eval \
      --config.init.checkpoint=runs/demo
  python launch.py --config=configs/evaluate.py:demo --workdir=runs/demo_follow \
      --config.init.checkpoint=runs/demo --config.evaluate.follow=True  # beside the training

Each entry is built by ``entry(type, preset)`` with every field of the evaluator's sections
taken from its own config file's preset (configs/knn.py, linear_eval.py, svm.py, low_shot.py,
cluster.py, test_loss.py; the extraction settings of feature-reading ones from
extract_features.py), so any field can be changed on the command line
(``--config.evals.knn.knn.k=50``) and config.json records all of them. A training config adds
entries the same way (``c.evals.knn = evaluate.entry("knn", "demo")``): they then run on the
checkpoints the training saves.

Presets: "" (ImageNet: DINO's kNN and VISSL's linear protocol on res5/avgpool), "demo" (kNN,
SVM, low-shot, k-means and the method's test loss on the demo data), "test" (tiny, for the
test suite).
"""

import copy

import ml_collections

from configs import (
    base,
    cluster,
    extract_features,
    knn,
    linear_eval,
    low_shot,
    recipes,
    svm,
    test_loss,
)

PRESETS = ("", "imagenet", "demo", "test")

# The fields an entry of each type carries: whole sections, or "section.field" for one field.
FIELDS = {
    "knn": ("knn",),
    "linear": (
        "linear",
        "optim",
        "num_epochs",
        "test_every_epochs",
        "data.batch_size",
        "data.test_split",
        "checkpoint.every_steps",
    ),
    "svm": ("svm", "extract"),
    "low_shot": ("svm", "low_shot", "extract"),
    "cluster": ("cluster", "extract"),
    "test_loss": ("test_loss",),
}
_SOURCES = {
    "knn": knn.get_config,
    "linear": linear_eval.get_config,
    "svm": svm.get_config,
    "low_shot": low_shot.get_config,
    "cluster": cluster.get_config,
    "test_loss": test_loss.get_config,
}


def entry(
    kind: str, preset: str = "", every_epochs: int = 0, with_data: bool = False
) -> ml_collections.ConfigDict:
    """One ``config.evals`` entry of type ``kind`` with the settings of that evaluator's config
    file at ``preset``. ``with_data``: carry the preset's whole ``data`` section (an evaluation
    on another dataset than the run's, e.g. svm's "voc07"); otherwise the run's data is read."""
    if kind not in FIELDS:
        raise ValueError(f"Unknown evaluator type {kind!r}: use one of {tuple(FIELDS)}.")
    source = _SOURCES[kind](preset)
    if "extract" in FIELDS[kind]:
        extract_preset = preset if preset in ("demo", "test") else ""
        source.extract = extract_features.get_config(extract_preset).extract
    e = ml_collections.ConfigDict({"type": kind, "every_epochs": every_epochs})
    for field in FIELDS[kind] + (("data",) if with_data else ()):
        section, _, leaf = field.partition(".")
        if not leaf:
            e[section] = copy.deepcopy(source[section])
        else:
            if section not in e:
                e[section] = ml_collections.ConfigDict()
            e[section][leaf] = source[section][leaf]
    for section in ("svm", "cluster", "knn"):
        if section in e and "features_dir" in e[section]:
            e[section].features_dir = ""  # the evaluate engine extracts (or knn runs the trunk)
    return e


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    base.check_preset(preset, PRESETS, "configs/evaluate.py")
    c = base.get_base_config()
    recipes.evaluation(c, "evaluate", "" if preset == "imagenet" else preset)
    if preset in ("", "imagenet"):
        c.evals.knn = entry("knn", "dino")
        c.evals.linear = entry("linear", "")
    elif preset == "demo":
        c.evals.knn = entry("knn", "demo")
        c.evals.svm = entry("svm", "demo")
        c.evals.low_shot = entry("low_shot", "demo")
        c.evals.cluster = entry("cluster", "demo")
        c.evals.test_loss = entry("test_loss", "demo")
    elif preset == "test":
        c.evals.knn = entry("knn", "test")
        c.evals.svm = entry("svm", "test")
        c.evals.cluster = entry("cluster", "test")
        for section in (c.evals.svm.svm, c.evals.cluster.cluster):  # kNN's slices
            section.train_split, section.test_split = "train[:256]", "test[:100]"
        c.evaluate.poll_seconds = 1
        c.evaluate.idle_minutes = 1
    return c
