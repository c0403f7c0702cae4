"""Tests of the extract_features engine, jssl.checkpoints.weights and jssl.evaluation.pooling.

A session fixture trains a tiny MoCo checkpoint (the "test" preset of configs/moco.py, one
epoch of 32 examples); extraction from it runs in-process, on 4 devices and as 2 processes
x 2 devices (real ``launch.py`` processes, gloo collectives), and the files must agree.
"""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from support.launch import REPO, launch_env, prepare_shared_dirs

from configs import extract_features, moco
from jssl import data, engines, methods
from jssl.checkpoints import source_model, weights
from jssl.engines import extract_features as extract_engine
from jssl.engines import svm as svm_engine
from jssl.evaluation import feature_store, pooling

LAYERS = ("res5", "avgpool", "head")
SPLITS = {"train": 64, "test": 40}  # the "test" preset: train[:64], test[:40]
# Slices of the demo's 8000/2000-example splits are named by the examples they hold.
DIRS = {"train": "train@0-64", "test": "test@0-40"}


@pytest.fixture(scope="session")
def shared_dirs(tmp_path_factory):
    return prepare_shared_dirs(tmp_path_factory)


@pytest.fixture(scope="session")
def trained(shared_dirs, tmp_path_factory):
    """The workdir of a one-epoch run of the tiny MoCo preset."""
    config = moco.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.num_epochs = 1
    config.data.train_subset = 32
    config.checkpoint.async_save = False
    workdir = str(tmp_path_factory.mktemp("trained"))
    engines.run(config, workdir)  # as jssl.train and launch.py: config.json recorded
    return workdir


def extract_config(shared_dirs, trained):
    config = extract_features.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.init.checkpoint = trained
    source_model.adopt(config, "")  # the run's model fields, as engines.run takes them
    return config


@pytest.fixture(scope="module")
def extracted(shared_dirs, trained, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("features"))
    summary = extract_engine.run(extract_config(shared_dirs, trained), workdir)
    return workdir, summary


def load_all(workdir):
    out = {}
    for split in SPLITS:
        for layer in LAYERS:
            for kind in feature_store.KINDS:
                path = os.path.join(workdir, "features", DIRS[split], f"{layer}_{kind}.npy")
                out[split, layer, kind] = np.load(path, mmap_mode="r")
    return out


def test_files_shapes_indices_and_targets(extracted):
    workdir, summary = extracted
    files = load_all(workdir)
    dims = {"res5": 64, "avgpool": 64, "head": 16}  # ResNet-18 x0.125; head_dims[-1]
    for split, n in SPLITS.items():
        for layer in LAYERS:
            feats = files[split, layer, "features"]
            assert isinstance(feats, np.memmap)
            assert feats.shape == (n, dims[layer]) and feats.dtype == np.float32
            assert np.all(np.isfinite(feats))
            np.testing.assert_array_equal(files[split, layer, "inds"], np.arange(n))
            # Demo labels are index % 10 (jssl/data/demo.py).
            np.testing.assert_array_equal(files[split, layer, "targets"], np.arange(n) % 10)
        # The "avg" pool of res5 is the trunk's own global average pool.
        np.testing.assert_allclose(
            files[split, "res5", "features"], files[split, "avgpool", "features"], rtol=1e-5
        )
    assert summary["test[:40]"]["num_examples"] == 40
    assert summary["train[:64]"]["shapes"]["head"] == (16,)
    assert not any(
        name.endswith(".partial") for name in os.listdir(summary["test[:40]"]["directory"])
    )
    with open(os.path.join(workdir, "features", DIRS["test"], feature_store.SPLIT_INFO)) as f:
        assert json.load(f) == {
            "split": "test[:40]",
            "base": "test",
            "start": 0,
            "end": 40,
            "base_num_examples": 2000,
            "num_examples": 40,
        }
    # The step of the workdir's checkpoint that was read, for every figure made from them.
    record = svm_engine.features_record(workdir, "avgpool")
    assert record["checkpoint_step"] == 2  # one epoch of 32 examples in batches of 16
    assert record["checkpoint"].endswith(os.path.join("checkpoints", "2"))


def test_two_slices_of_a_split_write_two_directories(shared_dirs, trained, tmp_path):
    config = extract_config(shared_dirs, trained)
    config.extract.splits = ("test[:8]", "test[8:16]")
    config.extract.layers = ("avgpool",)
    summary = extract_engine.run(config, str(tmp_path))
    features_dir = tmp_path / "features"
    assert sorted(os.listdir(features_dir)) == [
        "config.json",
        "source.json",
        "test@0-8",
        "test@8-16",
    ]
    second = np.load(features_dir / "test@8-16" / "avgpool_inds.npy")
    np.testing.assert_array_equal(second, np.arange(8, 16))  # indices in the whole split
    assert summary["test[8:16]"]["directory"] == str(features_dir / "test@8-16")
    # The evaluation engines select slices from them, and refuse what none covers.
    got = feature_store.load_features(str(tmp_path), "test[10:14]", ["avgpool"])
    np.testing.assert_array_equal(got.indices, np.arange(10, 14))
    np.testing.assert_array_equal(
        got.features["avgpool"], np.load(features_dir / "test@8-16" / "avgpool_features.npy")[2:6]
    )
    with pytest.raises(FileNotFoundError, match="cover"):
        feature_store.load_features(str(tmp_path), "test[4:12]", ["avgpool"])


