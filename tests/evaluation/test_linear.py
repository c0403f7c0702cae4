"""Tests of the linear heads (evaluation.linear) and the linear_eval engine on cached features."""

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from support.launch import scalar_values

from configs import linear_eval as linear_eval_config
from configs import moco
from jssl import engines, models, optim, parallel
from jssl.engines import linear_eval
from jssl.evaluation import linear, linear_grid


def _write_features(directory, split, layer, feats, labels):
    os.makedirs(os.path.join(directory, split), exist_ok=True)
    prefix = os.path.join(directory, split, f"{layer}_")
    np.save(prefix + "features.npy", feats.astype(np.float32))
    np.save(prefix + "targets.npy", labels.astype(np.int64))
    np.save(prefix + "inds.npy", np.arange(len(labels), dtype=np.int64))


def _blobs(rng, n, num_classes, shape, spread):
    """Gaussian blobs: class c is centred on a random point, well separated."""
    centres = np.random.default_rng(123).normal(size=(num_classes, *shape)) * 3.0
    labels = rng.integers(0, num_classes, n)
    feats = centres[labels] + spread * rng.normal(size=(n, *shape))
    return feats, labels


@pytest.fixture(scope="module")
def blob_features(tmp_path_factory):
    """Cached features of two layers in extract_features' layout: a pooled map and a
    vector, 4 classes of separable Gaussian blobs."""
    directory = str(tmp_path_factory.mktemp("features"))
    rng = np.random.default_rng(0)
    for split, n in (("train", 256), ("test", 100)):
        labels = None
        for layer, shape in (("res5", (2, 2, 8)), ("avgpool", (16,))):
            if labels is None:
                feats, labels = _blobs(rng, n, 4, shape, 0.5)
            else:
                centres = np.random.default_rng(7).normal(size=(4, *shape)) * 3.0
                feats = centres[labels] + 0.5 * rng.normal(size=(n, *shape))
            _write_features(directory, split, layer, feats, labels)
    return directory


def _cached_config(features_dir) -> ml_collections.ConfigDict:
    config = linear_eval_config.get_config("test")
    config.linear.layers = ("res5", "avgpool")
    config.linear.cached_features = features_dir
    config.linear.num_classes = 4
    config.data.train_split = "train"
    config.data.test_split = "test"
    config.data.train_subset = -1
    config.data.batch_size = 32
    config.num_epochs = 4
    config.optim.base_lr = 0.5
    config.optim.schedule = "cosine"
    config.optim.update_interval = "step"
    config.log_every_steps = 4
    return config


