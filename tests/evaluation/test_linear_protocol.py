"""The linear_eval engine's grid runs (engines.linear_eval): the held-out part it chooses on,
the protocol results.json records next to every figure (checked against a numpy evaluation of
the trained heads), the checkpoint step it records, its start-up checks, and the ImageNet
robustness sets on tfds.testing.mock_data."""

import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from test_linear import _cached_config, _write_features, blob_features  # noqa: F401

from configs import linear_eval as linear_eval_config
from jssl import engines, parallel
from jssl.checkpoints import weights
from jssl.data import sources
from jssl.engines import linear_eval
from jssl.engines import linear_eval_inputs as inputs_lib
from jssl.evaluation import robustness_sets


def _head_top1(features, labels, head):
    """Top-1 in % of a head in eval mode (running BN statistics, then Linear), in numpy."""
    x = np.asarray(features, np.float64)
    bn, fc = head["bn"], head["fc"]
    x = (x - bn["mean"]) / np.sqrt(bn["var"] + 1e-5) * bn["scale"] + bn["bias"]
    logits = x.reshape(len(x), -1) @ fc["kernel"] + fc["bias"]
    return 100.0 * float(np.mean(logits.argmax(1) == labels))


def test_grid_chooses_on_the_held_out_part_and_records_its_protocol(blob_features, tmp_path):  # noqa: F811
    config = _cached_config(blob_features)
    config.linear.lrs, config.linear.weight_decays = (0.002, 0.5), (5e-4,)
    config.linear.val_fraction, config.linear.report_all = 0.25, True
    config.num_epochs = 2
    workdir = tmp_path / "grid"
    summary = linear_eval.run(config, str(workdir))
    record = json.loads((workdir / "results.json").read_text())
    assert record == summary["record"] and record["evaluator"] == "linear"
    state = jax.device_get(summary["state"])
    rows = {}
    for split in ("train", "test"):
        for layer in ("res5", "avgpool"):
            prefix = os.path.join(blob_features, split, f"{layer}_")
            rows[split, layer] = np.load(prefix + "features.npy")
        rows[split, "labels"] = np.load(prefix + "targets.npy")
    for layer, entry in record["layers"].items():
        protocol = entry["protocol"]
        assert protocol["train_split"] == "train[0:192]" and protocol["num_train"] == 192
        assert protocol["held_out_split"] == "train[192:256]" and protocol["num_held_out"] == 64
        assert protocol["test_split"] == "test" and protocol["num_test"] == 100
        assert protocol["evaluation"].startswith("offline: frozen trunk")
        assert protocol["source"]["features_dir"] == os.path.abspath(blob_features)
        training = protocol["training"]
        assert training["grid"]["lrs"] == [0.002, 0.5] and training["steps"] == 2 * (192 // 32)
        assert training["chosen"]["lr"] == entry["chosen"]["lr"]
        assert training["chosen"]["peak_lr"] == pytest.approx(entry["chosen"]["lr"] * 32 / 256)
        assert "held-out part train[192:256]" in entry["selection"]
        # Every point's held-out and test figures, recomputed from its trained head.
        held_out, test = [], []
        params, stats = state.params["wd0"][layer], state.batch_stats["wd0"][layer]
        for i in range(2):  # the grid's learning rates: the leading axis
            bn = {**params["bn"], **stats["bn"]}
            head = {
                "bn": {k: np.asarray(v[i], np.float64) for k, v in bn.items()},
                "fc": {k: np.asarray(v[i], np.float64) for k, v in params["fc"].items()},
            }
            train_x, train_y = rows["train", layer], rows["train", "labels"]
            held_out.append(_head_top1(train_x[192:], train_y[192:], head))
            test.append(_head_top1(rows["test", layer], rows["test", "labels"], head))
        assert [p["held_out_top1"] for p in entry["grid"]] == pytest.approx(held_out)
        assert [p["top1"] for p in entry["test_every_point"]["points"]] == pytest.approx(test)
        chosen = int(np.argmax(held_out))
        assert [p["chosen"] for p in entry["grid"]] == [i == chosen for i in range(2)]
        assert entry["top1"] == pytest.approx(test[chosen]) == summary["results"][layer]["top1"]
        assert "not used to choose" in entry["test_every_point"]["note"]
    # The lower rate cannot separate the blobs in 12 steps: the choice is not a tie.
    assert {p["held_out_top1"] < 90 for p in record["layers"]["avgpool"]["grid"]} == {True, False}

    # The same examples as a split of their own (linear.val_split): the same heads and choice.
    split_dir = tmp_path / "with_validation"
    shutil.copytree(blob_features, split_dir)
    for layer in ("res5", "avgpool"):
        x, y = rows["train", layer], rows["train", "labels"]
        _write_features(str(split_dir), "train", layer, x[:192], y[:192])
        _write_features(str(split_dir), "validation", layer, x[192:], y[192:])
    config.linear.cached_features = str(split_dir)
    config.linear.val_split = "validation"
    config.linear.val_fraction = 0.0
    other = linear_eval.run(config, str(tmp_path / "val_split"))["record"]
    for layer, entry in other["layers"].items():
        assert entry["protocol"]["held_out_split"] == "validation"
        assert entry["protocol"]["num_held_out"] == 64 and entry["protocol"]["num_train"] == 192
        assert "linear.val_split='validation'" in entry["protocol"]["held_out_rule"]
        assert entry["grid"] == record["layers"][layer]["grid"]
        assert entry["top1"] == record["layers"][layer]["top1"]


def test_held_out_part_is_the_end_of_the_train_split_as_split_slices():
    config = linear_eval_config.get_config("test")
    config.data.loader = "numpy"  # the demo data generated in memory
    config.data.train_subset, config.linear.val_fraction = -1, 0.1
    splits = inputs_lib.image_splits(config)
    assert (splits.train, splits.held_out) == ("train[0:7200]", "train[7200:8000]")
    assert (splits.num_train, splits.num_held_out) == (7200, 800)
    config.data.train_split, config.data.train_subset = "train[1000:3000]", 1000
    config.linear.val_fraction = 0.25
    splits = inputs_lib.image_splits(config)
    assert (splits.train, splits.held_out) == ("train[1000:1750]", "train[1750:2000]")
    for name, first, count in ((splits.train, 1000, 750), (splits.held_out, 1750, 250)):
        source = sources.resolve_split(config.data, name)  # what the pipelines read
        assert (source.offset, source.num_examples) == (first, count)
        np.testing.assert_array_equal(source.labels, np.arange(first, first + count) % 10)
    # The heads train on the first part only, through the ordinary train pipeline.
    train_data = inputs_lib.train_data_config(config, splits)
    assert (train_data.train_split, train_data.train_subset) == ("train[1000:1750]", -1)
    config.linear.val_fraction = 0.0
    assert inputs_lib.image_splits(config).held_out is None
    config.linear.val_fraction = 0.1
    contiguous, cut = inputs_lib.cached_splits(config, np.arange(40, 80))
    assert (contiguous.train, contiguous.held_out, cut) == ("train[40:76]", "train[76:80]", 36)
    gappy, _ = inputs_lib.cached_splits(config, np.r_[0:30, 50:60])
    assert gappy.train == "36 examples of train with dataset indices 0..55"
    assert gappy.held_out == "train[56:60]"
    # A split of its own: the heads train on the whole train split.
    config.data.train_split, config.data.train_subset = "train[:7000]", -1
    config.linear.val_fraction, config.linear.val_split = 0.0, "train[7000:8000]"
    own = inputs_lib.image_splits(config)
    assert (own.train, own.held_out) == ("train[:7000]", "train[7000:8000]")
    assert (own.num_train, own.num_held_out) == (7000, 1000)
    assert inputs_lib.train_data_config(config, own).train_split == "train[:7000]"


def _save_trunk(workdir, config, step, seed):
    model = weights.trunk_model(config)
    size = config.data.image_size
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), np.zeros((1, size, size, 3)))
    rng = np.random.default_rng(seed)  # random values: no compiled init (seconds on CPU)
    variables = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype), shapes)
    ocp.PyTreeCheckpointer().save(
        os.path.join(workdir, "checkpoints", str(step), "state"), dict(variables)
    )
    return jax.device_get(variables["params"])