def test_features_equal_a_direct_forward(shared_dirs, trained, extracted):
    config = extract_config(shared_dirs, trained)
    trained_with = moco.get_config("test")  # the method (its head) and trunk of the run
    model = methods.get(trained_with).model
    variables = weights.load_variables(trained, trained_with)
    batches = list(
        data.build_eval_dataset(config.data, "test[:40]", batch_size=40).as_numpy_iterator()
    )
    assert len(batches) == 1 and batches[0]["mask"].all()
    taps = model.apply(variables, batches[0]["image"], train=False)
    files = load_all(extracted[0])
    for layer in ("avgpool", "head"):
        np.testing.assert_allclose(
            files["test", layer, "features"], taps[layer], rtol=1e-4, atol=1e-5
        )
    np.testing.assert_allclose(
        files["test", "res5", "features"], taps["res5"].mean((1, 2)), rtol=1e-4, atol=1e-5
    )


def test_restore_paths_agree(shared_dirs, trained):
    config = moco.get_config("test")
    config.data.data_dir = shared_dirs[0]
    ckpt_dir = os.path.join(trained, "checkpoints")
    (step,) = [name for name in os.listdir(ckpt_dir) if name.isdigit()]
    loaded = [
        weights.load_variables(path, config)
        for path in (trained, ckpt_dir, os.path.join(ckpt_dir, step))
    ]
    for other in loaded[1:]:
        jax.tree.map(np.testing.assert_array_equal, loaded[0], other)
    assert set(loaded[0]["params"]) == {"trunk", "head"}


def test_missing_checkpoint_is_a_clear_error(shared_dirs, tmp_path):
    config = extract_features.get_config("test")
    config.data.data_dir = shared_dirs[0]
    with pytest.raises(weights.WeightsError, match="does not exist.*workdir of a jssl"):
        weights.load_variables(str(tmp_path / "nowhere"), config, trunk_only=True)
    with pytest.raises(weights.WeightsError, match="No checkpoint found"):
        weights.load_variables(str(tmp_path), config, trunk_only=True)
    # No init.checkpoint and a workdir without checkpoints: say which flag to set.
    with pytest.raises(weights.WeightsError, match="--config.init.checkpoint"):
        extract_engine.run(config, str(tmp_path / "out"))