def test_heads_learn_separable_blobs_and_resume(blob_features, tmp_path):
    workdir = str(tmp_path / "linear")
    summary = linear_eval.run(_cached_config(blob_features), workdir)
    with open(os.path.join(workdir, "results.json")) as f:
        record = json.load(f)
    assert record["evaluator"] == "linear" and set(record["layers"]) == {"res5", "avgpool"}
    assert record == summary["record"]
    for layer in ("res5", "avgpool"):
        results = record["layers"][layer]
        assert results["top1"] == pytest.approx(100.0), results
        assert results["top5"] == pytest.approx(100.0)
        assert {k: results[k] for k in ("top1", "top5")} == summary["results"][layer]
        assert results["selection"].startswith("none: a one-point grid")
        assert [p["lr"] for p in results["grid"]] == [0.5] and results["grid"][0]["chosen"]
    assert summary["step"] == 4 * (256 // 32)
    assert os.path.isdir(os.path.join(workdir, "checkpoints", str(summary["step"])))

    # A rerun resumes the finished run: no further training, the same results.
    again = linear_eval.run(_cached_config(blob_features), workdir)
    assert again["step"] == summary["step"]
    assert again["results"] == summary["results"]


def _written_steps(workdir, tag) -> list[int]:
    return sorted(scalar_values(os.path.join(workdir, "tensorboard"), tag))


def test_logs_saves_tests_and_resumes_on_schedule(blob_features, tmp_path):
    """8 steps per epoch, 3 epochs: windows of 3 steps and the steps after an epoch's last
    full window, a save every 3 steps and (forced) at each epoch's end, a test phase after
    epoch 2 (the final heads are tested after the loop); stopped at step 10 by
    debug.max_steps, the rerun resumes there and ends as the uninterrupted run does."""

    def config(max_steps=-1):
        c = _cached_config(blob_features)
        c.num_epochs, c.log_every_steps, c.test_every_epochs = 3, 3, 2
        c.checkpoint.every_steps, c.checkpoint.max_to_keep = 3, 0
        c.debug.max_steps = max_steps
        return c

    whole = str(tmp_path / "whole")
    expected = linear_eval.run(config(), whole)
    assert expected["step"] == 24
    assert _written_steps(whole, "train/loss") == [3, 6, 8, 9, 12, 15, 16, 18, 21, 24]
    saved = os.listdir(os.path.join(whole, "checkpoints"))
    assert sorted(int(d) for d in saved if d.isdigit()) == [3, 6, 8, 9, 12, 15, 16, 18, 21, 24]
    assert _written_steps(whole, "test/avgpool/top1") == [16, 24]

    resumed = str(tmp_path / "resumed")
    assert linear_eval.run(config(max_steps=10), resumed)["step"] == 10
    assert _written_steps(resumed, "train/loss") == [3, 6, 8, 9, 10]
    assert _written_steps(resumed, "test/avgpool/top1") == [10]  # the final test only
    summary = linear_eval.run(config(), resumed)
    assert summary["step"] == 24 and summary["results"] == expected["results"]
    assert _written_steps(resumed, "test/avgpool/top1") == [10, 16, 24]
    np.testing.assert_array_equal(
        jax.device_get(summary["state"].params["wd0"]["res5"]["fc"]["kernel"]),
        jax.device_get(expected["state"].params["wd0"]["res5"]["fc"]["kernel"]),
    )


def test_missing_layer_names_the_available_ones(blob_features, tmp_path):
    config = _cached_config(blob_features)
    config.linear.layers = ("res4",)
    with pytest.raises(FileNotFoundError, match="avgpool"):
        linear_eval.run(config, str(tmp_path / "w"))


def test_cached_labels_beyond_num_classes_are_refused_at_start_up(blob_features, tmp_path):
    # 4 classes of blobs, heads for 3: the loss would be NaN from the first step.
    config = _cached_config(blob_features)
    config.linear.num_classes = 3
    workdir = tmp_path / "w"
    with pytest.raises(ValueError, match=r"4 classes but linear.num_classes=3: .*num_classes=4"):
        engines.run(config, str(workdir))
    assert not workdir.exists()


def test_dataset_classes_beyond_num_classes_are_refused_at_start_up(shared_dirs, tmp_path):
    # The trunk path: the demo data's 10 classes, from its metadata, before any trunk runs.
    config = linear_eval_config.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.init.checkpoint = str(tmp_path / "trained")  # not read: the check comes first
    config.linear.num_classes = 3
    workdir = tmp_path / "w"
    with pytest.raises(
        ValueError, match=r"'train' has 10 classes but linear.num_classes=3: .*num_classes=10"
    ):
        engines.run(config, str(workdir))
    assert not workdir.exists()
    config.linear.num_classes = 10
    linear_eval.validate(config)


def test_linear_eval_without_weights_or_features_is_refused(tmp_path):
    config = linear_eval_config.get_config("test")
    with pytest.raises(
        ValueError, match=r"set --config.init.checkpoint .* --config.linear.cached_features"
    ):
        engines.run(config, str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()


def test_frozen_trunk_is_unchanged_and_heads_train():
    model_config = moco.get_config("test").model
    model = models.build_model(model_config)
    images = jax.random.normal(jax.random.PRNGKey(1), (16, 16, 16, 3))
    labels = jnp.arange(16) % 10
    trunk = model.init(jax.random.PRNGKey(0), images[:1], train=False)
    trunk_before = jax.tree.map(np.array, trunk)
    layers = ("res5", "avgpool")

    def features_fn(trunk_variables, inputs):
        taps = model.apply(trunk_variables, inputs, train=False)
        return {layer: taps[layer] for layer in layers}

    shapes = {k: v.shape[1:] for k, v in jax.eval_shape(features_fn, trunk, images).items()}
    heads = linear.LinearHeads(layers, 10, bn_axis_name=parallel.DATA_AXIS)
    config = linear_eval_config.get_config("test")
    config.data.batch_size = 16
    grid_opt = grid_optimizer(config, heads, shapes, steps_per_epoch=5)
    state = linear.init_state(heads, grid_opt, shapes, jax.random.PRNGKey(2))
    heads_before = jax.tree.map(np.array, state.params)
    mesh = parallel.make_mesh()
    step = linear.make_train_step(heads, grid_opt, mesh, features_fn)
    batch = parallel.host_batch_to_global({"inputs": images, "label": labels}, mesh)
    losses = []
    for _ in range(5):
        state, metrics = step(state, trunk, batch)
        losses.append(float(metrics["loss"]))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.array, trunk), trunk_before)
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), heads_before, state.params)
    assert all(jax.tree.leaves(changed))
    assert losses[-1] < losses[0]
    assert int(state.step) == 5


