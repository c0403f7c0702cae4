"""Tests of the transfer presets (configs/transfer.py) and their dataset table
(jssl/data/transfer.py): every preset's config, the table against the installed TFDS builders,
and each dataset's data path on ``tfds.testing.mock_data``; one slow end-to-end kNN run on mock
CIFAR-10 from a tiny trained checkpoint.

tensorflow-datasets ships no metadata (``dataset_info.json``) and nothing is downloaded here,
so a builder's features come from its code (``MockPolicy.USE_CODE``), and ``mock_tfds`` writes
that builder's metadata with the table's split sizes into a temporary dir and mocks with
``MockPolicy.USE_FILES``: jssl then resolves splits, slices and sums from real metadata as
on a prepared dataset, and each read yields as many generated examples as its split holds.
"""

import contextlib
import os
from unittest import mock

import numpy as np
import pytest
import tensorflow_datasets as tfds
from absl import flags
from ml_collections import config_flags

from configs import transfer as transfer_config
from jssl import cli, data, engines
from jssl.data import sources, transfer
from jssl.evaluation import linear, linear_grid

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (train, test) examples of each preset's splits, worked out by hand from the TFDS catalog's
# split sizes: sums add, TFDS percent slices round to the closest example.
SIZES = {
    "cifar10": (50_000, 10_000),
    "cifar100": (50_000, 10_000),
    "food101": (75_750, 25_250),
    "dtd": (3_760, 1_880),
    "oxford_iiit_pet": (3_680, 3_669),
    "oxford_flowers102": (2_040, 6_149),
    "caltech101": (3_060, 6_084),
    "sun397": (19_850, 19_850),
    "stl10": (5_000, 8_000),
    "svhn_cropped": (73_257, 26_032),
    "eurosat": (21_600, 5_400),
    "resisc45": (25_200, 6_300),
    "patch_camelyon": (262_144, 32_768),
    "places365_small": (1_803_460, 36_500),
    "i_naturalist2018": (437_513, 24_426),
}
POOL = 2_000_000  # generated examples the mock can serve; generated lazily, as read
SINGLE_LABEL = [d.key for d in transfer.DATASETS if not d.multi_label]  # VOC: test_voc07.py


def write_metadata(name: str, sizes: dict[str, int], root: str) -> str:
    """The builder's metadata (its code's features, ``sizes`` as its splits) under ``root``
    in TFDS's ``<name>/<config>/<version>`` layout; returns ``root``."""
    with tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_CODE):
        builder = tfds.builder(name)
        splits = [
            tfds.core.SplitInfo(name=s, shard_lengths=[n], num_bytes=0) for s, n in sizes.items()
        ]
        builder.info.set_splits(tfds.core.SplitDict(splits))
        config = [builder.builder_config.name] if builder.builder_config else []
        directory = os.path.join(root, builder.name, *config, str(builder.version))
        os.makedirs(directory, exist_ok=True)
        builder.info.write_to_directory(directory)
    return root


@contextlib.contextmanager
def mock_tfds(root: str, name: str, sizes: dict[str, int]):
    """TFDS mocked with ``name``'s metadata of ``sizes``; a read of a split (a slice, a sum)
    yields that many of the mock's generated examples (the same ones for every split).

    The mock draws a box's four coordinates independently, which TFDS's own encoder refuses
    when min > max (Pets' head_bbox), so the test puts each box's coordinates in order."""
    write_metadata(name, sizes, root)
    reader, box = tfds.core.dataset_builder.FileReaderBuilder, tfds.features.BBoxFeature
    encode_box = box.encode_example

    def ordered_box(self, bbox):
        ymin, xmin, ymax, xmax = bbox
        ordered = [min(ymin, ymax), min(xmin, xmax), max(ymin, ymax), max(xmin, xmax)]
        return encode_box(self, np.array(ordered, np.float32))

    with tfds.testing.mock_data(
        num_examples=POOL, policy=tfds.testing.MockPolicy.USE_FILES, data_dir=root
    ):
        generated = reader._as_dataset

        def sized(self, split, **kwargs):
            return generated(self, split, **kwargs).take(self.info.splits[str(split)].num_examples)

        with (
            mock.patch.object(reader, "_as_dataset", sized),
            mock.patch.object(box, "encode_example", ordered_box),
        ):
            yield


