"""The collapse monitor (jssl.training.collapse): its statistics against numpy, eagerly and over
4 devices, the alarm's patience and messages, and the train engine acting on it: a collapsing
run warned about and stopped before its features collapse completely, a healthy run left
alone.

Run as a script (``python test_collapse.py out.npz`` with several host devices), it computes
the step's statistics over the devices' shards of one global batch for the 4-device test.
"""

import os
import sys

import numpy as np
import pytest

from jssl.methods.swav import entropy_fractions
from jssl.training import collapse


def _rankme(x, eps=1e-7):
    s = np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)
    p = s / s.sum() + eps
    return float(np.exp(-np.sum(p * np.log(p))))


def _std(x):
    z = x / np.linalg.norm(x, axis=1, keepdims=True)
    return float(np.mean(np.std(z, axis=0)))


def _entropies(probs):
    """(mean entropy of a row, entropy of the mean row), over log K."""
    probs = probs.reshape(-1, probs.shape[-1])

    def h(p):
        return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), axis=-1)

    log_k = np.log(probs.shape[-1])
    return float(h(probs).mean() / log_k), float(h(probs.mean(axis=0)) / log_k)


def _batch(seed=0, n=32):
    """A global batch of anisotropic head outputs (n, 8) and features (n, 2, 6)."""
    rng = np.random.default_rng(seed)
    head = rng.normal(size=(n, 8)) * np.array([5, 3, 2, 1, 1, 0.5, 0.1, 0.01])
    features = np.abs(rng.normal(size=(n, 2, 6))) + 0.5
    return head.astype(np.float32), features.astype(np.float32)


def test_rankme_matches_numpy_and_spans_one_to_the_rank():
    head, _ = _batch()
    np.testing.assert_allclose(float(collapse.rankme(head)), _rankme(head), rtol=1e-4)
    one_vector = np.tile(head[:1], (32, 1))
    assert abs(float(collapse.rankme(one_vector)) - 1.0) < 1e-3
    np.testing.assert_allclose(float(collapse.rankme(np.eye(8) * 3.0)), 8.0, rtol=1e-4)
    # Rows in a 3-d subspace of 8 dimensions: RankMe sees 3, not 8.
    subspace = np.random.default_rng(1).normal(size=(64, 3)) @ np.eye(3, 8)
    assert 2.5 < float(collapse.rankme(subspace)) <= 3.0 + 1e-3


def test_normalized_std_matches_numpy_and_spans_zero_to_one_over_sqrt_dim():
    head, features = _batch()
    np.testing.assert_allclose(float(collapse.normalized_std(head)), _std(head), rtol=1e-5)
    flat = features.reshape(len(features), -1)
    np.testing.assert_allclose(float(collapse.normalized_std(features)), _std(flat), rtol=1e-5)
    spread = np.random.default_rng(2).normal(size=(4096, 16))
    np.testing.assert_allclose(float(collapse.normalized_std(spread)), 1 / 4, rtol=0.02)
    assert float(collapse.normalized_std(np.tile(head[:1], (32, 1)))) < 1e-6


def test_entropy_fractions_match_numpy_and_their_extremes():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 16, 10)) * 3
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(
        [float(v) for v in entropy_fractions(probs)], _entropies(probs), rtol=1e-5
    )
    uniform = np.full((16, 10), 0.1)
    np.testing.assert_allclose([float(v) for v in entropy_fractions(uniform)], [1, 1], rtol=1e-6)
    same = np.tile(np.eye(10)[:1], (16, 1))  # every image on prototype 0
    np.testing.assert_allclose([float(v) for v in entropy_fractions(same)], [0, 0], atol=1e-6)
    spread = np.eye(10)  # one-hot, each image its own prototype: the mean is uniform
    np.testing.assert_allclose([float(v) for v in entropy_fractions(spread)], [0, 1], atol=1e-6)


def _numpy_statistics(head, features):
    flat = features.reshape(len(features), -1)
    return {
        "collapse/head_rank": _rankme(head),
        "collapse/head_std": _std(head),
        "collapse/features_rank": _rankme(flat),
        "collapse/features_std": _std(flat),
        "collapse_size/head": 8,
        "collapse_size/features": 12,
        "collapse_size/batch": len(head),
    }


def test_step_statistics_on_one_device_and_zeros_when_off():
    import jax.numpy as jnp

    head, features = _batch()
    outputs = {"head": head, "features": features}
    on = collapse.step_statistics(jnp.array(True), outputs, None)
    expected = _numpy_statistics(head, features)
    assert sorted(on) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(float(on[name]), value, rtol=1e-4, err_msg=name)
    off = collapse.step_statistics(jnp.array(False), outputs, None)
    assert all(float(off[k]) == 0 for k in off if k.startswith("collapse/"))
    # DINO's head output is None: the features alone.
    only = collapse.step_statistics(jnp.array(True), {"head": None, "features": features}, None)
    assert not any("head" in k for k in only)