def grid_optimizer(config, heads, shapes, steps_per_epoch):
    """The grid's chains for ``heads`` on features of ``shapes``, as the engine builds them."""
    sample = linear.sample_features(shapes)
    params = jax.eval_shape(lambda: heads.init(jax.random.PRNGKey(0), sample, train=False))
    grid = linear_grid.Grid.from_config(config)
    return linear_grid.GridOptimizer(config, grid, params["params"], steps_per_epoch)


def test_head_bn_is_not_weight_decayed_by_default():
    heads = linear.LinearHeads(("res5",), 3)
    config = linear_eval_config.get_config("")
    grid_opt = grid_optimizer(config, heads, {"res5": (2, 2, 4)}, steps_per_epoch=1)
    state = linear.init_state(heads, grid_opt, {"res5": (2, 2, 4)}, jax.random.PRNGKey(0))
    one_head = jax.tree.map(lambda x: x[0], state.params["wd0"])
    opt = config.optim
    mask = optim.weight_decay_mask(
        one_head, regularize_bn=opt.regularize_bn, regularize_bias=opt.regularize_bias
    )
    assert mask["res5"]["bn"] == {"scale": False, "bias": False}
    assert mask["res5"]["fc"] == {"kernel": True, "bias": True}
    # VISSL eval_mlp: BatchNorm2d over the channels of the pooled map, then Linear; one copy
    # per grid learning rate (the ImageNet preset's five).
    assert state.params["wd0"]["res5"]["bn"]["scale"].shape == (5, 4)
    assert state.params["wd0"]["res5"]["fc"]["kernel"].shape == (5, 16, 3)


def test_cached_batches_split_over_processes_and_cover_the_test_set():
    feats = {"x": np.arange(50, dtype=np.float32)[:, None]}
    labels = np.arange(50) % 3
    per_process = [
        list(
            linear.cached_train_batches(
                feats, labels, batch_size=8, seed=0, epoch=1, process_index=p, process_count=2
            )
        )
        for p in range(2)
    ]
    assert len(per_process[0]) == len(per_process[1]) == 50 // 8
    rows = np.concatenate([b["inputs"]["x"][:, 0] for part in per_process for b in part])
    assert len(np.unique(rows)) == len(rows) == 48
    single = list(linear.cached_train_batches(feats, labels, batch_size=8, seed=0, epoch=1))
    resumed = list(
        linear.cached_train_batches(feats, labels, batch_size=8, seed=0, epoch=1, start_step=4)
    )
    np.testing.assert_array_equal(resumed[0]["inputs"]["x"], single[4]["inputs"]["x"])

    seen = []
    for p in range(2):
        for b in linear.cached_eval_batches(
            feats, labels, batch_size=16, process_index=p, process_count=2
        ):
            assert b["inputs"]["x"].shape == (8, 1) and b["label"].shape == (8,)
            seen.append(b["inputs"]["x"][b["mask"], 0])
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(50))


def test_train_augmentation_is_crop_and_flip_only():
    data_config = moco.get_config("demo").data
    out = linear.train_data_config(data_config, (0.08, 1.0))
    a = out.augment
    assert a.num_crops == (1,) and tuple(a.crop_scale) == (0.08, 1.0) and a.flip_prob == (0.5,)
    assert a.color_jitter_prob == a.grayscale_prob == a.blur_prob == a.solarize_prob == (0.0,)
    assert data_config.augment.num_crops == (2,)  # the original is untouched