def test_the_checkpoint_step_read_is_recorded_past_a_damaged_newest(tmp_path):
    config = linear_eval_config.get_config("test")
    workdir = str(tmp_path / "run")
    saved = {step: _save_trunk(workdir, config, step, step) for step in (3, 7)}
    mesh, layers = parallel.make_mesh(), ("avgpool",)

    def check(path, step):
        config.init.checkpoint = path
        _, variables, record = inputs_lib.load_trunk(config, mesh, layers)
        assert record["checkpoint_step"] == step
        assert record["checkpoint_dir"] == os.path.join(workdir, "checkpoints", str(step))
        kernel = jax.device_get(variables["params"]["trunk"])
        jax.tree.map(np.testing.assert_array_equal, kernel, saved[step]["trunk"])

    check(workdir, 7)
    check(os.path.join(workdir, "checkpoints", "3"), 3)
    for root, _, files in os.walk(os.path.join(workdir, "checkpoints", "7", "state")):
        for name in files:
            os.truncate(os.path.join(root, name), 0)
    check(workdir, 3)  # as weights.load_variables: the newest readable one
    with pytest.raises(weights.WeightsError, match=r"checkpoints/7/state is incomplete"):
        check(os.path.join(workdir, "checkpoints", "7"), 7)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"val_fraction": 0.0}, r"linear.val_fraction=0 holds nothing out, but the grid has 2"),
        ({"lrs": (0.1, -1.0)}, r"linear.lrs=\(0.1, -1.0\): every value must be a finite number"),
        ({"lrs": (0.1, 0.1)}, r"linear.lrs=\(0.1, 0.1\) repeats a value"),
        ({"weight_decays": (-1.0,)}, r"linear.weight_decays=\(-1.0,\): every value"),
        ({"val_fraction": 1.0}, r"linear.val_fraction=1.0 must be in \[0, 1\)"),
        ({"val_fraction": 0.9}, r"holds out 230 of the 256 train examples, leaving 26: fewer"),
        ({"val_split": "validation"}, r"linear.val_split='validation' and linear.val_fraction="),
        ({"val_split": "test", "val_fraction": 0.0}, r"val_split='test' is the train or test"),
        ({"extra_test_sets": ("imagenet_a:test",)}, r"extra_test_sets=.* needs the trunk"),
    ],
)
def test_grid_settings_are_checked_at_start_up(blob_features, tmp_path, changes, match):  # noqa: F811
    config = _cached_config(blob_features)
    config.linear.lrs, config.linear.val_fraction = (0.1, 0.5), 0.1
    config.linear.update(changes)
    with pytest.raises(ValueError, match=match):
        engines.run(config, str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()


def test_held_out_parts_that_cannot_be_cut_are_refused(shared_dirs, tmp_path):
    features = tmp_path / "folder_features"
    for split in ("train", "test"):
        feats = np.random.default_rng(0).normal(size=(64, 4))
        _write_features(str(features), split, "avgpool", feats, np.arange(64) % 2)
    (features / "config.json").write_text(json.dumps({"data": {"source": "folder"}}))
    config = _cached_config(str(features))
    config.linear.layers, config.linear.val_fraction = ("avgpool",), 0.1
    with pytest.raises(
        ValueError, match=r"come from an image folder, .*linear.val_fraction=0 with"
    ):
        linear_eval.validate(config)
    config = linear_eval_config.get_config("test")
    config.data.source, config.data.name, config.data.data_dir = "tfds", "cifar10", str(tmp_path)
    config.init.checkpoint, config.linear.val_fraction = str(tmp_path / "run"), 0.1
    with tfds.testing.mock_data(num_examples=40):
        with pytest.raises(ValueError, match=r"TFDS data without split sizes cannot be cut"):
            linear_eval.validate(config)
    # A TFDS builder that keeps its order (the demo's, read as any TFDS dataset).
    config.data.name, config.data.data_dir = "jssl_demo", shared_dirs[0]
    with pytest.raises(ValueError, match=r"stored unshuffled \(disable_shuffling\) cannot"):
        linear_eval.validate(config)
    config.data.source, config.data.name = "demo", ""  # its labels cycle: the end is fine
    linear_eval.validate(config)


def test_extra_sets_must_share_the_heads_labels(tmp_path):
    config = linear_eval_config.get_config("test")
    config.data.loader = "numpy"  # the heads learn the demo's 10 classes
    config.init.checkpoint = str(tmp_path / "run")  # not read: the checks come first
    config.linear.extra_test_sets = ("imagenet_r:test",)
    config.data.data_dir = str(tmp_path / "tfds")
    with pytest.raises(ValueError, match=r"'imagenet_r:test': TFDS dataset 'imagenet_r' is not"):
        linear_eval.validate(config)
    with tfds.testing.mock_data(num_examples=4):
        with pytest.raises(ValueError, match=r"labelled with 1000 classes .* 10 other classes"):
            linear_eval.validate(config)


def _mock_imagenet(num: int, classes: dict[str, tuple[int, ...]]):
    """tfds.testing.mock_data whose labels are drawn from ``classes[dataset]`` (all 1000 for
    a dataset not listed), with 20x20 PNG images."""

    def as_dataset(self, *args, **kwargs):
        rng = np.random.default_rng(len(self.name))
        labels = rng.choice(classes.get(self.name, tuple(range(1000))), num)
        images = [tf.io.encode_png(rng.integers(0, 255, (20, 20, 3), np.uint8)) for _ in labels]
        return tf.data.Dataset.from_tensor_slices({"image": images, "label": labels})

    return tfds.testing.mock_data(as_dataset_fn=as_dataset)


@pytest.mark.slow
def test_robustness_sets_on_mock_imagenet(tmp_path):
    """Trains on (mock) imagenet2012 and scores the chosen heads on (mock) ImageNet-A, -R and
    -V2: -A and -R over their 200 classes only, their labels being among them."""
    config = linear_eval_config.get_config("test")
    config.data.source, config.data.name = "tfds", "imagenet2012"
    config.data.train_split, config.data.test_split = "train", "validation"
    config.data.data_dir, config.data.cache = str(tmp_path / "tfds"), False
    config.data.train_subset = -1
    config.linear.num_classes = 1000
    config.linear.layers, config.linear.pool = ("avgpool",), ""
    _save_trunk(str(tmp_path / "run"), config, 5, 0)
    config.init.checkpoint = str(tmp_path / "run")
    config.linear.extra_test_sets = (
        "imagenet_a:test",
        "imagenet_r:test",
        "imagenet_v2/matched-frequency:test",
    )
    names = tfds.builder("imagenet_a", data_dir=str(tmp_path)).info.features["label"].names
    subsets = {n: robustness_sets.class_subset(n, names) for n in ("imagenet_a", "imagenet_r")}
    with _mock_imagenet(48, subsets):
        engines.run(config, str(tmp_path / "linear"))
    record = json.loads((tmp_path / "linear" / "results.json").read_text())
    entry = record["layers"]["avgpool"]
    assert entry["protocol"]["source"]["checkpoint_step"] == 5
    sets = entry["extra_test_sets"]
    assert list(sets) == list(config.linear.extra_test_sets)
    for spec, figures in sets.items():
        protocol = figures["protocol"]
        restricted = spec.split(":")[0] in subsets
        assert protocol["num_examples"] == 48 and protocol["examples_outside_classes"] == 0
        assert protocol["scored_classes"] == (200 if restricted else 1000)
        assert 0.0 <= figures["top1"] <= figures["top5"] <= 100.0
        assert "chooses nothing" in protocol["head"] and protocol["dataset"] in spec
