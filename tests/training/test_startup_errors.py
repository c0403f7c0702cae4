"""Bad settings fail at start-up with a message that names the field and the fix, instead of a
crash after compiling (or a silently wrong run)."""

import os
import re

import pytest
from absl import flags
from ml_collections import config_flags
from support.launch import REPO, run_launch
from support.runs import checkpoint_steps, make_config

from configs import dino, moco, swav
from jssl import cli, engines, parallel
from jssl.checkpoints import workdir as workdir_lib
from jssl.engines import train
from jssl.training import probe


@pytest.fixture(scope="module")
def shared_dirs(tmp_path_factory):
    from support.launch import prepare_shared_dirs

    return prepare_shared_dirs(tmp_path_factory)


@pytest.mark.parametrize(
    "field, value",
    [
        ("log_every_steps", 0),
        ("data.batch_size", 0),
        ("data.batch_size", -16),
        ("num_epochs", 0),
    ],
)
def test_non_positive_sizes_are_refused(field, value):
    config = moco.get_config("test")
    parent, _, leaf = field.rpartition(".")
    (config[parent] if parent else config)[leaf] = value
    with pytest.raises(ValueError, match=rf"{re.escape(field)}={value} must be positive"):
        train.validate(config)


def test_unknown_method_lists_the_methods():
    config = moco.get_config("test")
    config.method.name = "simclr_v9"
    with pytest.raises(ValueError, match=r"method.name='simclr_v9' is not one of .*moco"):
        train.validate(config)


def test_probe_with_fewer_classes_than_the_data_is_refused(shared_dirs):
    config = make_config(shared_dirs, **{"probe.num_classes": 5})
    with pytest.raises(ValueError, match=r"10 classes but probe.num_classes=5"):
        probe.check_num_classes(config)
    config.probe.num_classes = 10
    probe.check_num_classes(config)