def test_step_statistics_on_four_devices_are_the_global_batchs(tmp_path):
    from support.devices import run_on_devices

    out = run_on_devices(os.path.abspath(__file__), tmp_path / "stats.npz", devices=4)
    head, features = _batch()
    for name, value in _numpy_statistics(head, features).items():
        np.testing.assert_allclose(out[name], value, rtol=1e-4, err_msg=name)
    probs = out["probs"]
    np.testing.assert_allclose(out["swav_entropy"], _entropies(probs), rtol=1e-5)
    assert float(out["off"]) == 0.0


def _four_devices(out_path):
    """The script part: the step's statistics and SwAV's entropies over 4 shards of a batch."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jssl import parallel
    from jssl.parallel import DATA_AXIS

    assert jax.device_count() == 4, jax.devices()
    mesh = parallel.make_mesh()
    head, features = _batch()
    probs = np.random.default_rng(4).dirichlet(np.ones(6) * 0.3, size=32).astype(np.float32)

    def per_replica(on, head, features, probs):
        stats = collapse.step_statistics(on, {"head": head, "features": features}, DATA_AXIS)
        stats["swav_entropy"] = jnp.stack(entropy_fractions(probs, DATA_AXIS))
        return stats

    sharded = jax.jit(
        jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(P(), P(DATA_AXIS), P(DATA_AXIS), P(DATA_AXIS)),
            out_specs=P(),
            check_vma=False,
        )
    )
    on = jax.device_get(sharded(jnp.array(True), head, features, probs))
    off = jax.device_get(sharded(jnp.array(False), head, features, probs))
    np.savez(out_path, **on, probs=probs, off=off["collapse/head_rank"])


def _monitor(**fields):
    import ml_collections

    from configs import base

    monitor = base.get_base_config().monitor
    monitor.update(fields)
    return ml_collections.ConfigDict(monitor)


def _scalars(alarm, **values):
    """A log step's written scalars through ``alarm.scalars`` (batch 16, head dim 16)."""
    last = {f"collapse/{k}": v for k, v in values.items()}
    last.update({"collapse_size/batch": 16.0, "collapse_size/head": 16.0})
    return alarm.scalars({"loss": 1.0, "collapse/head_rank": 0.0}, last)


def test_alarm_waits_for_its_patience_and_warns_once(monkeypatch):
    warnings = []
    monkeypatch.setattr(collapse.logging, "warning", lambda fmt, *a: warnings.append(fmt % a))
    alarm = collapse.Alarm(_monitor(patience=2, on_collapse="warn"))
    healthy = dict(head_rank=10.0, head_std=0.24)
    low = dict(head_rank=0.5, head_std=0.24)  # RankMe 0.5 / min(16, 16): below 0.05
    scalars = _scalars(alarm, **healthy)
    assert "collapse_size/batch" not in scalars and scalars["collapse/head_rank"] == 10.0
    for step, values in [(2, low), (4, healthy), (6, low)]:  # one noisy batch at a time
        assert alarm.check(step, _scalars(alarm, **values)) is None
    assert not warnings
    alarm.check(8, _scalars(alarm, **low))
    assert len(warnings) == 1
    message = warnings[0]
    for part in (
        "collapse/head_rank = 0.5",
        "monitor.min_rank_fraction=0.01",
        "since step 6",
        "now step 8",
        "learning rate",
        "stop-gradient",
        "min(batch 16, dim 16)",
    ):
        assert part in message, (part, message)
    alarm.check(10, _scalars(alarm, **low))
    assert len(warnings) == 1  # once per streak
    alarm.check(12, _scalars(alarm, **healthy))
    alarm.check(14, _scalars(alarm, **low))
    alarm.check(16, _scalars(alarm, **low))
    assert len(warnings) == 2  # recovered, then collapsed again


def test_alarm_bounds_of_each_statistic():
    alarm = collapse.Alarm(_monitor(patience=1, on_collapse="stop"))
    assert alarm.check(2, _scalars(alarm, head_rank=10.0, head_std=0.24)) is None
    # RankMe 1.9 is within min_rank_fraction's bound at this size, 1 + 0.01 x 15, but fewer
    # than two effective directions count at any size.
    found = alarm.check(3, _scalars(alarm, head_rank=1.9, head_std=0.24))
    assert found.name == "head_rank" and "(or RankMe 2)" in found.describe(1)
    # std 0.01 x sqrt(16) = 0.04 < 0.05
    found = alarm.check(4, _scalars(alarm, head_rank=10.0, head_std=0.01))
    assert found.name == "head_std" and abs(found.fraction - 0.04) < 1e-6
    entropies = {"collapse/teacher_entropy": 0.998, "collapse/teacher_mean_entropy": 0.5}
    found = alarm.check(6, dict(entropies))
    assert found.name == "teacher_entropy" and "teacher temperature" in found.describe(1)
    found = alarm.check(8, {"collapse/assignment_mean_entropy": 0.01})
    assert found.name == "assignment_mean_entropy" and "Sinkhorn" in found.describe(1)
    message = alarm.stop_message(found, "/w/checkpoints", "/w/checkpoints/4")
    assert "saving step 8 in /w/checkpoints" in message
    assert "--config.init.checkpoint" in message and "/w/checkpoints/4" in message
    assert "--config.monitor.on_collapse=warn" in message
    off = collapse.Alarm(_monitor(patience=1, on_collapse="off"))
    assert off.check(2, _scalars(off, head_rank=0.5)) is None


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("on_collapse", "loud", "monitor.on_collapse='loud'"),
        ("patience", 0, "monitor.patience=0"),
        ("min_rank_fraction", 5.0, "monitor.min_rank_fraction=5.0"),
    ],
)
def test_bad_monitor_config_is_refused(field, value, match):
    from configs import moco

    config = moco.get_config("test")
    config.monitor[field] = value
    with pytest.raises(ValueError, match=match):
        collapse.check_config(config)