def test_wrong_architecture_is_a_clear_error(shared_dirs, trained):
    config = moco.get_config("test")  # the trained method, at another width
    config.model.width_multiplier = 0.25
    config.model.head_dims = (128, 32, 16)
    expected = r"(?s)does not fit.*checkpoint \(8,\), model \(16,\).*trained with"
    with pytest.raises(weights.WeightsError, match=expected):
        weights.load_variables(trained, config)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(workdir, shared_dirs, trained, devices, *extra):
    env = launch_env(shared_dirs[1])
    env["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    )
    args = [
        sys.executable,
        "launch.py",
        "--config=configs/extract_features.py:test",
        f"--workdir={workdir}",
        f"--config.data.data_dir={shared_dirs[0]}",
        f"--config.init.checkpoint={trained}",
        *extra,
    ]
    return subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _assert_same_files(a, b):
    for key, value in a.items():
        if key[2] == "features":
            np.testing.assert_allclose(value, b[key], rtol=1e-5, atol=1e-6, err_msg=str(key))
        else:
            np.testing.assert_array_equal(value, b[key], err_msg=str(key))


@pytest.mark.e2e
def test_four_devices_and_two_processes_match(shared_dirs, trained, extracted, tmp_path):
    # The 4-device run first, then the two processes: all three at once on the 2-core machine
    # made one of them fail intermittently (start-up timing of jax.distributed under load).
    four, two = tmp_path / "four", tmp_path / "two"
    first = _launch(four, shared_dirs, trained, 4)
    outputs = [first.communicate(timeout=300)[0]]
    port = _free_port()
    pair = [
        _launch(
            two,
            shared_dirs,
            trained,
            2,
            f"--coordinator_address=localhost:{port}",
            "--num_processes=2",
            f"--process_id={i}",
        )
        for i in range(2)
    ]
    outputs += [p.communicate(timeout=300)[0] for p in pair]
    procs = [first, *pair]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    assert "1 process(es), 4 device(s)" in outputs[0]
    assert "2 process(es), 4 device(s)" in outputs[1]

    reference = load_all(extracted[0])
    _assert_same_files(reference, load_all(four))
    _assert_same_files(reference, load_all(two))


def test_avg_pool_matches_torch_semantics():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 7, 9, 3)).astype(np.float32)
    kernel, stride, padding = 3, 2, 1
    padded = np.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    out_h = (7 + 2 * padding - kernel) // stride + 1
    out_w = (9 + 2 * padding - kernel) // stride + 1
    want = np.zeros((2, out_h, out_w, 3), np.float32)
    for i in range(out_h):
        for j in range(out_w):
            window = padded[:, i * stride : i * stride + kernel, j * stride : j * stride + kernel]
            want[:, i, j] = window.sum((1, 2)) / kernel**2  # count_include_pad=True
    got = pooling.get_pool(f"avg:{kernel},{stride},{padding}")(x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(pooling.get_pool("avg")(x), x.mean((1, 2)), rtol=1e-6)
    vectors = x[:, 0, 0]
    assert pooling.get_pool("avg")(vectors) is vectors
    with pytest.raises(ValueError, match="larger than"):
        pooling.get_pool("avg:10,1,0")(x)


def test_vissl_resnet50_table_gives_vissl_dims():
    # ResNet-50 taps at 224 px -> the dims of VISSL's eval_mlp heads (9216/8192).
    taps = {
        "conv1": (112, 64),
        "res2": (56, 256),
        "res3": (28, 512),
        "res4": (14, 1024),
        "res5": (7, 2048),
        "avgpool": None,
    }
    pools = pooling.layer_pools("vissl_resnet50", list(taps))
    dims = {}
    for layer, spec in taps.items():
        shape = (2, spec[0], spec[0], spec[1]) if spec else (2, 2048)
        out = jax.eval_shape(pools[layer], jax.ShapeDtypeStruct(shape, np.float32))
        dims[layer] = int(np.prod(out.shape[1:]))
    assert dims == {
        "conv1": 9216,
        "res2": 9216,
        "res3": 8192,
        "res4": 9216,
        "res5": 8192,
        "avgpool": 2048,
    }


def test_layer_pools_parsing():
    pools = pooling.layer_pools("res4=avg:8,3,0; res5=avg", ["res4", "res5", "avgpool"])
    x = np.ones((1, 14, 14, 4), np.float32)
    assert pools["res4"](x).shape == (1, 3, 3, 4)
    assert pools["res5"](x).shape == (1, 4)
    assert pools["avgpool"](x) is x
    with pytest.raises(ValueError, match="not in layers"):
        pooling.layer_pools("res3=avg", ["res5"])
    with pytest.raises(ValueError, match="Unknown pool spec"):
        pooling.get_pool("max")
    # Without resolved bounds (e.g. mock TFDS data) a slice is named from its spelling.
    assert feature_store.output_dir("/w", "train[:10%]") == "/w/features/train@-10%"
    assert feature_store.output_dir("/w", "train") == "/w/features/train"
    whole = feature_store.SplitBounds("train", 0, 100, 100)
    assert feature_store.output_dir("/w", "train[:100%]", whole) == "/w/features/train"
    tenth = feature_store.SplitBounds("train", 0, 10, 100)
    assert feature_store.output_dir("/w", "train[:10%]", tenth) == "/w/features/train@0-10"


def test_torch_trunk_is_imported_and_head_stays_random(shared_dirs, trained, tmp_path):
    torch = pytest.importorskip("torch")
    from flax import traverse_util

    from jssl.models import torch_import

    config = moco.get_config("test")  # a warm start's model: the trunk and a (random) head
    saved = jax.device_get(weights.load_variables(trained, config))
    state_dict = {}
    for collection in ("params", "batch_stats"):
        flat = traverse_util.flatten_dict(saved[collection]["trunk"])
        for path, value in flat.items():
            value = np.array(value)
            if value.ndim == 4:
                value = value.transpose(3, 2, 0, 1)  # HWIO -> OIHW
            name = torch_import._torch_name(collection, path)
            state_dict[name] = torch.from_numpy(np.ascontiguousarray(value))
    path = str(tmp_path / "trunk.pth")
    torch.save(state_dict, path)
    loaded = weights.load_variables(path, config)
    for collection in ("params", "batch_stats"):
        jax.tree.map(
            np.testing.assert_array_equal, saved[collection]["trunk"], loaded[collection]["trunk"]
        )
    head = np.asarray(loaded["params"]["head"]["fc0"]["kernel"])
    assert not np.allclose(head, saved["params"]["head"]["fc0"]["kernel"])


def test_avg_pool_matches_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).normal(size=(2, 12, 12, 5)).astype(np.float32)
    for kernel, stride, padding in ((10, 10, 4), (6, 1, 0), (3, 2, 1)):
        pool = torch.nn.AvgPool2d(kernel, stride, padding)
        want = pool(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy().transpose(0, 2, 3, 1)
        got = pooling.avg_pool(x, kernel, stride, padding)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
