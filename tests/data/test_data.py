"""Data pipelines: determinism, sharding, resume, eval padding, and the three sources."""

import logging
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from PIL import Image
from support.launch import prepare_shared_dirs

import jssl.data as data


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    # The session's demo dataset (generated once, shared with the other test files).
    return prepare_shared_dirs(tmp_path_factory)[0]


def _config(data_dir, **overrides):
    config = data.default_config()
    config.update(
        dict(data_dir=data_dir, image_size=16, batch_size=8, train_subset=48, shuffle_buffer=64)
    )
    config.update(overrides)
    return config


def _batches(ds):
    return list(ds.as_numpy_iterator())


def _views_by_index(batches):
    return {
        int(i): tuple(g[row, j] for g in b["crops"] for j in range(g.shape[1]))
        for b in batches
        for row, i in enumerate(b["index"])
    }


def test_demo_builder_balanced(demo_dir):
    from jssl.data import demo

    data.num_examples(_config(demo_dir), "test")  # prepares it on first use
    builder = tfds.builder("jssl_demo", data_dir=demo_dir)
    assert builder.is_prepared()
    assert {k: v.num_examples for k, v in builder.info.splits.items()} == demo.SPLIT_SIZES
    ds = builder.as_dataset(split="train", decoders={"image": tfds.decode.SkipDecoding()})
    labels = np.array([int(x) for x in ds.map(lambda ex: ex["label"]).as_numpy_iterator()])
    assert np.bincount(labels).tolist() == [800] * 10
    image, label = demo.make_example("train", 5)
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8 and label == 5
    np.testing.assert_array_equal(image, demo.make_example("train", 5)[0])


def test_train_epoch_shapes_and_counts(demo_dir):
    config = _config(demo_dir)
    assert data.num_examples(config, "train") == 48
    assert data.steps_per_epoch(config, 2) == 6
    batches = _batches(data.build_train_dataset(config, seed=0, epoch=0))
    assert len(batches) == 6
    batch = batches[0]
    assert len(batch["crops"]) == 1  # one crop group of two crops
    assert batch["crops"][0].shape == (8, 2, 16, 16, 3) and batch["crops"][0].dtype == np.float32
    assert batch["label"].dtype == np.int32 and batch["index"].dtype == np.int64
    assert batch["replaced"].dtype == bool and not batch["replaced"].any()
    assert not np.allclose(batch["crops"][0][:, 0], batch["crops"][0][:, 1])
    indices = np.concatenate([b["index"] for b in batches])
    assert sorted(indices) == list(range(48))
    # Demo labels are index % 10 (generation order is kept on disk).
    np.testing.assert_array_equal(batch["label"], batch["index"] % 10)


def test_pipelines_are_deterministic_and_run_no_autotuning_thread(demo_dir):
    # Deleting an iterator waits for tf.data's autotuning thread, which sleeps up to 60 s:
    # every epoch and test phase drops one (see pipeline._options).
    config = _config(demo_dir)
    for ds in (
        data.build_train_dataset(config, seed=0, epoch=0),
        data.build_eval_dataset(config, "test", batch_size=8),
    ):
        options = ds.options()
        assert options.deterministic is True and options.autotune.enabled is False


def test_crops_depend_only_on_seed_epoch_index(demo_dir):
    # Multi-crop: two groups of different sizes; every crop of an example is a function of
    # (seed, epoch, index) only, whatever the process count.
    config = _config(demo_dir)
    config.augment.update(dict(num_crops=(2, 3), crop_sizes=(16, 8)))
    one = _batches(data.build_train_dataset(config, seed=3, epoch=1))
    two = [
        _batches(
            data.build_train_dataset(config, seed=3, epoch=1, process_index=p, process_count=2)
        )
        for p in range(2)
    ]
    assert [len(b) for b in two] == [6, 6]
    assert [g.shape for g in two[0][0]["crops"]] == [(4, 2, 16, 16, 3), (4, 3, 8, 8, 3)]
    shards = [set(_views_by_index(b)) for b in two]
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(48))
    views_one = _views_by_index(one)
    for batches in two:
        for index, views in _views_by_index(batches).items():
            for a, b in zip(views, views_one[index], strict=True):
                np.testing.assert_array_equal(a, b)
    other_epoch = _views_by_index(_batches(data.build_train_dataset(config, seed=3, epoch=2)))
    assert not np.allclose(other_epoch[0][0], views_one[0][0])
    assert [b["index"].tolist() for b in one] != [
        b["index"].tolist() for b in _batches(data.build_train_dataset(config, seed=3, epoch=2))
    ]


@pytest.mark.parametrize("cache", [False, True])
def test_start_step_is_the_tail_of_the_epoch(demo_dir, cache):
    config = _config(demo_dir, cache=cache)
    full = _batches(data.build_train_dataset(config, seed=1, epoch=4))
    tail = _batches(data.build_train_dataset(config, seed=1, epoch=4, start_step=4))
    assert len(tail) == 2
    for a, b in zip(full[4:], tail, strict=True):
        np.testing.assert_array_equal(a["index"], b["index"])
        np.testing.assert_array_equal(a["crops"][0], b["crops"][0])


def test_eval_exactly_once_with_padding(demo_dir):
    config = _config(demo_dir)
    per_process = [
        _batches(
            data.build_eval_dataset(config, "test", batch_size=96, process_index=p, process_count=3)
        )
        for p in range(3)
    ]
    assert {len(b) for b in per_process} == {21}  # ceil(667 / 32) on every process
    batches = [b for bs in per_process for b in bs]
    assert batches[0]["image"].shape == (32, 16, 16, 3)
    indices = np.concatenate([b["index"][b["mask"]] for b in batches])
    assert sorted(indices.tolist()) == list(range(2000))
    padding = np.concatenate([b["index"][~b["mask"]] for b in batches])
    assert len(padding) == 3 * 21 * 32 - 2000 and (padding == -1).all()


