r"""Linear SVMs on extracted features: VISSL's SVM benchmark (``tools/train_svm.py``; the VOC07
recipe ``configs/config/benchmark/linear_image_classification/voc07/
eval_resnet_8gpu_transfer_voc07_svm.yaml``). The protocol is jssl/evaluation/svm.py's.

  python launch.py --config=configs/extract_features.py:demo --workdir=runs/demo_features \
      --config.init.checkpoint=runs/demo                       # features first
  python launch.py --config=configs/svm.py:demo --workdir=runs/demo_svm
  python launch.py --config=configs/svm.py:demo --workdir=runs/demo_svm_res5 \
      --config.svm.layers='("res5", "avgpool")'

One binary LinearSVC per class and layer, the cost of each class chosen by 3-fold
cross-validation on the train split; ``workdir/results.json`` holds each layer's mAP (and
top-1 for single-label targets), per-class AP and costs, next to the protocol (features'
source, splits, every setting, how costs were chosen, how the test figure is computed).

Presets: "" / "voc07" (VISSL's VOC07 benchmark: TFDS voc/2007, trainval -> test, ResNet-50
res5 pooled as VISSL), "demo" (the demo data's features from configs/extract_features.py:demo
in runs/demo_features), "test" (tiny, for the test suite: the splits that
configs/extract_features.py:test writes, train[:64] and test[:40]).

VOC07's targets are VISSL's (n, 20) matrix (1 present, 0 absent, -1 difficult only), which the
data layer reads from TFDS voc/2007's "labels" and "labels_no_difficult" and extract_features
writes (configs/transfer.py:voc2007,extract extracts them).
"""

import ml_collections

from configs import base, extract_features, recipes

PRESETS = ("", "voc07", "demo", "test")


def add_svm(c: ml_collections.ConfigDict, preset: str) -> None:
    """``c.svm``: the features read and VISSL's SVM settings (also configs/low_shot.py's)."""
    c.svm = ml_collections.ConfigDict()
    s = c.svm
    # An extract_features workdir (or its features/ dir) holding <split>/<layer>_*.npy.
    s.features_dir = ""
    s.layers = ("res5",)  # one set of SVMs per layer, each its own figures
    s.train_split = c.data.train_split  # the SVMs' training (and cross-validation) split
    s.test_split = c.data.test_split
    # VISSL's SVM section (vissl/config/defaults.yaml) with the VOC07 recipe's cost grid.
    s.costs = (0.01, 0.1, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 50.0, 100.0, 1000.0)
    s.cross_val_folds = 3
    s.loss = "squared_hinge"  # "squared_hinge" | "hinge" (sklearn LinearSVC)
    s.penalty = "l2"  # "l2" | "l1" (l1 needs dual=False)
    s.dual = True
    s.max_iter = 2000
    s.tol = 1e-4
    s.positive_weight = 2.0  # class_weight {+1: 2, -1: 1}
    s.normalize = True  # x / (||x|| + 1e-5), float64
    # The headline figure: "auto" (mAP for multi-label targets, top-1 for single-label),
    # "mAP" or "top1". mAP is always recorded.
    s.metric = "auto"
    s.workers = 1  # processes training classes in parallel (joblib); 1: in this process

    if preset == "demo":
        s.features_dir = "runs/demo_features"
        s.layers = ("avgpool",)  # res5 (512 dims) too: about 4x the time
    elif preset == "test":
        # What configs/extract_features.py:test writes, so that its workdir is read as it is.
        s.train_split, s.test_split = extract_features.TEST_SPLITS
        s.layers = ("avgpool",)
        s.costs = (0.1, 1.0, 10.0)


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    base.check_preset(preset, PRESETS, "configs/svm.py")
    c = base.get_base_config()
    recipes.evaluation(c, "svm", "" if preset == "voc07" else preset)
    if preset in ("", "voc07"):
        voc07(c)
    add_svm(c, preset)
    return c


def voc07(c: ml_collections.ConfigDict) -> None:
    """VISSL's VOC07 transfer data: TFDS voc/2007, trainval (5,011 images) to train the SVMs
    and test (4,952) to score them, ResNet-50 at 224 px pooled as VISSL's table."""
    c.data.source = "tfds"
    c.data.name = "voc/2007"
    c.data.train_split = "train+validation"  # VISSL's trainval
    c.data.test_split = "test"
