"""The demo data's numpy pipeline against the tf.data one: the same images, order, batch layout
and padding; crops that follow the same distributions; and which pipeline a config gets."""

import logging

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from support.launch import prepare_shared_dirs

import jssl.data as data
from jssl.data import (
    backend,
    crops,
    demo,
    device_augment,
    keyed_crops,
    numpy_pipeline,
    sources,
    transforms,
)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return prepare_shared_dirs(tmp_path_factory)[0]


def _config(data_dir, pipeline: str, **overrides):
    config = data.default_config()
    config.update(
        dict(
            data_dir=data_dir,
            image_size=16,
            batch_size=8,
            train_subset=48,
            cache=True,  # the tf.data pipeline's exact order, which the numpy one always has
            loader=pipeline,
        )
    )
    config.update(overrides)
    return config


def _layout(batch: dict) -> dict:
    return {
        key: tuple((v.shape, v.dtype) for v in value)
        if isinstance(value, tuple)
        else (value.shape, value.dtype)
        for key, value in batch.items()
    }


@pytest.mark.parametrize("process_count,start_step", [(1, 0), (2, 0), (2, 4)])
def test_same_indices_and_layout_as_tf_data(demo_dir, process_count, start_step):
    batches = {}
    for pipeline in ("tf", "numpy"):
        config = _config(demo_dir, pipeline)
        config.augment.update(dict(num_crops=(2, 3), crop_sizes=(16, 8), on_device=True))
        batches[pipeline] = [
            list(
                data.build_train_dataset(
                    config,
                    seed=3,
                    epoch=1,
                    start_step=start_step,
                    process_index=p,
                    process_count=process_count,
                ).as_numpy_iterator()
            )
            for p in range(process_count)
        ]
    for ours, theirs in zip(batches["numpy"], batches["tf"], strict=True):
        assert len(ours) == len(theirs) == 6 - start_step
        for a, b in zip(ours, theirs, strict=True):
            assert _layout(a) == _layout(b)
            np.testing.assert_array_equal(a["index"], b["index"])
            np.testing.assert_array_equal(a["label"], b["label"])
            assert not a["replaced"].any()


def test_the_images_are_the_tfds_builders(demo_dir):
    builder = tfds.builder(sources.DEMO_NAME, data_dir=demo_dir)
    stored = list(builder.as_dataset(split="test[:40]").as_numpy_iterator())
    images, labels = demo.split_images("test", 40)
    np.testing.assert_array_equal(images, np.stack([ex["image"] for ex in stored]))
    np.testing.assert_array_equal(labels, [ex["label"] for ex in stored])


def test_eval_batches_match_tf_data(demo_dir):
    config = {p: _config(demo_dir, p) for p in ("tf", "numpy")}
    for process_index in range(3):  # shards of 17, 17, 16 in batches of 4: padding rows
        batches = {
            p: list(
                data.build_eval_dataset(
                    config[p],
                    "test[:50]",
                    batch_size=12,
                    process_index=process_index,
                    process_count=3,
                ).as_numpy_iterator()
            )
            for p in config
        }
        assert len(batches["numpy"]) == len(batches["tf"]) == 5
        for a, b in zip(batches["numpy"], batches["tf"], strict=True):
            assert _layout(a) == _layout(b)
            for key in ("index", "label", "mask"):
                np.testing.assert_array_equal(a[key], b[key])
            np.testing.assert_allclose(a["image"], b["image"], atol=1e-4)


@pytest.mark.parametrize(
    "shape", [(17, 25, 16, 16), (32, 32, 16, 16), (9, 31, 32, 32), (40, 50, 224, 96)]
)
def test_resize_is_tf_bilinear_with_antialiasing(shape):
    h, w, out_h, out_w = shape
    image = np.random.RandomState(0).uniform(0, 255, (h, w, 3)).astype(np.float32)
    expected = tf.image.resize(image, (out_h, out_w), "bilinear", antialias=True).numpy()
    np.testing.assert_allclose(numpy_pipeline.resize(image, out_h, out_w), expected, atol=2e-3)