def test_every_preset_sets_the_tables_dataset_and_splits():
    for dataset in transfer.DATASETS:
        for evaluator in transfer_config.EVALUATORS:
            arg = f"{dataset.key},{evaluator}"
            if dataset.multi_label and evaluator in ("linear", "knn"):
                with pytest.raises(ValueError, match=rf"{dataset.key},extract.*{dataset.key},svm"):
                    transfer_config.get_config(arg)
                continue
            c = transfer_config.get_config(arg)
            assert (c.data.source, c.data.name, c.data.image_size) == (
                "tfds",
                dataset.tfds_name,
                224,
            )
            splits = (dataset.train_split, dataset.test_split)
            if evaluator == "linear" and "+" in dataset.train_split:  # trainval: train, val
                first, second = dataset.train_split.split("+")
                assert (c.data.train_split, c.linear.val_split) == (first, second)
                assert c.data.test_split == dataset.test_split and c.linear.val_fraction == 0
                linear_grid.check_config(c)  # a grid chosen on validation, not on test
                assert len(c.linear.lrs) > 1
            else:
                assert (c.data.train_split, c.data.test_split) == splits
            engine = {"linear": "linear_eval", "extract": "extract_features"}.get(evaluator)
            assert c.engine == (engine or evaluator)
            if evaluator == "linear":
                assert c.linear.layers == ("avgpool",) and c.linear.pool == "none"
                assert c.linear.num_classes == dataset.num_classes
                low = dataset.low_resolution
                assert tuple(c.linear.crop_scale) == ((1.0, 1.0) if low else (0.08, 1.0))
            elif evaluator == "knn":
                assert (c.knn.train_split, c.knn.test_split, c.knn.layer) == (*splits, "avgpool")
            elif evaluator == "extract":
                assert tuple(c.extract.splits) == splits and c.extract.layers == ("avgpool",)
            else:
                assert (c.svm.train_split, c.svm.test_split) == splits
                assert c.svm.layers == ("avgpool",) and c.svm.features_dir == ""


def test_bad_presets_name_the_choices():
    with pytest.raises(ValueError, match=r"Unknown transfer dataset 'imagenet'.*cifar10"):
        transfer_config.get_config("imagenet,knn")
    with pytest.raises(ValueError, match=r"<dataset>,<evaluator>.*'linear', 'knn'"):
        transfer_config.get_config("cifar10,finetune")
    with pytest.raises(ValueError, match=r"<dataset>,<evaluator>"):
        transfer_config.get_config("cifar10")


def test_presets_by_tfds_name_on_the_command_line():
    argv = ["jssl", f"--config={REPO}/configs/transfer.py:eurosat/rgb,knn", "--config.knn.k=5"]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=flag_values, sys_argv=argv)
    cli.parse_flags(argv, flag_values)
    c = flag_values["config"].value
    assert (c.data.name, c.knn.train_split, c.knn.test_split, c.knn.k) == (
        "eurosat/rgb",
        "train[:80%]",
        "train[80%:]",
        5,
    )


def test_table_matches_the_tfds_builders():
    with tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_CODE):
        for dataset in transfer.DATASETS:
            features = tfds.builder(dataset.tfds_name).info.features
            image = features[dataset.image_key]
            assert isinstance(image, tfds.features.Image) and image.shape[-1] == 3, dataset.key
            if dataset.multi_label:
                assert transfer.multi_label_classes(features) == dataset.num_classes
                for name in dataset.label_feature.split(","):
                    assert features[name].feature.num_classes == dataset.num_classes
            else:
                assert transfer.multi_label_classes(features) == 0
                assert features[dataset.label_feature].num_classes == dataset.num_classes
            for split in (dataset.train_split, dataset.test_split):
                for part in split.split("+"):
                    assert part.split("[")[0] in dataset.split_sizes, (dataset.key, split)


