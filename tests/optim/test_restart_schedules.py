"""VISSL's restart and inverse-sqrt schedules (cosine_warm_restart_scheduler.py,
inverse_sqrt_decay.py) against a float64 restatement of their formulas (test_schedules.py's
composite helpers)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_schedules import (
    IMAGENET_TRAIN,
    SIMCLR_LR,
    _cfg,
    _curve,
    _jssl_vissl_preset,
    scale_part,
    vissl_composite,
    vissl_part,
)

from jssl import optim


def _restart_yaml(wave_type, interval, adaptive):
    """configs/config/pretrain/swav/optimization/bs64_8node_cos_1restart_*.yaml (100 epochs)."""
    restart = {"name": "cosine_warm_restart", "start_value": 4.8, "end_value": 0.0048}
    restart.update(restart_interval_length=interval, wave_type=wave_type, is_adaptive=adaptive)
    return dict(
        SIMCLR_LR,
        schedulers=[SIMCLR_LR["schedulers"][0], restart],
        interval_scaling=["rescaled", "rescaled"],
    )


def _restart_fields(wave_type, interval, adaptive=False, multiplier=1.0):
    return dict(
        schedule="cosine_warm_restart",
        restart_wave_type=wave_type,
        restart_interval_length=interval,
        restart_adaptive=adaptive,
        restart_lr_multiplier=multiplier,
    )


def _restart_cfg(wave_type, interval, adaptive=False, multiplier=1.0, **kw):
    return _cfg(**{**_restart_fields(wave_type, interval, adaptive, multiplier), **kw})


def _bare(schedule, scaled):
    """A VISSL scheduler alone (no composite), after get_scaled_lr_scheduler."""
    schedule = dict(schedule)
    scale_part(schedule, scaled)
    return vissl_part(schedule)


@pytest.mark.parametrize(
    "wave_type,interval,adaptive",
    [("half", 0.5, False), ("half", 0.5, True), ("full", 0.334, False), ("full", 0.334, True)],
)
def test_swav_restart_recipes_are_vissls_value_for_value(wave_type, interval, adaptive):
    batch, num_epochs = 64 * 64, 100
    steps_per_epoch = IMAGENET_TRAIN // batch
    total = steps_per_epoch * num_epochs
    c = _jssl_vissl_preset(num_epochs, 0.1, 0.001, interval_scaling="rescaled")
    c.update(_restart_fields(wave_type, interval, adaptive))
    s = optim.build_schedule(
        c, steps_per_epoch=steps_per_epoch, num_epochs=num_epochs, global_batch=batch
    )
    got = _curve(s, total)
    ref = vissl_composite(
        _restart_yaml(wave_type, interval, adaptive), num_nodes=8, gpus_per_node=8, batch_per_gpu=64
    )
    want = np.array([ref(k / total) for k in range(total)])
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=5e-6)
    warm = total // 10
    np.testing.assert_allclose(got[0], 0.6, rtol=1e-6)  # the warmup, rewritten as for SimCLR
    if wave_type == "half":  # the peak again half-way through the part after the warmup
        restart = warm + (total - warm) // 2
        assert got[restart] > 10 * got[restart - 1]
        second_peak = 0.0048 + 0.5 * (4.8 - 0.0048) * (1 + math.cos(math.pi * 0.5))
        np.testing.assert_allclose(got[restart], second_peak if adaptive else 4.8, rtol=1e-5)
    else:  # falls to the end, rises again; adaptive: the first wave starts below the peak
        first_peak = 0.0048 + 0.5 * (4.8 - 0.0048) * (1 + math.cos(math.pi * 0.334))
        np.testing.assert_allclose(got[warm], first_peak if adaptive else 4.8, rtol=1e-5)
        trough, second = (warm + round(x * (total - warm)) for x in (0.334, 0.668))
        assert got[trough] < 0.0049 and got[second] > got[trough] * 100
        second_peak = 0.0048 + 0.5 * (4.8 - 0.0048) * (1 + math.cos(math.pi * 0.668))
        np.testing.assert_allclose(got[second], second_peak if adaptive else 4.8, rtol=1e-5)


@pytest.mark.parametrize("wave_type", ["half", "full"])
@pytest.mark.parametrize("adaptive,multiplier", [(False, 1.0), (False, 0.5), (True, 0.5)])
@pytest.mark.parametrize("interval", [0.1, 0.3, 0.25])
def test_bare_restarts_are_vissls_including_float_boundaries(
    wave_type, adaptive, multiplier, interval
):
    # No warmup: the scheduler alone reads where = k / 1000. With L = 0.1 numpy's arange puts
    # the third restart at 0.30000000000000004 and 0.3 % 0.1 is 0.0999...: VISSL's half wave
    # is at its trough at step 300 and restarts at 301; the curve must do the same.
    c = _restart_cfg(wave_type, interval, adaptive, multiplier, base_lr=2.0, final_lr_fraction=0.01)
    c.base_lr_batch_size, c.warmup_epochs = 0, 0.0
    s = optim.build_schedule(c, steps_per_epoch=10, num_epochs=100, global_batch=8)
    ref = _bare(
        dict(
            name="cosine_warm_restart",
            start_value=2.0,
            end_value=0.02,
            restart_interval_length=interval,
            wave_type=wave_type,
            lr_multiplier=multiplier,
            is_adaptive=adaptive,
        ),
        2.0,
    )
    got = _curve(s, 1000)
    np.testing.assert_allclose(got, [ref(k / 1000) for k in range(1000)], rtol=2e-6, atol=2e-6)
    if wave_type == "half" and interval == 0.1 and not adaptive:
        np.testing.assert_allclose(got[300], 0.02, rtol=1e-5)
        restarted = 0.02 + (2.0 * multiplier**3 - 0.02) * math.cos(0.5 * math.pi * 0.01) ** 2
        np.testing.assert_allclose(got[301], restarted, rtol=1e-6)


@pytest.mark.parametrize("wave_type", ["half", "full"])
def test_fixed_restarts_after_a_warmup_read_the_global_progress(wave_type):
    yaml = dict(_restart_yaml(wave_type, 0.25, False), interval_scaling=["rescaled", "fixed"])
    yaml["schedulers"][1] = dict(yaml["schedulers"][1], lr_multiplier=0.7)
    c = _jssl_vissl_preset(20, 0.1, 0.001, interval_scaling="fixed")
    c.update(_restart_fields(wave_type, 0.25, multiplier=0.7))
    s = optim.build_schedule(c, steps_per_epoch=50, num_epochs=20, global_batch=4096)
    ref = vissl_composite(yaml, num_nodes=8, gpus_per_node=8, batch_per_gpu=64)
    np.testing.assert_allclose(
        _curve(s, 1000), [ref(k / 1000) for k in range(1000)], rtol=2e-6, atol=5e-6
    )


def test_restarts_by_epoch_read_where_at_the_epoch_start():
    c = _jssl_vissl_preset(20, 0.1, 0.001, interval_scaling="rescaled", update_interval="epoch")
    c.update(_restart_fields("half", 0.5))
    s = optim.build_schedule(c, steps_per_epoch=7, num_epochs=20, global_batch=4096)
    ref = vissl_composite(
        _restart_yaml("half", 0.5, False), num_nodes=8, gpus_per_node=8, batch_per_gpu=64
    )
    want = [ref((k // 7) * 7 / 140) for k in range(140)]
    np.testing.assert_allclose(_curve(s, 140), want, rtol=2e-6, atol=5e-6)


def test_a_long_run_follows_vissls_float64_where_around_the_warmups_end():
    # 2M steps with a warmup ending between steps (200000.5): at step 200000 fvcore already
    # moved on (where + 1e-6 > 0.1) but the rescaled where is slightly negative, so VISSL's
    # half wave reads where % L ~ L there: one step at the trough before the peak.
    c = _jssl_vissl_preset(100, 0.1, 0.001, interval_scaling="rescaled")
    c.update(_restart_fields("half", 0.5))
    c.warmup_epochs = 10.000025
    s = jax.jit(optim.build_schedule(c, steps_per_epoch=20_000, num_epochs=100, global_batch=4096))
    yaml = dict(_restart_yaml("half", 0.5, False), lengths=[0.10000025, 1 - 0.10000025])
    ref = vissl_composite(yaml, num_nodes=8, gpus_per_node=8, batch_per_gpu=64)
    total = 2_000_000
    steps = [0, 199_999, 200_000, 200_001, 200_002, 1_100_000, 1_100_001, 1_999_999]
    steps += [1_100_000 + d for d in (-2, -1, 2, 3)] + list(range(0, total, 99_991))
    got = [float(s(k)) for k in steps]
    np.testing.assert_allclose(got, [ref(k / total) for k in steps], rtol=2e-6, atol=5e-6)
    np.testing.assert_allclose(got[2], 0.0048, rtol=1e-3)  # the one step at the trough
    np.testing.assert_allclose(got[3], 4.8, rtol=1e-6)


INVERSE_SQRT_LR = {
    "auto_lr_scaling": {"auto_scale": True, "base_value": 0.3, "base_lr_batch_size": 256},
    "schedulers": [
        {"name": "linear", "start_value": 0.6, "end_value": 4.8},
        {"name": "inverse_sqrt", "start_value": 4.8, "warmup_interval_length": 0.1},
    ],
    "interval_scaling": ["rescaled", "fixed"],
    "lengths": [0.1, 0.9],
}


def test_inverse_sqrt_after_a_warmup_is_vissls():
    c = _jssl_vissl_preset(100, 0.1, 0.0, schedule="inverse_sqrt")
    s = optim.build_schedule(c, steps_per_epoch=31, num_epochs=100, global_batch=4096)
    ref = vissl_composite(INVERSE_SQRT_LR, num_nodes=8, gpus_per_node=8, batch_per_gpu=64)
    got = _curve(s, 3100)
    np.testing.assert_allclose(got, [ref(k / 3100) for k in range(3100)], rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(got[310], 4.8, rtol=1e-6)  # the peak at the warmup's end
    np.testing.assert_allclose(got[-1], 4.8 * math.sqrt(0.1 / (3099 / 3100)), rtol=1e-6)


@pytest.mark.parametrize("update_interval", ["step", "epoch"])
def test_inverse_sqrt_without_warmup_is_vissls(update_interval):
    # warmup_interval_length 0: the start value at where 0, then start / sqrt(where), above
    # the start for the whole run (VISSL's formula, kept).
    c = _cfg(schedule="inverse_sqrt", base_lr=0.1, base_lr_batch_size=256, warmup_epochs=0.0)
    c.update_interval = update_interval
    s = optim.build_schedule(c, steps_per_epoch=10, num_epochs=50, global_batch=512)
    ref = _bare({"name": "inverse_sqrt", "start_value": 0.1, "warmup_interval_length": 0.0}, 0.2)
    spe = 10 if update_interval == "epoch" else 1
    want = [ref((k // spe) * spe / 500) for k in range(500)]
    got = _curve(s, 500)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    np.testing.assert_allclose(got[0], 0.2, rtol=1e-6)
    np.testing.assert_allclose(got[-1], 0.2 / math.sqrt((500 - spe) / 500), rtol=1e-6)


def test_inverse_sqrt_keeps_its_warmup_length_when_one_node_drops_the_warmup():
    # resolve_linear_schedule removes the linear part but not warmup_interval_length.
    c = _jssl_vissl_preset(10, 0.1, 0.0, schedule="inverse_sqrt", warmup_start_nodes=1)
    s = optim.build_schedule(c, steps_per_epoch=10, num_epochs=10, global_batch=2048)
    ref = vissl_composite(INVERSE_SQRT_LR, num_nodes=1, gpus_per_node=8, batch_per_gpu=256)
    got = _curve(s, 100)
    np.testing.assert_allclose(got, [ref(k / 100) for k in range(100)], rtol=2e-6)
    np.testing.assert_allclose(got[0], 2.4 * math.sqrt(0.1), rtol=1e-6)


def test_new_schedule_settings_name_the_field():
    kw = dict(steps_per_epoch=10, num_epochs=10, global_batch=256)
    with pytest.raises(ValueError, match="cosine_warm_restart.*inverse_sqrt"):
        optim.build_schedule(_cfg(schedule="cosine_restart"), **kw)
    with pytest.raises(ValueError, match="optim.restart_wave_type"):
        optim.build_schedule(_restart_cfg("quarter", 0.5), **kw)
    with pytest.raises(ValueError, match="optim.restart_interval_length"):
        optim.build_schedule(_restart_cfg("half", 0.0), **kw)
    with pytest.raises(ValueError, match="optim.interval_scaling=fixed"):
        optim.build_schedule(_cfg(schedule="inverse_sqrt", warmup_epochs=1.0), **kw)
    with pytest.raises(ValueError, match="optim.warmup_epochs"):
        optim.build_schedule(_restart_cfg("half", 0.5, warmup_epochs=10.0), **kw)


def test_a_config_saved_without_the_restart_fields_still_builds():
    c = _cfg(schedule="cosine_warm_restart", base_lr=1.0, base_lr_batch_size=0)
    for name in (
        "restart_interval_length",
        "restart_wave_type",
        "restart_lr_multiplier",
        "restart_adaptive",
    ):
        del c[name]
    s = optim.build_schedule(c, steps_per_epoch=10, num_epochs=10, global_batch=8)
    np.testing.assert_allclose([s(0), s(49), s(50)], [1.0, 0.0, 1.0], atol=2e-3)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(schedule="cosine_warm_restart", restart_wave_type="half"),
        dict(schedule="cosine_warm_restart", restart_wave_type="full", restart_adaptive=True),
        dict(schedule="cosine_warm_restart", restart_lr_multiplier=0.5, warmup_epochs=1.0),
        dict(schedule="inverse_sqrt"),
        dict(schedule="inverse_sqrt", warmup_epochs=1.0, interval_scaling="fixed"),
    ],
)
def test_each_new_schedule_drives_an_optimizer(overrides):
    c = _cfg(name="sgd", momentum=0.0, weight_decay=0.0, base_lr=0.5, **overrides)
    schedule = optim.build_schedule(c, steps_per_epoch=5, num_epochs=4, global_batch=256)
    params = {"w": jnp.ones(3)}
    tx = optim.build_optimizer(c, params, schedule, steps_per_epoch=5, num_epochs=4)
    state = tx.init(params)
    step = jax.jit(tx.update)
    grads = {"w": jnp.full(3, 2.0)}
    for k in range(20):  # optax counts its steps as the trainer does: the rate at step k
        updates, state = step(grads, state, params)
        np.testing.assert_allclose(updates["w"], -2.0 * float(schedule(k)), rtol=1e-5)
