"""The transfer benchmarks' datasets by TFDS name (configs/transfer.py builds one preset per
dataset and evaluator from this table), and how a TFDS example with VOC's per-image labels
becomes VISSL's multi-label target.

Each ``TransferDataset`` names the TFDS builder, the splits trained and tested on, the classes,
the label feature and image key, the whole splits' sizes (from the TFDS catalog) and why those
splits. Split names and class counts were read from the builders of tensorflow-datasets 4.9.10;
the choices follow VISSL's transfer benchmarks (``configs/config/benchmark/
linear_image_classification/<dataset>/``, ``extra_scripts/datasets/create_*_data_files.py``)
and, where a dataset has no test split, VTAB's slicing (google-research/task_adaptation
``task_adaptation/data/{eurosat,resisc45}.py``). VOC07's targets are VISSL's
(``create_voc_data_files.py``): per image and class 1 (a non-difficult object), -1 (only
difficult ones) and 0 (none), ``multi_label_targets`` of TFDS's ``labels`` and
``labels_no_difficult``. More: docs/evaluation.md, "Transfer benchmarks".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import tensorflow as tf

MULTI_LABEL_FEATURES = ("labels", "labels_no_difficult")  # TFDS voc: all / non-difficult


@dataclasses.dataclass(frozen=True)
class TransferDataset:
    """One transfer benchmark: what is read from TFDS and which splits train and test."""

    key: str  # the preset name in configs/transfer.py
    title: str
    tfds_name: str  # data.name, "<builder>" or "<builder>/<config>"
    train_split: str  # what the linear head / kNN bank / SVMs train on
    test_split: str  # what is scored
    num_classes: int
    split_sizes: Mapping[str, int]  # the whole TFDS splits (TFDS catalog)
    # Images at most 96 px a side: the linear head trains on the whole image resized to the
    # crop (VISSL's CIFAR recipe: Resize 224 + flip), not a random-resized crop of it.
    low_resolution: bool = False
    label_feature: str = "label"  # "labels,labels_no_difficult": VOC's multi-label targets
    image_key: str = "image"
    notes: str = ""

    @property
    def multi_label(self) -> bool:
        return self.label_feature != "label"


_VOC_LABELS = ",".join(MULTI_LABEL_FEATURES)

DATASETS: tuple[TransferDataset, ...] = (
    TransferDataset(
        "cifar10", "CIFAR-10", "cifar10", "train", "test", 10,
        {"train": 50_000, "test": 10_000}, low_resolution=True,
        notes="32 px, resized to 224 (VISSL's CIFAR recipe)",
    ),
    TransferDataset(
        "cifar100", "CIFAR-100", "cifar100", "train", "test", 100,
        {"train": 50_000, "test": 10_000}, low_resolution=True,
        notes="the 100 fine labels (TFDS 'label'; 'coarse_label' has 20)",
    ),
    TransferDataset(
        "food101", "Food-101", "food101", "train", "validation", 101,
        {"train": 75_750, "validation": 25_250},
        notes="TFDS has no test split: its validation split is the official test set",
    ),
    TransferDataset(
        "dtd", "DTD", "dtd", "train+validation", "test", 47,
        {"train": 1_880, "validation": 1_880, "test": 1_880},
        notes="TFDS holds fold 1 (train1/val1/test1) only; train+val as VISSL's trainval",
    ),
    TransferDataset(
        "oxford_iiit_pet", "Oxford-IIIT Pets", "oxford_iiit_pet", "train", "test", 37,
        {"train": 3_680, "test": 3_669},
        notes="TFDS 'train' is the official trainval list",
    ),
    TransferDataset(
        "oxford_flowers102", "Flowers-102", "oxford_flowers102", "train+validation", "test",
        102, {"train": 1_020, "validation": 1_020, "test": 6_149},
        notes="train+val (10 + 10 per class) as VISSL's trainval; 6,149 test images",
    ),
    TransferDataset(
        "caltech101", "Caltech-101", "caltech101", "train", "test", 102,
        {"train": 3_060, "test": 6_084},
        notes="TFDS's split, 30 images per class to train; 102 classes with the background",
    ),
    TransferDataset(
        "sun397", "SUN397", "sun397/standard-part1-120k", "train", "test", 397,
        {"train": 19_850, "test": 19_850},
        notes="standard partition 1 (50 + 50 per class); the default config 'tfds' is VTAB's "
        "random 76,128 / 10,875 / 21,750 split",
    ),
    TransferDataset(
        "stl10", "STL-10", "stl10", "train", "test", 10,
        {"train": 5_000, "test": 8_000, "unlabelled": 100_000}, low_resolution=True,
        notes="96 px; the unlabelled split is not used",
    ),
    TransferDataset(
        "svhn_cropped", "SVHN", "svhn_cropped", "train", "test", 10,
        {"train": 73_257, "test": 26_032, "extra": 531_131}, low_resolution=True,
        notes="32 px; the extra split is not used",
    ),
    TransferDataset(
        "eurosat", "EuroSAT", "eurosat/rgb", "train[:80%]", "train[80%:]", 10,
        {"train": 27_000}, low_resolution=True,
        notes="one TFDS split: VTAB's trainval train[:80%], test train[80%:]; 64 px",
    ),
    TransferDataset(
        "resisc45", "RESISC45", "resisc45", "train[:80%]", "train[80%:]", 45,
        {"train": 31_500},
        notes="one TFDS split: VTAB's trainval train[:80%], test train[80%:]; manual download",
    ),
    TransferDataset(
        "patch_camelyon", "PatchCamelyon", "patch_camelyon", "train", "test", 2,
        {"train": 262_144, "validation": 32_768, "test": 32_768}, low_resolution=True,
        notes="96 px histopathology patches",
    ),
    TransferDataset(
        "places365_small", "Places365", "places365_small", "train", "validation", 365,
        {"train": 1_803_460, "validation": 36_500, "test": 328_500},
        notes="256 px; the test split is unlabelled, so validation is scored",
    ),
    TransferDataset(
        "i_naturalist2018", "iNaturalist 2018", "i_naturalist2018", "train", "validation",
        8_142, {"train": 437_513, "validation": 24_426, "test": 149_394},
        notes="the test split is unlabelled, so validation is scored",
    ),
    TransferDataset(
        "voc2007", "PASCAL VOC 2007", "voc/2007", "train+validation", "test", 20,
        {"train": 2_501, "validation": 2_510, "test": 4_952}, label_feature=_VOC_LABELS,
        notes="multi-label: VISSL's VOC07 SVM benchmark (trainval -> test, mAP)",
    ),
)  # fmt: skip


def find(name: str) -> TransferDataset:
    """The table's entry for a preset key ("eurosat") or TFDS name ("eurosat/rgb")."""
    for entry in DATASETS:
        if name in (entry.key, entry.tfds_name):
            return entry
    known = ", ".join(entry.key for entry in DATASETS)
    raise ValueError(f"Unknown transfer dataset {name!r}: use one of {known}.")