@pytest.mark.parametrize("key", SINGLE_LABEL)
def test_data_path_on_mock_data(key, tmp_path):
    """The preset's splits resolve to the expected sizes and the metadata's classes, and one
    evaluation batch of the test split, and of a train split that is a sum or a slice (each
    pipeline costs ~0.2 s of tracing; a whole split reads as the test split does), comes
    through jssl's pipeline with labels in range."""
    dataset = transfer.find(key)
    c = transfer_config.get_config(f"{key},knn")
    batch = 4
    with mock_tfds(str(tmp_path), dataset.tfds_name, dict(dataset.split_sizes)):
        splits = (c.knn.train_split, c.knn.test_split)
        assert tuple(data.num_examples(c.data, split) for split in splits) == SIZES[key]
        assert sources.resolve_split(c.data, c.data.test_split).num_classes == dataset.num_classes
        for split in splits[1:] if splits[0] in dataset.split_sizes else splits:
            ds = data.build_eval_dataset(c.data, split, batch_size=batch)
            rows = next(ds.take(1).as_numpy_iterator())
            assert rows["image"].shape == (batch, 224, 224, 3)
            assert np.isfinite(rows["image"]).all() and rows["mask"].all()
            assert rows["index"].tolist() == list(range(batch))
            assert rows["label"].shape == (batch,)
            assert 0 <= rows["label"].min() and rows["label"].max() < dataset.num_classes


@pytest.mark.parametrize("key", ["cifar10", "food101", "dtd"])
def test_linear_training_crops_on_mock_data(key, tmp_path):
    """The linear preset's training view (the same pipeline for every dataset): a
    random-resized crop, or for low-resolution images the whole image, at 224 px; and the
    splits its grid trains, is chosen and is scored on."""
    from jssl.engines import linear_eval_inputs

    dataset = transfer.find(key)
    c = transfer_config.get_config(f"{key},linear")
    with mock_tfds(str(tmp_path), dataset.tfds_name, dict(dataset.split_sizes)):
        splits = linear_eval_inputs.image_splits(c)
        sizes = dataset.split_sizes
        if key == "dtd":  # trainval: train on train, chosen on validation
            assert (splits.train, splits.held_out) == ("train", "validation")
            assert (splits.num_train, splits.num_held_out) == (sizes["train"], sizes["validation"])
        else:  # the last 10% of the train split
            n = sizes[dataset.train_split]
            assert splits.num_train + splits.num_held_out == n
            assert splits.num_held_out == round(0.1 * n)
        train = linear.train_data_config(c.data, c.linear.crop_scale)
        train.batch_size, train.train_subset, train.shuffle_buffer = 4, 4, 4
        rows = next(data.build_train_dataset(train, seed=0, epoch=0).as_numpy_iterator())
    assert rows["crops"][0].shape == (4, 1, 224, 224, 3)
    assert 0 <= rows["label"].min() and rows["label"].max() < dataset.num_classes


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The workdir of a one-epoch run of the tiny MoCo preset on the demo data."""
    from support.runs import tiny_trained_workdir

    return tiny_trained_workdir(tmp_path_factory)


@pytest.mark.slow
def test_knn_preset_end_to_end_on_mock_cifar10(trained, tmp_path):
    """transfer.py:cifar10,knn through jssl.engines.run from a tiny checkpoint, on slices of
    the mocked CIFAR-10 at 16 px: the bank and queries read, every k scored."""
    dataset = transfer.find("cifar10")
    c = transfer_config.get_config("cifar10,knn")
    c.init.checkpoint = trained
    c.knn.train_split, c.knn.test_split = "train[:64]", "test[:32]"
    c.data.image_size, c.knn.batch_size = 16, 16
    with mock_tfds(str(tmp_path / "tfds"), dataset.tfds_name, dict(dataset.split_sizes)):
        results = engines.run(c, str(tmp_path / "knn"))
    assert (results["num_train"], results["num_test"], results["layer"]) == (64, 32, "avgpool")
    for k in c.knn.ks:
        assert 0.0 <= results[f"k{k}"]["top1"] <= results[f"k{k}"]["top5"] <= 100.0