@pytest.mark.parametrize("shape", [(12, 30), (16, 16), (20, 16), (48, 64), (33, 90)])
def test_eval_image_is_tf_datas(shape):
    from jssl.data import transforms

    image = np.random.RandomState(1).uniform(0, 255, (*shape, 3)).astype(np.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    expected = transforms.eval_image(tf.constant(image, tf.float32) / 255.0, 16, mean, std)
    got = numpy_pipeline.eval_image(image, 16, mean, std)
    np.testing.assert_allclose(got, expected.numpy(), atol=2e-3)


def test_crop_boxes_follow_tf_distribution():
    scale, ratio, n = (0.2, 1.0), (3 / 4, 4 / 3), 1500
    ours, theirs = [], []
    for i in range(n):
        begin, size = transforms.crop_window(tf.constant([32, 32, 3]), [i, 7], scale, ratio)
        theirs.append((*begin.numpy()[:2], *size.numpy()[:2]))
        draws = (keyed_crops.view_words(0, 0, i, 0)[7:] / 2.0**32).tolist()
        ours.append(keyed_crops.crop_window(32, 32, scale, ratio, draws))
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    for boxes in (ours, theirs):
        assert (boxes[:, :2] >= 0).all() and (boxes[:, :2] + boxes[:, 2:] <= 32).all()
    area = lambda b: b[:, 2] * b[:, 3] / 1024  # noqa: E731
    assert abs(area(ours).mean() - area(theirs).mean()) < 0.025  # ~5 standard errors
    assert abs(area(ours).std() - area(theirs).std()) < 0.025
    aspect = lambda b: np.log(b[:, 3] / b[:, 2])  # noqa: E731
    assert abs(aspect(ours).mean() - aspect(theirs).mean()) < 0.02
    np.testing.assert_allclose(ours[:, :2].mean(0), theirs[:, :2].mean(0), atol=0.5)


def test_views_depend_only_on_seed_epoch_index(demo_dir):
    config = _config(demo_dir, "numpy")

    def views(**kwargs):
        out = {}
        for batch in data.build_train_dataset(config, seed=5, epoch=2, **kwargs):
            for row, index in enumerate(batch["index"]):
                out[int(index)] = (batch["crops"][0][row], batch["aug_seeds"][0][row])
        return out

    one = views()
    two = {**views(process_index=0, process_count=2), **views(process_index=1, process_count=2)}
    assert sorted(one) == sorted(two) == list(range(48))
    for index, (crop, seed) in one.items():
        np.testing.assert_array_equal(crop, two[index][0])
        np.testing.assert_array_equal(seed, two[index][1])
    crop, seed = one[0]
    assert crop.shape == (2, 16, 16, 3) and not np.array_equal(crop[0], crop[1])
    assert not np.array_equal(seed[0], seed[1])


def test_the_step_makes_the_views_unless_crop_and_flip_are_all(demo_dir):
    config = _config(demo_dir, "numpy")
    assert backend.views_on_device(config)
    assert device_augment.make_batch_augment(config) is not None
    batch = data.synthetic_batch(config, 4)
    assert batch["crops"][0].dtype == np.uint8 and "aug_seeds" in batch
    # The linear heads' images: crop and flip only, so the host makes float views.
    for field in crops.PROB_FIELDS[1:]:
        config.augment[field] = (0.0,)
    assert not backend.views_on_device(config)
    assert device_augment.make_batch_augment(config) is None
    (batch,) = list(data.build_train_dataset(config, seed=0, epoch=0, start_step=5))
    assert "aug_seeds" not in batch and batch["crops"][0].dtype == np.float32
    assert batch["crops"][0].shape == (8, 2, 16, 16, 3)
    assert -2.2 < batch["crops"][0].min() < batch["crops"][0].max() < 2.7  # normalised
    # tf.data keeps data.augment.on_device's meaning.
    assert not backend.views_on_device(_config(demo_dir, "tf"))


def test_which_pipeline(demo_dir, monkeypatch, caplog):
    config = _config(demo_dir, "auto")
    assert backend.resolve(config) == "tf"  # TensorFlow is installed here
    monkeypatch.setattr(backend, "tensorflow_available", lambda: False)
    with caplog.at_level(logging.INFO):
        assert backend.resolve(config) == "numpy"
    assert data.num_examples(config, "train") == 48
    assert data.num_examples(config, "test[10%:-10%]") == 1600
    assert data.train_order(config).startswith("exact")
    config.source = "folder"
    assert backend.resolve(config) == "grain"  # folders and ArrayRecord TFDS without TF
    config.loader = "tf"
    with pytest.raises(ImportError, match="tensorflow.*grain"):
        data.build_eval_dataset(config, "test", batch_size=8)
    config.loader = "numpy"
    with pytest.raises(ValueError, match='data.loader="numpy" reads only the built-in demo'):
        backend.resolve(config)
    config.loader = "jax"
    with pytest.raises(ValueError, match="data.loader='jax'"):
        backend.resolve(config)


@pytest.mark.parametrize(
    "split",
    [
        "train",
        "train[:10]",
        "train[10:]",
        "train[-100:]",
        "train[:-1]",
        "test[:10%]",
        "test[33%:67%]",
        "test[-10%:]",
        "train[1_000:2_000]",
        "test[12.5%:]",
    ],
)
def test_slices_as_tfds_reads_them(split):
    sizes = {"train": 8000, "test": 2000}
    infos = {
        k: tfds.core.SplitInfo(name=k, shard_lengths=[v], num_bytes=0) for k, v in sizes.items()
    }
    (absolute,) = tfds.core.ReadInstruction.from_spec(split).to_absolute(infos)
    start = absolute.from_ or 0
    end = sizes[absolute.splitname] if absolute.to is None else absolute.to
    assert sources.slice_bounds(split, sizes) == (absolute.splitname, start, end)


@pytest.mark.parametrize("split", ["train[", "train[5]", "train[:9000]", "train+test", "x[:2]"])
def test_bad_slices_say_how_to_write_them(demo_dir, split):
    config = _config(demo_dir, "numpy")
    with pytest.raises(ValueError, match="train"):
        data.num_examples(config, split)
