"""VOC07's multi-label targets from TFDS ``voc/2007`` through the data layer and
extract_features to the SVM evaluator (jssl.data.transfer, VISSL's
``extra_scripts/datasets/create_voc_data_files.py``): per image and class 1 where a
non-difficult object of the class is present, -1 where only difficult ones are, 0 elsewhere.

The mocked examples are VOC's features with objects drawn here so that ``labels`` and
``labels_no_difficult`` are derived from them as the TFDS builder does (``object_detection/
voc.py``): TFDS's own mock draws each per-object field with its own length, which its encoder
refuses. The metadata is written from the builder's code (no ``dataset_info.json`` ships with
tensorflow-datasets) with small split sizes, as tests/data/test_transfer.py does. The targets
are compared with a numpy computation from the objects of the same examples.
"""

import contextlib
import functools
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from configs import transfer as transfer_config
from jssl import data, engines
from jssl.data import sources, transfer
from jssl.engines import extract_features as extract_engine
from jssl.evaluation import feature_store, svm

CLASSES = 20
SIZES = {"train": 29, "validation": 30, "test": 23}  # trainval 59: 8 batches of 8 pad 5 rows


def voc_examples(n: int):
    """``n`` examples of VOC's features: 0-7 objects each, a third of them difficult, and the
    per-image label lists made from the objects as TFDS's builder makes them."""
    rng = np.random.default_rng(0)
    for i in range(n):
        k = int(rng.integers(0, 8))
        label = rng.integers(0, CLASSES, k)
        difficult = rng.random(k) < 0.35
        yield {
            "image": rng.integers(0, 256, (int(rng.integers(8, 30)), 20, 3), dtype=np.uint8),
            "image/filename": f"{i:06d}.jpg",
            "objects": {
                "bbox": np.tile(np.float32([0.1, 0.2, 0.5, 0.6]), (k, 1)),
                "is_difficult": difficult,
                "is_truncated": np.zeros(k, bool),
                "label": label,
                "pose": np.zeros(k, np.int64),
            },
            "labels": sorted(set(label.tolist())),
            "labels_no_difficult": sorted(set(label[~difficult].tolist())),
        }


def vissl_targets(n: int) -> np.ndarray:
    """VISSL's (n, 20) targets of ``voc_examples(n)``, from each image's objects."""
    out = np.zeros((n, CLASSES), np.int64)
    for i, ex in enumerate(voc_examples(n)):
        objects = ex["objects"]
        for cls in range(CLASSES):
            of_class = objects["label"] == cls
            if (of_class & ~objects["is_difficult"]).any():
                out[i, cls] = 1
            elif of_class.any():
                out[i, cls] = -1
    return out


def _voc_as_dataset(self, split, decoders=None, **kwargs):
    """FileReaderBuilder._as_dataset: as many ``voc_examples`` as ``split`` holds, encoded and
    decoded by the builder's features (``decoders`` honoured, as TFDS's reader does)."""
    features = self.info.features
    n = self.info.splits[str(split)].num_examples
    spec = tf.nest.map_structure(lambda t: t.to_tensor_spec(), features.get_serialized_info())
    ds = tf.data.Dataset.from_generator(
        lambda: (features.encode_example(ex) for ex in voc_examples(n)), output_signature=spec
    )
    return ds.map(functools.partial(features.decode_example, decoders=decoders))


@contextlib.contextmanager
def mock_voc(root: str, sizes: dict[str, int] = SIZES):
    """TFDS mocked with voc/2007's metadata (its code's features, ``sizes`` as its splits)."""
    with tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_CODE):
        builder = tfds.builder("voc/2007")
        splits = [
            tfds.core.SplitInfo(name=s, shard_lengths=[n], num_bytes=0) for s, n in sizes.items()
        ]
        builder.info.set_splits(tfds.core.SplitDict(splits))
        directory = os.path.join(root, "voc", "2007", str(builder.version))
        os.makedirs(directory, exist_ok=True)
        builder.info.write_to_directory(directory)
    with tfds.testing.mock_data(
        policy=tfds.testing.MockPolicy.USE_FILES, data_dir=root, as_dataset_fn=_voc_as_dataset
    ):
        yield


