r"""Transfer benchmarks: a frozen trunk evaluated on another dataset, by TFDS name
(docs/evaluation.md, "Transfer benchmarks"; the table is jssl/data/transfer.py).

  python launch.py --config=configs/transfer.py:cifar10,linear --workdir=runs/moco_cifar10 \
      --config.init.checkpoint=runs/moco --config.data.data_dir=~/tensorflow_datasets
  python launch.py --config=configs/transfer.py:food101,knn --workdir=runs/moco_food101_knn \
      --config.init.checkpoint=runs/moco
  python launch.py --config=configs/transfer.py:voc2007,extract --workdir=runs/moco_voc07 \
      --config.init.checkpoint=runs/moco                                # features first
  python launch.py --config=configs/transfer.py:voc2007,svm --workdir=runs/moco_voc07_svm \
      --config.svm.features_dir=runs/moco_voc07                         # then the SVMs (mAP)

The preset is ``<dataset>,<evaluator>``. Datasets (by key or TFDS name): cifar10, cifar100,
food101, dtd, oxford_iiit_pet, oxford_flowers102, caltech101, sun397, stl10, svhn_cropped,
eurosat (eurosat/rgb), resisc45, patch_camelyon, places365_small, i_naturalist2018, voc2007
(voc/2007). Evaluators, each starting from its own config file's ImageNet preset:

- ``linear``: configs/linear_eval.py (VISSL's transfer recipe, the same as its ImageNet one:
  28 epochs of SGD, RandomResizedCrop 224 + flip; images of 96 px or less resized whole to 224
  + flip, VISSL's CIFAR recipe), one BN -> linear head on ``avgpool`` per learning rate of the
  grid, chosen on the train split's last 10% (DTD, Flowers: trained on train, chosen on
  validation);
- ``knn``: configs/knn.py:dino (DINO's k in 10/20/100/200, T 0.07) on ``avgpool``;
- ``extract``: configs/extract_features.py, ``avgpool`` of the train and test splits;
- ``svm``: configs/svm.py's VISSL SVMs on an ``extract`` run's ``avgpool`` features (top-1 for
  single-label data, mAP for VOC07); set ``svm.features_dir``.

Test images: shorter side to 256, centre crop 224 (jssl.data.transforms.eval_image; a shorter
side of 224 px or less is resized to 224). ``avgpool`` is the ResNet's pooled res5 (VISSL's
res5 + AdaptiveAvgPool) and a ViT's [CLS] token. The model fields come from the evaluated
workdir's config.json (``--config.init.checkpoint=<any method's workdir>``); a PyTorch file uses
ResNet-50. VOC07 is multi-label: only ``extract`` and ``svm`` read it.
"""

import ml_collections

from configs import base, extract_features, knn, linear_eval, recipes, svm
from jssl.data import transfer

EVALUATORS = ("linear", "knn", "extract", "svm")
LAYER = "avgpool"  # a tap every trunk has (ResNet pooled res5, ViT [CLS])


def parse(arg: str) -> tuple[transfer.TransferDataset, str]:
    """``"<dataset>,<evaluator>"`` -> (the table's entry, evaluator)."""
    parts = [p.strip() for p in arg.split(",")]
    if len(parts) != 2 or parts[1] not in EVALUATORS:
        keys = ", ".join(d.key for d in transfer.DATASETS)
        raise ValueError(
            f"configs/transfer.py preset {arg!r}: write <dataset>,<evaluator>, e.g. "
            f"configs/transfer.py:cifar10,linear; evaluators {EVALUATORS}, datasets {keys}."
        )
    dataset = transfer.find(parts[0])
    if dataset.multi_label and parts[1] in ("linear", "knn"):
        raise ValueError(
            f"{dataset.title} is multi-label (VISSL's VOC07 SVM benchmark), which the {parts[1]} "
            f"evaluator does not read: run configs/transfer.py:{dataset.key},extract, then "
            f"configs/transfer.py:{dataset.key},svm with --config.svm.features_dir=<that workdir>."
        )
    return dataset, parts[1]


def get_config(arg: str = "cifar10,linear") -> ml_collections.ConfigDict:
    dataset, evaluator = parse(arg)
    if evaluator == "linear":
        c = linear_eval.get_config("imagenet")
        c.linear.layers = (LAYER,)
        c.linear.pool = "none"
        c.linear.num_classes = dataset.num_classes
        # VISSL's CIFAR recipe (Resize 224 + flip) for low-resolution images: a crop of 8% of
        # a 32 px image would be a few pixels blown up to 224.
        c.linear.crop_scale = (1.0, 1.0) if dataset.low_resolution else (0.08, 1.0)
    elif evaluator == "knn":
        c = knn.get_config("dino")
    elif evaluator == "extract":
        c = extract_features.get_config("")
        c.extract.layers = (LAYER,)
        c.extract.pool = "none"
    else:
        c = base.get_base_config()
        recipes.evaluation(c, "svm", "")
    set_data(c, dataset)
    if evaluator == "linear" and "+" in dataset.train_split:
        # A split sum (trainval) cannot be cut into a held-out tail: the grid's heads train on
        # its first split and are chosen on its second (DTD, Flowers: train, then validation).
        first, second = dataset.train_split.split("+")
        c.data.train_split, c.linear.val_split, c.linear.val_fraction = first, second, 0.0
    if evaluator == "knn":
        c.knn.layer = LAYER
        c.knn.train_split, c.knn.test_split = dataset.train_split, dataset.test_split
    elif evaluator == "extract":
        c.extract.splits = (dataset.train_split, dataset.test_split)
    elif evaluator == "svm":
        svm.add_svm(c, "")  # reads data.train_split / test_split into svm.*
        c.svm.layers = (LAYER,)
    return c


def set_data(c: ml_collections.ConfigDict, dataset: transfer.TransferDataset) -> None:
    """The dataset's TFDS name and splits at 224 px (VISSL's and DINOv2's transfer input)."""
    c.data.source = "tfds"
    c.data.name = dataset.tfds_name
    c.data.train_split = dataset.train_split
    c.data.test_split = dataset.test_split
    c.data.image_size = 224