def _simsiam_without_stop_gradient(predictions, targets, axis_name=None):
    """jssl.losses.simsiam_loss with the gradient flowing into the targets as well: SimSiam's
    collapse (Chen & He 2021, Sec. 4.1, Fig. 2)."""
    import jax.numpy as jnp

    from jssl.losses._util import _cosine, _embedding_std

    cosine = _cosine(predictions, targets[::-1])
    per_example = -jnp.mean(cosine, axis=0)
    metrics = {"cosine": jnp.mean(cosine), "output_std": _embedding_std(targets, axis_name)}
    return jnp.mean(per_example), metrics, per_example


def _collapsing_config(shared_dirs, on_collapse):
    """SimSiam's test preset without its stop-gradient, with plain SGD at 40 per 256 (2.5 at
    batch 16): its head output falls to one direction within 8 steps (docs/operations.md)."""
    from configs import simsiam

    config = simsiam.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.checkpoint.async_save = False
    config.num_epochs = 3  # 12 steps, a log step every 2
    config.optim.name = "sgd"
    config.optim.base_lr = 40.0
    config.monitor.on_collapse = on_collapse
    config.monitor.patience = 2
    return config


@pytest.mark.e2e
def test_collapsing_run_stops_early_after_saving(tmp_path, shared_dirs, monkeypatch):
    from support.launch import read_events, scalar_values
    from support.runs import checkpoint_steps

    from jssl import losses
    from jssl.engines import train

    monkeypatch.setattr(losses, "simsiam_loss", _simsiam_without_stop_gradient)
    with pytest.raises(collapse.CollapseError, match="collapse/head_rank") as info:
        train.run(_collapsing_config(shared_dirs, "stop"), str(tmp_path))
    message = str(info.value)
    step = int(message.split("now step ")[1].split(".")[0])
    assert step < 12 and checkpoint_steps(tmp_path)[-1] == step
    assert f"saving step {step} in {tmp_path / 'checkpoints'}" in message
    assert "--config.monitor.on_collapse=warn" in message and "base_lr" in message
    logdir = tmp_path / "tensorboard"
    assert read_events(logdir)["collapse_alarm"] == {step: "text"}
    head_rank = scalar_values(logdir, "collapse/head_rank")
    features_std = scalar_values(logdir, "collapse/features_std")
    assert sorted(head_rank) == list(range(2, step + 1, 2))
    # The head output lies along one direction (RankMe: 16 at most, 1 collapsed) ...
    assert head_rank[2] > 4 and head_rank[step] < 2, head_rank
    # ... while the trunk's features are still spread: the alarm comes early.
    assert features_std[step] > 0.5 * features_std[2], features_std


@pytest.mark.slow
def test_collapsing_run_is_warned_about_and_goes_on(tmp_path, shared_dirs, monkeypatch):
    from support.launch import scalar_values

    from jssl import losses
    from jssl.engines import train

    monkeypatch.setattr(losses, "simsiam_loss", _simsiam_without_stop_gradient)
    warnings = []
    monkeypatch.setattr(collapse.logging, "warning", lambda fmt, *a: warnings.append(fmt % a))
    summary = train.run(_collapsing_config(shared_dirs, "warn"), str(tmp_path))
    assert summary["step"] == 12
    fired = [w for w in warnings if "collapse/head_rank" in w]
    assert len(fired) == 1 and "Training goes on" in fired[0], warnings
    step = int(fired[0].split("now step ")[1].split(".")[0])
    head_rank = scalar_values(tmp_path / "tensorboard", "collapse/head_rank")
    assert step < 12 and all(head_rank[s] < 2 for s in range(step, 13, 2)), head_rank


def test_healthy_run_does_not_fire(tmp_path, shared_dirs):
    from support.launch import scalar_values
    from support.runs import make_config

    from jssl.engines import train

    # MoCo's test preset, one epoch (the step test_train.py compiles too), acting at once.
    config = make_config(shared_dirs, num_epochs=1)
    config.monitor.on_collapse = "stop"
    config.monitor.patience = 1
    assert train.run(config, str(tmp_path))["step"] == 4
    logdir = tmp_path / "tensorboard"
    for name in ("head_rank", "head_std", "features_rank", "features_std"):
        values = scalar_values(logdir, f"collapse/{name}")
        assert sorted(values) == [2, 4] and all(v > 0 for v in values.values()), (name, values)


if __name__ == "__main__":
    _four_devices(sys.argv[1])
