"""Bad settings fail at start-up with a message that names the field and the fix, instead of a
crash after compiling (or a silently wrong run)."""

import re

import pytest
from test_train import checkpoint_steps, make_config

from configs import moco
from jssl import parallel, probe
from jssl.engines import train


@pytest.fixture(scope="module")
def shared_dirs(tmp_path_factory):
    from test_launch import prepare_shared_dirs

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
