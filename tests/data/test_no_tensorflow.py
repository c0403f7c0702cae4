"""jssl without TensorFlow: the core imports none, and where it is not installed the demo trains
(numpy pipeline, TensorBoard events from tensorboard's own writer).

"Not installed" is simulated in a subprocess: every import finder is wrapped so that
tensorflow and tensorflow_datasets are never found (importlib.util.find_spec returns None and
``import tensorflow`` raises ModuleNotFoundError), which is what a host with only JAX sees.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from support.hidden_imports import hiding
from support.launch import REPO, TIMEOUT_S, launch_args, launch_env, read_events, shared_cache_dir

HIDE_TENSORFLOW = hiding("tensorflow", "tensorflow_datasets")

# What a user with their own data loader, the step benchmarks and the train engine import.
CORE = (
    "jssl",
    "jssl.models",
    "jssl.losses",
    "jssl.optim",
    "jssl.parallel",
    "jssl.methods",
    *(
        f"jssl.methods.{name}"
        for name in (
            "barlow_twins byol dino moco mocov3 simclr simsiam supervised swav vicreg".split()
        )
    ),
    "jssl.training.step",
    "jssl.training.state",
    "jssl.training.summaries",
    "jssl.checkpoints.manager",
    "jssl.checkpoints.weights",
    "jssl.checkpoints.warm_start",
    "jssl.checkpoints.workdir",
    "jssl.data",
    "jssl.data.device_augment",
    "jssl.data.numpy_pipeline",
)


def _python(code: str, *args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env=env or dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_core_modules_never_import_tensorflow():
    # TensorFlow is installed here: importing the core must still leave it unimported.
    code = f"import sys\nfor m in {CORE!r}:\n    __import__(m)\n"
    code += "print(sorted(m for m in sys.modules if m.startswith('tensorflow')))"
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_core_and_engines_import_where_tensorflow_is_missing():
    code = HIDE_TENSORFLOW + f"for m in {CORE!r} + ('jssl.engines.train', 'jssl.cli'):\n"
    code += "    __import__(m)\n"
    code += "from jssl import data\nfrom configs import moco\n"
    code += "print(data.backend.resolve(moco.get_config('test').data))"
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "numpy"


WRITE_EVENTS = """
import numpy as np
from jssl.training import summaries
from clu.metric_writers import interface  # after jssl, which lets clu import without TF

writer = summaries.create_writer(sys.argv[1], just_logging=False)
writer.write_scalars(3, {"loss": 1.5})
grid = np.linspace(0, 1, 4 * 6 * 3).reshape(1, 4, 6, 3)
raw = np.arange(24, dtype=np.uint8).reshape(2, 4, 1, 3)
writer.write_images(3, {"views": grid, "raw": raw})
writer.write_texts(0, {"parameters": "a table"})
writer.write_histograms(3, {"weights": np.arange(10.0)}, num_buckets={"weights": 5})
writer.write_hparams({"optim": {"lr": 0.1, "name": "sgd"}, "crops": (2, 6)})
writer.close()
assert isinstance(summaries.EventFileWriter(sys.argv[1]), interface.MetricWriter)
"""

RUN_LAUNCH = """
import runpy

sys.path.insert(0, ".")
sys.argv = sys.argv[1:]
runpy.run_path("launch.py", run_name="__main__")
"""


def test_writer_without_tensorflow_writes_readable_events(tmp_path):
    # The events are read back with TensorFlow, here in the parent process.
    code = HIDE_TENSORFLOW + WRITE_EVENTS
    out = _python(code, str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    found = read_events(tmp_path)
    assert found["loss"] == {3: "scalars"}
    assert found["views"] == {3: "images"} and found["raw"] == {3: "images"}
    assert found["parameters"] == {0: "text"}
    assert found["weights"] == {3: "histograms"}
    assert "_hparams_/session_start_info" in found
    values = {}
    for path in tmp_path.glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                values[value.tag] = tf.make_ndarray(value.tensor)
    assert float(values["loss"]) == 1.5
    width, height, *pngs = values["raw"]
    assert (int(width), int(height), len(pngs)) == (1, 4, 2)
    np.testing.assert_array_equal(
        tf.io.decode_png(pngs[1]).numpy(), np.arange(12, 24, dtype=np.uint8).reshape(4, 1, 3)
    )
    assert values["weights"].shape == (5, 3) and values["weights"][:, 2].sum() == 10


@pytest.mark.e2e
def test_demo_trains_where_tensorflow_is_missing(tmp_path, tmp_path_factory):
    # The test preset's first steps, as `python launch.py` runs them on a host without TF.
    workdir = tmp_path / "run"
    args = launch_args(workdir, str(tmp_path / "unused"), "--config.debug.max_steps=2")
    assert args[1] == "launch.py"
    code = HIDE_TENSORFLOW + RUN_LAUNCH
    env = launch_env(str(shared_cache_dir(tmp_path_factory)))
    out = _python(code, *args[1:], env=env)
    assert out.returncode == 0, out.stderr[-5000:]
    assert "numpy pipeline" in out.stderr
    assert os.path.isdir(workdir / "checkpoints" / "2")
    found = read_events(workdir / "tensorboard")
    assert 2 in found["loss"]
    assert any(tag.startswith("augmented_crops/") for tag in found)