@pytest.mark.parametrize("name", ["cifar10", "imagenet2012"])
def test_tfds_mock_data(name, tmp_path):
    config = _config(str(tmp_path), source="tfds", name=name, batch_size=4, train_subset=-1)
    split = "validation" if name == "imagenet2012" else "test"
    with tfds.testing.mock_data(num_examples=10):
        assert data.steps_per_epoch(config) == 2
        batches = _batches(data.build_train_dataset(config, seed=0, epoch=0))
        evals = _batches(data.build_eval_dataset(config, split, batch_size=4))
    assert len(batches) == 2 and batches[0]["crops"][0].shape == (4, 2, 16, 16, 3)
    assert len(evals) == 3 and evals[-1]["mask"].tolist() == [True, True, False, False]


def _write_folder(root, corrupt=False):
    rng = np.random.default_rng(0)
    files = {
        "cat": [("a.png", (20, 30), "RGB"), ("b.jpg", (40, 24), "L"), ("c.png", (17, 17), "RGBA")],
        "dog": [("a.jpg", (33, 21), "RGB"), ("b.png", (16, 48), "L")],
    }
    for split in ("train", "val"):
        for cls, items in files.items():
            os.makedirs(root / split / cls)
            for name, (w, h), mode in items:
                pixels = rng.integers(0, 255, (h, w, len(mode)), dtype=np.uint8).squeeze()
                Image.fromarray(pixels, mode).save(root / split / cls / name)
    (root / "train" / "dog" / "notes.txt").write_text("not an image")
    if corrupt:
        bad = root / "val" / "dog" / "c_bad.jpg"
        bad.write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
        return str(bad)


def _cols(batch):
    return batch["index"], batch["label"], batch["mask"]


def test_folder_source(tmp_path, caplog):
    _write_folder(tmp_path)
    config = _config(str(tmp_path), source="folder", batch_size=2, train_subset=-1)
    assert data.num_examples(config, "train") == 5 and data.steps_per_epoch(config) == 2
    with caplog.at_level(logging.WARNING, logger="tensorflow"):
        batches = _batches(data.build_train_dataset(config, seed=0, epoch=0))
    # Every function of the pipeline converts (two lambdas on one line had not: a warning a run).
    assert not [r for r in caplog.records if "AutoGraph could not" in r.getMessage()]
    assert len(batches) == 2 and batches[0]["crops"][0].shape == (2, 2, 16, 16, 3)
    evals = _batches(data.build_eval_dataset(config, "val", batch_size=2))
    assert len(evals) == 3
    rows = [(i, lab) for b in evals for i, lab, m in zip(*_cols(b), strict=True) if m]
    assert rows == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1)]  # classes and files sorted


# Folders are read by grain (the default) or tf.data; both name the file and count the rows.
FOLDER_ERRORS = {"grain": ValueError, "tf": tf.errors.InvalidArgumentError}


@pytest.mark.parametrize("loader", sorted(FOLDER_ERRORS))
def test_folder_corrupt_image_named(tmp_path, loader):
    bad = _write_folder(tmp_path, corrupt=True)
    config = _config(str(tmp_path), source="folder", batch_size=2, train_subset=-1, loader=loader)
    with pytest.raises(FOLDER_ERRORS[loader], match="c_bad.jpg.*skip_corrupt"):
        _batches(data.build_eval_dataset(config, "val", batch_size=2))
    config.train_split = "val"
    with pytest.raises(FOLDER_ERRORS[loader], match=bad):
        _batches(data.build_train_dataset(config, seed=0, epoch=0))


@pytest.mark.parametrize("loader", sorted(FOLDER_ERRORS))
def test_folder_skip_corrupt_counts(tmp_path, capfd, caplog, loader):
    _write_folder(tmp_path, corrupt=True)
    config = _config(
        str(tmp_path), source="folder", skip_corrupt=True, train_subset=-1, loader=loader
    )
    evals = _batches(data.build_eval_dataset(config, "val", batch_size=4))
    assert sum(int(b["mask"].sum()) for b in evals) == 5
    # tf.data prints its warnings; grain logs them (from its worker processes, to their stderr).
    assert "skipped unreadable image" in capfd.readouterr().err + caplog.text
    config.update(dict(train_split="val", batch_size=3))
    batches = _batches(data.build_train_dataset(config, seed=0, epoch=0))
    assert len(batches) == 2  # 6 files, one unreadable: the epoch still has 6 // 3 batches
    assert sum(int(b["replaced"].sum()) for b in batches) == 1  # its row, flagged
    assert "c_bad.jpg" in capfd.readouterr().err + caplog.text


def test_missing_data_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.num_examples(_config(str(tmp_path / "nope"), source="folder"), "train")
    with pytest.raises(FileNotFoundError, match="not prepared.*tfds build"):
        data.num_examples(_config(str(tmp_path), source="tfds", name="cifar10"), "train")
    with pytest.raises(ValueError, match="Unknown TFDS dataset"):
        data.num_examples(_config(str(tmp_path), source="tfds", name="no_such_set"), "train")
    with pytest.raises(ValueError, match="not divisible"):
        data.steps_per_epoch(_config(str(tmp_path), batch_size=9), process_count=2)


def test_shard_bounds_cover():
    for n, pc in [(10, 3), (2, 4), (7, 1)]:
        bounds = [data.shard_bounds(n, pc, p) for p in range(pc)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