def test_targets_follow_the_builders_labels_as_vissl_reads_the_devkit():
    # class 3: one easy + one difficult object -> 1; 7: difficult only -> -1; 12: easy -> 1.
    label = np.array([3, 3, 7, 12, 7])
    difficult = np.array([False, True, True, False, True])
    labels, easy = sorted(set(label)), sorted(set(label[~difficult]))
    want = np.zeros(CLASSES, np.int32)
    want[[3, 12]], want[7] = 1, -1
    np.testing.assert_array_equal(transfer.multi_label_targets(labels, easy, CLASSES), want)
    np.testing.assert_array_equal(transfer.multi_label_targets_np(labels, easy, CLASSES), want)
    empty = tf.zeros([0], tf.int64)
    assert not transfer.multi_label_targets(empty, empty, CLASSES).numpy().any()
    assert not transfer.multi_label_targets_np([], [], CLASSES).any()


def test_voc_targets_through_the_pipeline_match_numpy(tmp_path):
    c = transfer_config.get_config("voc2007,extract")
    trainval, test = c.extract.splits
    assert (trainval, test) == ("train+validation", "test")
    n = {trainval: SIZES["train"] + SIZES["validation"], test: SIZES["test"]}
    with mock_voc(str(tmp_path)):
        source = sources.resolve_split(c.data, trainval)
        assert (source.num_examples, source.num_classes, source.label_shape) == (
            n[trainval],
            CLASSES,
            (CLASSES,),
        )
        for split in (trainval, test):
            rows = list(data.build_eval_dataset(c.data, split, batch_size=8).as_numpy_iterator())
            mask = np.concatenate([r["mask"] for r in rows])
            index = np.concatenate([r["index"] for r in rows])[mask]
            targets = np.concatenate([r["label"] for r in rows])[mask]
            assert len(mask) == 8 * -(-n[split] // 8) and index.tolist() == list(range(n[split]))
            np.testing.assert_array_equal(targets, vissl_targets(n[split]))
    assert set(np.unique(vissl_targets(n[trainval]))) == {-1, 0, 1}  # every case is read


def test_extraction_writes_the_multi_label_targets_the_svm_reads(tmp_path):
    n, targets = 7, vissl_targets(7)
    directory = feature_store.output_dir(str(tmp_path), "train+validation")
    assert directory.endswith(os.path.join("features", "train_validation"))
    writer = extract_engine._SplitWriter(directory, {"avgpool": (4,)}, n, label_shape=(CLASSES,))
    feats = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
    for rows in (np.array([4, 6, 5]), np.arange(4)):  # batches arrive in any order
        writer.write({"avgpool": feats[rows]}, targets[rows], rows)
    assert writer.finish(allow_missing=False) == n
    split = svm.load_split(str(tmp_path), "train+validation", "avgpool")
    assert split.multi_label and svm.num_classes(split) == CLASSES
    np.testing.assert_array_equal(split.targets, targets)
    np.testing.assert_array_equal(split.features, feats)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The workdir of a one-epoch run of the tiny MoCo preset on the demo data."""
    from support.runs import tiny_trained_workdir

    return tiny_trained_workdir(tmp_path_factory)


@pytest.mark.slow
def test_voc07_extract_then_svm_end_to_end(trained, tmp_path):
    """transfer.py:voc2007,extract on the mocked VOC07 from a tiny checkpoint, then
    transfer.py:voc2007,svm on its features: (n, 20) targets on disk, a test mAP."""
    sizes = {"train": 40, "validation": 40, "test": 24}
    features_dir = str(tmp_path / "features")
    with mock_voc(str(tmp_path / "tfds"), sizes):
        c = transfer_config.get_config("voc2007,extract")
        c.init.checkpoint = trained
        c.data.image_size, c.extract.batch_size = 16, 16
        engines.run(c, features_dir)
    stored = np.load(
        os.path.join(features_dir, "features", "train_validation", "avgpool_targets.npy")
    )
    np.testing.assert_array_equal(stored, vissl_targets(80))
    c = transfer_config.get_config("voc2007,svm")
    c.svm.features_dir = features_dir
    c.svm.costs = (0.1, 1.0)
    layer = engines.run(c, str(tmp_path / "svm"))["layers"]["avgpool"]
    assert (
        layer["protocol"]["num_classes"] == CLASSES
        and "multi-label" in layer["protocol"]["targets"]
    )
    assert (layer["protocol"]["num_train"], layer["protocol"]["num_test"]) == (80, 24)
    assert layer["metric"] == "mAP" and 0.0 <= layer["value"] == layer["mAP"] <= 100.0
