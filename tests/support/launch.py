"""Helpers of the end-to-end tests: the shared demo data and compilation cache of a test
session, ``launch.py`` subprocesses on the "test" preset of configs/moco.py, and reading their
TensorBoard events."""

import glob
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 240


def _tf():
    """TensorFlow, imported by the event-file readers alone: the rest of this module (and the
    conftest that imports it) serves test runs on hosts without TensorFlow, e.g. a GPU host."""
    import tensorflow as tf

    return tf


def shared_cache_dir(tmp_path_factory):
    """One JAX compilation cache for the whole test session, shared by pytest-xdist's
    workers (their tmp dirs sit side by side under the session's), so a step that one test
    compiled is read from disk by every later test that builds the same one."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    cache_dir = base / "jssl_jax_cache"
    cache_dir.mkdir(exist_ok=True)
    return cache_dir


def prepare_shared_dirs(tmp_path_factory) -> tuple[str, str]:
    """(data_dir, compilation cache dir) under the session's tmp dir, shared by the test files;
    the demo dataset is generated there on first use."""
    base = tmp_path_factory.getbasetemp()
    data_dir, cache_dir = base / "jssl_tfds", shared_cache_dir(tmp_path_factory)
    data_dir.mkdir(exist_ok=True)
    import jssl.data
    from configs import moco

    config = moco.get_config("test")
    config.data.data_dir = str(data_dir)
    jssl.data.num_examples(config.data, "test")
    return str(data_dir), str(cache_dir)


def enable_compilation_cache(cache_dir: str) -> None:
    """In-process runs recompile the same steps; JAX's persistent cache makes that cheap."""
    import jax

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def launch_env(cache_dir: str) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    env.update(
        JAX_COMPILATION_CACHE_DIR=cache_dir,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    return env


def launch_args(workdir, data_dir: str, *overrides: str, preset: str = "test") -> list[str]:
    return [
        sys.executable,
        "launch.py",
        f"--config=configs/moco.py:{preset}",
        f"--workdir={workdir}",
        f"--config.data.data_dir={data_dir}",
        *overrides,
    ]


def run_launch(workdir, shared_dirs, *overrides: str, preset: str = "test"):
    data_dir, cache_dir = shared_dirs
    return subprocess.run(
        launch_args(workdir, data_dir, *overrides, preset=preset),
        cwd=REPO,
        env=launch_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def read_events(logdir) -> dict[str, dict[int, str]]:
    """{tag: {step: plugin name}} of every summary in the event files under ``logdir``."""
    found: dict[str, dict[int, str]] = {}
    files = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    assert files, f"no event files in {logdir}"
    for path in files:
        for event in _tf().compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                plugin = value.metadata.plugin_data.plugin_name
                found.setdefault(value.tag, {})[event.step] = plugin
    return found


def scalar_values(logdir, tag: str) -> dict[int, float]:
    values = {}
    for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
        for event in _tf().compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    values[event.step] = float(_tf().make_ndarray(value.tensor))
    return values


def free_port() -> int:
    """A TCP port of localhost that nothing listens on (for a test's coordinator)."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]
