"""The grain pipeline against tf.data: the same examples in the same rows for every process and
step, mid-epoch resume and across epochs, the same decoded pixels of a PNG folder, the same crop
boxes, flips and step seeds for the same keys (the numpy pipeline's, and tf.data's with
data.augment.on_device), unreadable images replaced as tf.data replaces them, evaluation
splits read once with the mask, and worker processes making the batches of threads."""

import os
import signal

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

import jssl.data as data
from jssl.data import grain_pipeline, keyed_crops, pil_images, sources


def _write_folder(root, classes=3, per_class=9, split="train"):
    """PNGs of varied shapes (some grey, one RGBA): dataset index i is the i-th sorted file."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        os.makedirs(root / split / f"class{c}")
        for i in range(per_class):
            pixels = rng.integers(0, 255, (12 + i, 15 + c, 3), dtype=np.uint8)
            image = Image.fromarray(pixels)
            if i == 1:
                image = image.convert("L")
            if i == 2:
                image = image.convert("RGBA")
            image.save(root / split / f"class{c}" / f"{i}.png")
    return sources.list_image_folder(str(root), split)[0]


def _config(root, loader, **overrides):
    config = data.default_config()
    config.update(dict(source="folder", data_dir=str(root), image_size=8, batch_size=6))
    config.update(dict(loader=loader, workers=0))
    config.augment.on_device = True
    config.update(overrides)
    return config


def _epoch(config, process_count=2, **kwargs):
    return [
        list(
            data.build_train_dataset(
                config, process_index=p, process_count=process_count, **kwargs
            ).as_numpy_iterator()
        )
        for p in range(process_count)
    ]


def _column(batches, key):
    return np.concatenate([b[key] for b in batches])


@pytest.mark.parametrize("process_count", [1, 2, 3])
def test_same_rows_as_tf_data(tmp_path, process_count):
    _write_folder(tmp_path)
    kwargs = dict(process_count=process_count, seed=4, epoch=1)
    grain = _epoch(_config(tmp_path, "grain"), **kwargs)
    tf_data = _epoch(_config(tmp_path, "tf"), **kwargs)
    for g, t in zip(grain, tf_data, strict=True):
        assert len(g) == len(t) == 27 // 6
        for key in ("index", "label", "replaced"):
            np.testing.assert_array_equal(_column(g, key), _column(t, key))
        assert g[0]["crops"][0].dtype == np.uint8 and g[0]["aug_seeds"][0].dtype == np.uint32
        assert g[0]["crops"][0].shape == t[0]["crops"][0].shape
        assert g[0]["aug_seeds"][0].shape == t[0]["aug_seeds"][0].shape
    # The global batch is the epoch order's row, whatever the process count.
    order = data.epoch_order(27, 6, seed=4, epoch=1)
    glued = np.concatenate([np.stack([b["index"] for b in g]) for g in grain], axis=1)
    np.testing.assert_array_equal(glued, order)


def test_resume_and_run_batches_replay_the_epochs(tmp_path):
    _write_folder(tmp_path)
    config = _config(tmp_path, "grain")
    full = [_epoch(config, seed=1, epoch=e) for e in range(2)]
    tail = _epoch(config, seed=1, epoch=0, start_step=3)
    for p in range(2):
        run = list(
            grain_pipeline.run_batches(
                config,
                seed=1,
                first_epoch=0,
                start_step=3,
                num_epochs=2,
                process_index=p,
                process_count=2,
            )
        )
        expected = [(0, 3, full[0][p][3])] + [(1, t, b) for t, b in enumerate(full[1][p])]
        assert [(e, t) for e, t, _ in run] == [(e, t) for e, t, _ in expected]
        for (_, _, got), (_, _, want) in zip(run, expected, strict=True):
            np.testing.assert_array_equal(got["crops"][0], want["crops"][0])
            np.testing.assert_array_equal(got["aug_seeds"][0], want["aug_seeds"][0])
        np.testing.assert_array_equal(tail[p][0]["crops"][0], full[0][p][3]["crops"][0])


def test_worker_processes_make_the_threads_batches(tmp_path):
    _write_folder(tmp_path)
    threads = _epoch(_config(tmp_path, "grain"), 1, seed=2, epoch=0)[0]
    workers = _epoch(_config(tmp_path, "grain", workers=2), 1, seed=2, epoch=0)[0]
    assert len(threads) == len(workers)
    for a, b in zip(threads, workers, strict=True):
        for key in ("index", "label"):
            np.testing.assert_array_equal(a[key], b[key])
        np.testing.assert_array_equal(a["crops"][0], b["crops"][0])


def test_png_pixels_match_tf_decode(tmp_path):
    paths = _write_folder(tmp_path)
    for path in paths:
        ours = np.asarray(pil_images.open_rgb(path, path))
        with open(path, "rb") as f:
            theirs = tf.io.decode_image(f.read(), channels=3, expand_animations=False).numpy()
        np.testing.assert_array_equal(ours, theirs)


def test_eval_split_read_once_padded_and_close_to_tf_data(tmp_path):
    _write_folder(tmp_path)
    _write_folder(tmp_path, per_class=4, split="test")  # 12 examples over 2 processes of 5
    got, want = [], []
    for p in range(2):
        for loader, out in (("grain", got), ("tf", want)):
            config = _config(tmp_path, loader, image_size=16)
            ds = data.build_eval_dataset(
                config, "test", batch_size=10, process_index=p, process_count=2
            )
            out.append(list(ds.as_numpy_iterator()))
    for g, t in zip(got, want, strict=True):
        assert len(g) == len(t) == 2
        for key in ("index", "label", "mask"):
            np.testing.assert_array_equal(_column(g, key), _column(t, key))
        # The same resize up to Pillow's uint8 rounding: a unit of 255, over the std.
        np.testing.assert_allclose(_column(g, "image"), _column(t, "image"), atol=0.05)
    indices = np.concatenate([_column(g, "index") for g in got])
    assert sorted(indices[indices >= 0].tolist()) == list(range(12))


def test_crops_follow_the_numpy_pipelines_keys():
    # The demo data: the numpy pipeline crops with numpy, grain with Pillow, from the same words.
    config = data.default_config()
    config.update(dict(source="demo", image_size=16, batch_size=8, train_subset=32))
    config.augment.update(dict(num_crops=(2, 2), crop_sizes=(16, 8)))
    batches = {}
    for loader in ("numpy", "grain"):
        config.loader = loader
        batches[loader] = list(
            data.build_train_dataset(config, seed=3, epoch=2).as_numpy_iterator()
        )
    for a, b in zip(batches["numpy"], batches["grain"], strict=True):
        np.testing.assert_array_equal(a["index"], b["index"])
        for g in range(2):
            np.testing.assert_array_equal(a["aug_seeds"][g], b["aug_seeds"][g])
            diff = np.abs(a["crops"][g].astype(int) - b["crops"][g].astype(int))
            assert diff.max() <= 3 and diff.mean() < 0.5, (diff.max(), diff.mean())


def test_box_is_the_keyed_draws(tmp_path):
    # The same words give the same box: a crop of an image of distinct pixels is its box.
    words = keyed_crops.view_words(0, 0, 5, 1)
    height, width = 40, 30
    group = data.crop_groups(data.default_config())[0]._replace(size=8, flip_prob=0.0)
    augment = data.default_config().augment
    draw = keyed_crops.crop_draw(words, height, width, group, augment.crop_ratio)
    top, _, h, _ = draw.box
    rows = np.repeat(np.arange(height, dtype=np.uint8)[:, None], width, axis=1)
    image = Image.fromarray(np.stack([rows, rows, rows], axis=-1))
    crop, seeds = grain_pipeline.host_view(image, words, group, augment, finish=False)
    np.testing.assert_array_equal(seeds, words[:6].reshape(3, 2))
    # Row values run top .. top + h - 1 inside the box, resized: first and last rows near them.
    assert abs(int(crop[0, 0, 0]) - top) <= max(1, h // 8)
    assert abs(int(crop[-1, 0, 0]) - (top + h - 1)) <= max(1, h // 8)


def test_same_crops_and_seeds_as_tf_data_on_device(tmp_path):
    # data.augment.on_device: tf.data draws jssl.data.keyed_crops's boxes, flips and seeds too,
    # so the batches differ only by the resize's rounding (TensorFlow's against Pillow's).
    _write_folder(tmp_path)
    kwargs = dict(process_count=1, seed=2, epoch=3)
    overrides = dict(image_size=12)
    grain = _epoch(_config(tmp_path, "grain", **overrides), **kwargs)[0]
    tf_data = _epoch(_config(tmp_path, "tf", **overrides), **kwargs)[0]
    for g, t in zip(grain, tf_data, strict=True):
        np.testing.assert_array_equal(g["index"], t["index"])
        np.testing.assert_array_equal(g["aug_seeds"][0], t["aug_seeds"][0])
        diff = np.abs(g["crops"][0].astype(int) - t["crops"][0].astype(int))
        assert diff.max() <= 3 and diff.mean() < 0.5, (diff.max(), diff.mean())


def test_unreadable_images_replaced_as_tf_data_does(tmp_path, caplog):
    paths = _write_folder(tmp_path)
    order = data.epoch_order(27, 6, seed=0, epoch=0)
    stream = data.process_order(order, 0, 2)
    bad = {int(stream[1]), int(stream[-1])}
    for i in bad:
        with open(paths[i], "wb") as f:
            f.write(b"not a png")
    grain = _epoch(_config(tmp_path, "grain", skip_corrupt=True), seed=0, epoch=0)
    tf_data = _epoch(_config(tmp_path, "tf", skip_corrupt=True), seed=0, epoch=0)
    for g, t in zip(grain, tf_data, strict=True):
        for key in ("index", "label", "replaced"):
            np.testing.assert_array_equal(_column(g, key), _column(t, key))
    assert _column(grain[0], "replaced").sum() == 2
    assert "skipped unreadable image" in caplog.text
    with pytest.raises(
        ValueError, match=r"Unreadable or corrupt image file: .*\.png.*skip_corrupt"
    ):
        _epoch(_config(tmp_path, "grain"), seed=0, epoch=0)


def test_unreadable_eval_image_is_masked_or_named(tmp_path):
    _write_folder(tmp_path)
    paths = _write_folder(tmp_path, per_class=2, split="test")
    with open(paths[3], "wb") as f:
        f.write(b"garbage")
    config = _config(tmp_path, "grain", skip_corrupt=True)
    (ds,) = [data.build_eval_dataset(config, "test", batch_size=4)]
    batches = list(ds.as_numpy_iterator())
    index = _column(batches, "index")
    assert 3 not in index.tolist() and _column(batches, "mask").sum() == 5
    config.skip_corrupt = False
    with pytest.raises(ValueError, match=r"Unreadable or corrupt image file: .*1\.png"):
        list(data.build_eval_dataset(config, "test", batch_size=4).as_numpy_iterator())


def test_tfrecord_tfds_refused_with_the_fix(monkeypatch):
    source = sources.SplitSource(kind="tfds", split="train", num_examples=4)
    with pytest.raises(ValueError, match="--file_format=array_record"):
        grain_pipeline._check_readable(source)


def test_workers_default_and_validation():
    config = data.default_config()
    assert 1 <= grain_pipeline.num_workers(config) <= 32
    config.workers = 3
    assert grain_pipeline.num_workers(config) == 3
    config.workers = -2
    with pytest.raises(ValueError, match="data.workers"):
        grain_pipeline.num_workers(config)


def test_workers_outlive_a_group_sigterm_and_ctrl_c(tmp_path):
    # A scheduler's SIGTERM (or a Ctrl-C) reaches the whole process group: the workers keep
    # making the batches the training process needs to save and stop.
    import psutil

    _write_folder(tmp_path)
    config = _config(tmp_path, "grain", workers=1, batch_size=3)
    batches = iter(data.build_train_dataset(config, seed=0, epoch=0).as_numpy_iterator())
    first = next(batches)
    (worker,) = [
        child
        for child in psutil.Process().children()
        if "spawn_main" in " ".join(child.cmdline()) and "resource_tracker" not in child.cmdline()
    ]
    worker.send_signal(signal.SIGTERM)
    worker.send_signal(signal.SIGINT)
    rest = list(batches)
    assert len(rest) == 27 // 3 - 1 and first["index"].shape == (3,)