# --------------------------------------------------------------------------------------------
# Multi-label targets (VOC)
# --------------------------------------------------------------------------------------------


def multi_label_classes(features: Any) -> int:
    """C when a TFDS builder's features are VOC's per-image ``labels`` and
    ``labels_no_difficult`` (sequences of a C-class label) with no ``label``; else 0."""
    names = set(features.keys())
    if "label" in names or not names.issuperset(MULTI_LABEL_FEATURES):
        return 0
    return int(features["labels"].feature.num_classes)


def example_label(example: Mapping[str, tf.Tensor], multi_label_classes: int) -> tf.Tensor:
    """The int32 label of a TFDS example: its ``label``, or with ``multi_label_classes`` > 0
    VOC's multi-label target."""
    import tensorflow as tf

    if multi_label_classes:
        features = (example[k] for k in MULTI_LABEL_FEATURES)
        return multi_label_targets(*features, multi_label_classes)
    return tf.cast(example["label"], tf.int32)


def example_label_np(record: Mapping[str, Any], multi_label_classes: int) -> np.ndarray:
    """``example_label`` of a decoded numpy record (TFDS's random-access data source)."""
    if multi_label_classes:
        features = (record[k] for k in MULTI_LABEL_FEATURES)
        return multi_label_targets_np(*features, multi_label_classes)
    return np.asarray(record["label"], np.int32)


def multi_label_targets(
    labels: tf.Tensor, labels_no_difficult: tf.Tensor, num_classes: int
) -> tf.Tensor:
    """VISSL's VOC target of one image, int32 (C,): 1 where a non-difficult object of the
    class is present, -1 where only difficult ones are, 0 elsewhere."""
    import tensorflow as tf

    def present(ids):
        counts = tf.math.bincount(
            tf.cast(ids, tf.int32), minlength=num_classes, maxlength=num_classes
        )
        return counts > 0

    easy, any_object = present(labels_no_difficult), present(labels)
    return tf.where(easy, 1, tf.where(any_object, -1, 0))


def multi_label_targets_np(
    labels: np.ndarray, labels_no_difficult: np.ndarray, num_classes: int
) -> np.ndarray:
    """``multi_label_targets`` of numpy inputs (examples read by index)."""
    target = np.zeros(num_classes, np.int32)
    target[np.asarray(labels, np.int64)] = -1
    target[np.asarray(labels_no_difficult, np.int64)] = 1
    return target
