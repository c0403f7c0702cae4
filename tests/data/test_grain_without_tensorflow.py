"""grain where TensorFlow cannot be imported: an image folder trains through launch.py, and a
TFDS dataset stored as ArrayRecord gives the batches it gives with TensorFlow installed.

The subprocesses get a sitecustomize module that hides the packages from every import finder
(``import tensorflow`` raises ModuleNotFoundError), so grain's worker processes, which start
afresh, lack them too: what a JAX-only GPU host sees.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image
from support.hidden_imports import hiding, prepare_array_record_demo
from support.launch import REPO, TIMEOUT_S, launch_env, shared_cache_dir

import jssl.data as data
from jssl.data import sources


def _hiding_env(tmp_path, hidden, cache_dir) -> dict:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(hiding(*hidden))
    env = launch_env(str(cache_dir))
    env["PYTHONPATH"] = os.pathsep.join([str(site), REPO])
    return env


def _run(args, env) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=REPO, env=env, capture_output=True, text=True, timeout=2 * TIMEOUT_S
    )


def _write_folder(root):
    rng = np.random.default_rng(0)
    for split, per_class in (("train", 12), ("test", 4)):
        for c in range(3):
            os.makedirs(root / split / f"class{c}")
            for i in range(per_class):
                pixels = rng.integers(0, 255, (20 + i, 24, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / f"class{c}" / f"{i}.png")


@pytest.mark.e2e
def test_image_folder_trains_where_tensorflow_is_missing(tmp_path, tmp_path_factory):
    folder, workdir = tmp_path / "images", tmp_path / "run"
    _write_folder(folder)
    env = _hiding_env(
        tmp_path, ("tensorflow", "tensorflow_datasets"), shared_cache_dir(tmp_path_factory)
    )
    check = _run([sys.executable, "-c", "import tensorflow"], env)
    assert check.returncode != 0 and "No module named 'tensorflow'" in check.stderr
    args = [
        sys.executable,
        "launch.py",
        "--config=configs/moco.py:test",
        f"--workdir={workdir}",
        "--config.data.source=folder",
        f"--config.data.data_dir={folder}",
        "--config.data.batch_size=8",
        "--config.data.workers=1",
        "--config.debug.max_steps=2",
    ]
    out = _run(args, env)
    assert out.returncode == 0, out.stderr[-5000:]
    assert "Training order: exact" in out.stderr  # grain's order over the folder
    assert os.path.isdir(workdir / "checkpoints" / "2")


READ_BATCHES = """
import json, sys
import numpy as np
import jssl.data as data

config = data.default_config()
config.update(json.loads(sys.argv[1]))
out = {}
for p in range(2):
    batches = data.build_train_dataset(config, seed=7, epoch=1, process_index=p, process_count=2)
    out[p] = [
        [b["index"].tolist(), b["label"].tolist(), int(b["crops"][0].astype(np.int64).sum())]
        for b in batches.as_numpy_iterator()
    ]
assert "tensorflow" not in sys.modules
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def array_record_dir(tmp_path_factory):
    """The demo data in ArrayRecord files, 48 train and 16 test examples (prepared with TF)."""
    return prepare_array_record_demo(str(tmp_path_factory.mktemp("grain_array_record")), 48, 16)


def test_array_record_tfds_reads_the_same_without_tensorflow(tmp_path, array_record_dir):
    fields = dict(source="tfds", name=sources.DEMO_NAME, data_dir=array_record_dir)
    fields.update(loader="grain", workers=0, image_size=16, batch_size=8)
    env = _hiding_env(tmp_path, ("tensorflow",), tmp_path / "cache")
    out = _run([sys.executable, "-c", READ_BATCHES, json.dumps(fields)], env)
    assert out.returncode == 0, out.stderr[-5000:]
    without_tf = json.loads(out.stdout.strip().splitlines()[-1])
    config = data.default_config()
    config.update(fields)
    order = data.epoch_order(48, 8, seed=7, epoch=1)
    for p in range(2):
        here = list(
            data.build_train_dataset(config, seed=7, epoch=1, process_index=p, process_count=2)
        )
        rows = without_tf[str(p)]
        assert [r[0] for r in rows] == [b["index"].tolist() for b in here]
        assert [r[2] for r in rows] == [int(b["crops"][0].astype(np.int64).sum()) for b in here]
        assert [r[0] for r in rows] == data.process_order(order, p, 2).reshape(-1, 4).tolist()
    # The demo data in TFDS's default TFRecord files: grain refuses it, naming the fix.
    from jssl.data import demo, demo_tfds  # noqa: F401  (demo_tfds registers the builder)

    config.data_dir = str(tmp_path / "tfrecord")
    sizes = dict(demo.SPLIT_SIZES)
    demo.SPLIT_SIZES.update(train=16, test=8)
    try:
        tfds.builder(sources.DEMO_NAME, data_dir=config.data_dir).download_and_prepare()
    finally:
        demo.SPLIT_SIZES.update(sizes)
    with pytest.raises(ValueError, match="--file_format=array_record"):
        list(data.build_train_dataset(config, seed=0, epoch=0))