@pytest.mark.e2e
def test_non_finite_probe_stops_the_run(tmp_path, shared_dirs):
    # A probe learning rate near float32's maximum overflows the probe's logits after a
    # step; the method's own loss stays finite, so only the probe's guard can catch it.
    config = make_config(shared_dirs, **{"probe.learning_rate": 1e38, "num_epochs": 1})
    with pytest.raises(train.NonFiniteLossError, match=r"online probe\) became non-finite"):
        train.run(config, str(tmp_path))
    assert checkpoint_steps(tmp_path) == []


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"SLURM_JOB_ID": "42"}, None),  # a stray variable, or an salloc shell
        ({"SLURM_JOB_ID": "42", "SLURM_NTASKS": "4"}, None),  # python run without srun
        (
            {
                "SLURM_JOB_ID": "42",
                "SLURM_NTASKS": "1",
                "SLURM_PROCID": "0",
                "SLURM_STEP_NODELIST": "n1",
            },
            None,
        ),
        (
            {
                "SLURM_JOB_ID": "42",
                "SLURM_NTASKS": "4",
                "SLURM_PROCID": "1",
                "SLURM_STEP_NODELIST": "n[1-2]",
            },
            "SLURM",
        ),
        ({"TPU_WORKER_HOSTNAMES": "localhost"}, None),
        ({"TPU_WORKER_HOSTNAMES": "t0,t1"}, "Cloud TPU"),
    ],
)
def test_cluster_detection(monkeypatch, env, expected):
    for key in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    for key in ("SLURM_STEP_NODELIST", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert parallel._cluster_environment() == expected


def test_stray_slurm_job_id_runs_a_single_process(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    parallel.initialize()  # would raise "coordinator_address should be defined" before
    import jax

    assert jax.process_count() == 1


def test_process_flags_without_coordinator_are_refused():
    with pytest.raises(ValueError, match="without --coordinator_address"):
        parallel.initialize(None, 2, 0)


@pytest.mark.parametrize(
    "config_module, preset, overrides, message",
    [
        # The eval image and every training crop of a ResNet with the CIFAR stem (stride 8).
        (moco, "test", {"data.image_size": 2}, r"data.image_size=2: .* at least 8 px"),
        (
            swav,
            "test",
            {"data.augment.crop_sizes": (16, 4)},
            r"data.augment.crop_sizes=\(16, 4\): 4 px .* at least 8 px",
        ),
        # torchvision's 7x7 stem and max-pool downsample by 32.
        (
            moco,
            "test",
            {"model.cifar_stem": False},
            r"data.image_size=16: .* at least 32 px .*model.cifar_stem=True",
        ),
        # A ViT needs whole patches (4 px in this preset), at least one.
        (
            dino,
            "test_vit",
            {"data.augment.crop_sizes": (16, 16, 6)},
            r"data.augment.crop_sizes=\(16, 16, 6\): 6 px .* multiple of 4 px, at least 4",
        ),
        (dino, "test_vit", {"data.image_size": 2}, r"data.image_size=2: .* at least 4"),
    ],
)
def test_crops_the_trunk_cannot_use_are_refused(config_module, preset, overrides, message):
    config = config_module.get_config(preset)
    config.update_from_flattened_dict(overrides)
    with pytest.raises(ValueError, match=message):
        engines.validate(config)


def test_crops_the_trunk_can_use_pass():
    for config_module, preset in ((moco, "test"), (swav, "test"), (dino, "test_vit")):
        engines.validate(config_module.get_config(preset))


def test_a_refused_config_writes_nothing(tmp_path, shared_dirs):
    # The workdir, its lock and its config.json would make the corrected rerun a "config
    # change" of a run that never started.
    workdir = tmp_path / "run"
    config = make_config(shared_dirs, **{"data.batch_size": -16})
    with pytest.raises(ValueError, match=r"data.batch_size=-16 must be positive"):
        engines.run(config, str(workdir))
    assert not workdir.exists()


def test_a_run_failing_its_later_start_up_checks_leaves_no_config(tmp_path, shared_dirs):
    workdir = tmp_path / "run"
    config = make_config(shared_dirs, **{"probe.num_classes": 5})  # checked inside train.run
    with pytest.raises(ValueError, match=r"probe.num_classes=5"):
        engines.run(config, str(workdir))
    assert not (workdir / workdir_lib.CONFIG_FILE).exists()
    # The corrected config is a first launch, not a refused change.
    corrected = make_config(shared_dirs, **{"probe.num_classes": 10})
    with workdir_lib.open_run(corrected, str(workdir)) as changes:
        assert changes == []
    assert (workdir / workdir_lib.CONFIG_FILE).exists()


def test_a_refused_launch_leaves_no_config_json(tmp_path, shared_dirs):
    workdir = tmp_path / "run"
    result = run_launch(workdir, shared_dirs, "--config.data.batch_size=-16")
    assert result.returncode != 0
    assert "data.batch_size=-16 must be positive" in result.stderr, result.stderr[-3000:]
    assert not (workdir / workdir_lib.CONFIG_FILE).exists()


def _parse(config: str, *overrides: str):
    """``cli.parse_flags`` on a fresh set of flags (the process's own are parsed once)."""
    argv = ["jssl", f"--config={os.path.join(REPO, config)}", *overrides]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=flag_values, sys_argv=argv)
    cli.parse_flags(argv, flag_values)
    return flag_values["config"].value


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "--config.data.augment.num_crops=abc",
            r"--config.data.augment.num_crops='abc' is not valid: .* tuple of integers .*"
            r"e.g. --config.data.augment.num_crops='\(2,\)'",
        ),
        ("--config.data.augment.num_crops=(2,2.5)", r"num_crops='\(2,2.5\)' .* integers"),
        ("--config.data.augment.crop_scale=(0.2,abc)", r"crop_scale=.* tuple of numbers"),
        (
            "--config.data.batch_size=abc",
            r"--config.data.batch_size='abc' is not valid: .* takes an integer .*"
            r"e.g. --config.data.batch_size=16",
        ),
        ("--config.data.image_size=3.5", r"data.image_size='3.5' .* takes an integer"),
        ("--config.optim.base_lr=fast", r"optim.base_lr='fast' .* takes a number"),
        ("--config.knn.enabled=maybe", r"knn.enabled='maybe' .* takes True or False"),
    ],
)
def test_a_malformed_override_names_the_field_value_and_type(override, message):
    with pytest.raises(cli.ConfigOverrideError, match=message):
        _parse("configs/moco.py:test", override)


def test_an_unquoted_tuple_of_strings_is_refused():
    with pytest.raises(cli.ConfigOverrideError, match=r"tuple of strings, each one quoted"):
        _parse("configs/linear_eval.py:test", "--config.linear.layers=(res4,res5)")


def test_well_formed_overrides_pass():
    config = _parse(
        "configs/moco.py:test",
        "--config.data.augment.num_crops=(2,6)",
        "--config.data.augment.crop_scale=((0.14,1),(0.05,0.14))",
        "--config.optim.base_lr=1",
        "--config.knn.enabled=true",
    )
    assert config.data.augment.num_crops == (2, 6)
    assert config.optim.base_lr == 1.0 and config.knn.enabled
    layers = _parse("configs/linear_eval.py:test", "--config.linear.layers=res4").linear.layers
    assert layers == ("res4",)


def test_a_malformed_override_on_the_command_line(tmp_path, shared_dirs):
    result = run_launch(tmp_path / "run", shared_dirs, "--config.data.augment.num_crops=abc")
    assert result.returncode == 1
    assert "--config.data.augment.num_crops='abc' is not valid" in result.stderr
    assert "tuple of integers" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
