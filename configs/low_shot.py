r"""Low-shot linear SVMs on extracted features: VISSL's low-shot benchmark
(``tools/train_svm_low_shot.py``, ``extra_scripts/create_low_shot_samples.py``; the recipe
``configs/config/benchmark/low_shot_transfer/voc07/eval_resnet_8gpu_transfer_voc07_low_shot_svm
.yaml``). The protocol is jssl/evaluation/low_shot.py's.

  python launch.py --config=configs/extract_features.py:demo --workdir=runs/demo_features \
      --config.init.checkpoint=runs/demo                       # features first
  python launch.py --config=configs/low_shot.py:demo --workdir=runs/demo_low_shot
  python launch.py --config=configs/low_shot.py:demo --workdir=runs/demo_low_shot_fixed \
      --config.low_shot.cost_selection=fixed --config.low_shot.cost=1.0

For every k in ``low_shot.ks`` and each of ``low_shot.num_samples`` samples (keyed by the
seed), per-class SVMs (``svm.*``: VISSL's settings, see configs/svm.py) train on k examples
per class of the train split and are tested on the whole test split; ``workdir/results.json``
holds the mean, std, min and max over the samples for each layer and k, with the protocol.

Presets: "" / "voc07" (VISSL's VOC07 low-shot: res4 and res5, k 1..96, 5 samples; on the
multi-label targets configs/svm.py describes), "demo" (the demo features in
runs/demo_features), "test" (tiny, for the test suite: configs/svm.py:test's splits, which
configs/extract_features.py:test writes).
"""

import ml_collections

from configs import base, recipes
from configs import svm as svm_config

PRESETS = ("", "voc07", "demo", "test")


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    base.check_preset(preset, PRESETS, "configs/low_shot.py")
    c = base.get_base_config()
    recipes.evaluation(c, "low_shot", "" if preset == "voc07" else preset)
    if preset in ("", "voc07"):
        svm_config.voc07(c)
    svm_config.add_svm(c, preset)
    c.low_shot = ml_collections.ConfigDict()
    lo = c.low_shot
    lo.ks = (1, 2, 4, 8, 16, 32, 64, 96)  # examples per class (VISSL's VOC07 k_values)
    lo.num_samples = 5  # independent samples per k (VISSL's sample_inds 1..5)
    # How the cost is chosen on each sample: "cross_validation" (one cost for all classes, the
    # best mean AP of stratified min(svm.cross_val_folds, k)-fold cross-validation on the
    # sample's own examples), "cross_validation_per_class" (each class its own, as configs/svm.py)
    # or "fixed" (low_shot.cost); k = 1 uses low_shot.cost. VISSL picks the best test mAP.
    lo.cost_selection = "cross_validation"
    lo.cost = 1.0

    if preset in ("", "voc07"):
        c.svm.layers = ("res4", "res5")  # the VOC07 low-shot recipe's pooled taps
    elif preset == "demo":
        c.svm.layers = ("avgpool",)
    elif preset == "test":
        lo.ks = (1, 2, 4)
        lo.num_samples = 2
    return c
