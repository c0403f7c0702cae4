"""End-to-end tests of ``launch.py``: real processes on the "test" preset of configs/moco.py.

Each run is a subprocess with the repository root as cwd; they share one generated demo
dataset and one JAX compilation cache under pytest's session tmp dir, so only the first run
pays for compiling the train step.
"""

import json
import os

import pytest
from support.launch import read_events, run_launch, scalar_values


@pytest.mark.e2e
def test_launch_writes_config_checkpoints_and_summaries(tmp_path, shared_dirs):
    workdir = tmp_path / "run"
    result = run_launch(workdir, shared_dirs, "--config.optim.base_lr=0.05")
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]

    with open(workdir / "config.json") as f:
        config = json.load(f)
    assert config["optim"]["base_lr"] == 0.05  # the override, resolved
    assert config["data"]["data_dir"] == shared_dirs[0]
    assert config["data"]["image_size"] == 16 and config["num_epochs"] == 2

    # 64 examples / batch 16 = 4 steps per epoch, 2 epochs: end-of-epoch checkpoints 4 and 8.
    steps = sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())
    assert steps == [4, 8]
    assert os.path.isdir(workdir / "checkpoints" / "8" / "state")

    events = read_events(workdir / "tensorboard")
    for tag in ("loss", "learning_rate", "images_per_sec", "steps_per_sec"):
        assert tag in events, sorted(events)
        assert events[tag][8] == "scalars"
    assert events["augmented_crops/group0_2x16px"] == {0: "images"}
    losses = scalar_values(workdir / "tensorboard", "loss")
    assert sorted(losses) == [2, 4, 6, 8]
    assert all(0 < v < 100 for v in losses.values()), losses
    assert "ETA" in log

    # Relaunching the finished workdir under a config that changes what is trained is
    # refused before anything runs, naming the field; config.json keeps the first config.
    result = run_launch(workdir, shared_dirs, "--config.optim.base_lr=0.5")
    assert result.returncode != 0
    assert "optim.base_lr: 0.05 -> 0.5" in result.stderr, result.stderr[-3000:]
    with open(workdir / "config.json") as f:
        assert json.load(f)["optim"]["base_lr"] == 0.05
    # A logging change is safe: allowed, and recorded.
    result = run_launch(
        workdir, shared_dirs, "--config.optim.base_lr=0.05", "--config.log_every_steps=1"
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    with open(workdir / "config_changes.json") as f:
        assert "log_every_steps" in json.dumps(json.load(f))


def test_misspelt_override_fails_naming_the_field(tmp_path, shared_dirs):
    result = run_launch(tmp_path / "run", shared_dirs, "--config.optim.base_lrr=1")
    assert result.returncode != 0
    assert "base_lrr" in result.stderr
    assert "base_lr" in result.stderr.replace("base_lrr", "")  # suggests the valid name
    assert not os.path.exists(tmp_path / "run")


def test_unknown_preset_fails_naming_the_presets(tmp_path, shared_dirs):
    result = run_launch(tmp_path / "run", shared_dirs, preset="nope")
    assert result.returncode != 0
    assert "'nope'" in result.stderr
    assert "'imagenet', 'demo', 'test'" in result.stderr


@pytest.mark.e2e
def test_knn_comparison_line(tmp_path, shared_dirs):
    result = run_launch(
        tmp_path / "run",
        shared_dirs,
        "--config.knn.enabled=True",
        "--config.knn.batch_size=250",
        # Slices keep the two kNN passes short (the demo splits hold 8000 and 2000 images).
        "--config.knn.train_split=train[:1000]",
        "--config.knn.test_split=test[:500]",
        "--config.num_epochs=1",
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("kNN top-1 on test")]
    assert len(lines) == 1, result.stdout
    assert "learned " in lines[0] and "% vs random init " in lines[0] and lines[0].endswith("%")
    assert os.path.exists(tmp_path / "run" / "knn_random_init.json")


def test_compilation_cache_dir_is_used_unless_jax_already_has_one(tmp_path):
    import jax

    from configs import moco
    from jssl import engines

    config = moco.get_config("test")
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        config.compilation_cache_dir = ""
        assert engines.enable_compilation_cache(config) is None  # off
        config.compilation_cache_dir = str(tmp_path / "cache")
        assert engines.enable_compilation_cache(config) == str(tmp_path / "cache")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache")
        assert (tmp_path / "cache").is_dir()
        # A directory JAX already uses (JAX_COMPILATION_CACHE_DIR, or the caller's) wins.
        config.compilation_cache_dir = str(tmp_path / "other")
        assert engines.enable_compilation_cache(config) == str(tmp_path / "cache")
        jax.config.update("jax_compilation_cache_dir", None)
        (tmp_path / "file").write_text("")
        config.compilation_cache_dir = str(tmp_path / "file" / "cache")
        with pytest.raises(ValueError, match="compilation_cache_dir=.*cannot create"):
            engines.enable_compilation_cache(config)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
