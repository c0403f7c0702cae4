"""VISSL's learning-rate curves: composite warmup + cosine, cosine with warm restarts,
inverse square root, interval scaling, auto-scaling.

The reference below writes out, in float64 and independently of jssl.optim.schedules, what
VISSL computes: ``hydra_config.infer_learning_rate`` / ``get_scaled_lr_scheduler`` /
``resolve_linear_schedule`` rewrite the YAML's schedule, then fvcore's
``CompositeParamScheduler`` (``WHERE_EPSILON = 1e-6``) of ``LinearParamScheduler``,
``CosineParamScheduler`` and VISSL's ``CosineWarmRestartScheduler``
(``vissl/optimizers/param_scheduler/cosine_warm_restart_scheduler.py``) or
``InverseSqrtScheduler`` (``.../inverse_sqrt_decay.py``) is read at
``where = step / total_steps``.
"""

import bisect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from jssl import optim
from jssl.optim import schedules

IMAGENET_TRAIN = 1_281_167  # DROP_LAST: True, so an epoch is floor(1281167 / batch) steps


def _cfg(**overrides):
    c = base.get_base_config().optim
    for k, v in overrides.items():
        setattr(c, k, v)
    return c


def vissl_composite(yaml: dict, *, num_nodes: int, gpus_per_node: int, batch_per_gpu: int):
    """What VISSL's hydra_config does to ``param_schedulers.lr``, then fvcore's composite.
    Returns ``lr(where)``."""
    auto = yaml["auto_lr_scaling"]
    world = num_nodes * gpus_per_node
    factor = batch_per_gpu * world / auto["base_lr_batch_size"]
    if auto.get("scaling_type", "linear") == "sqrt":
        factor = math.sqrt(factor)
    scaled = auto["base_value"] * factor
    parts = [dict(p) for p in yaml["schedulers"]]
    lengths = list(yaml["lengths"])
    scalings = list(yaml["interval_scaling"])
    for p in parts:
        scale_part(p, scaled)
    # resolve_linear_schedule: the warmup starts at the base value scaled (linearly) to the
    # batch of one node; on one node a warmup that does not climb is removed.
    start = auto["base_value"] * batch_per_gpu * gpus_per_node / auto["base_lr_batch_size"]
    for i, p in enumerate(parts):
        if p["name"] == "linear":
            p["start_value"] = start
            if num_nodes == 1 and start <= p["end_value"]:
                del parts[i], lengths[i], scalings[i]
                if len(parts) == 1:  # the remaining scheduler becomes the whole schedule
                    lengths, scalings = [1.0], ["rescaled"]
                break

    def lr(where):
        i, running = 0, lengths[0]
        while where + 1e-6 > running and i < len(parts) - 1:
            i += 1
            running += lengths[i]
        w = where
        if scalings[i] == "rescaled":
            w = (where - (running - lengths[i])) / lengths[i]
        return vissl_part(parts[i])(w)

    return lr


def scale_part(p: dict, scaled: float) -> None:
    """get_scaled_lr_scheduler on one scheduler ("cosine" in the name covers the restarts)."""
    if "cosine" in p["name"]:
        mult = p["end_value"] / p["start_value"]
        p["start_value"], p["end_value"] = scaled, scaled * mult
    elif p["name"] in ("linear",):
        p["end_value"] = scaled
    elif p["name"] == "inverse_sqrt":
        p["start_value"] = scaled


def vissl_part(p: dict):
    """One scheduler as a function of its where."""
    start, end = p["start_value"], p.get("end_value")
    if p["name"] == "linear":
        return lambda w: end * w + start * (1 - w)
    if p["name"] == "cosine":
        return lambda w: end + 0.5 * (start - end) * (1 + math.cos(math.pi * w))
    if p["name"] == "inverse_sqrt":
        length = p["warmup_interval_length"]
        decay = start * length**0.5 if length > 0.0 else start
        return lambda w: decay * w**-0.5 if w > 0.0 else decay
    assert p["name"] == "cosine_warm_restart"
    interval, full = p["restart_interval_length"], p["wave_type"] == "full"
    restarts = [0.0] + np.arange(interval, 1.0, (2 if full else 1) * interval).tolist()
    peaks = []
    for idx, restart in enumerate(restarts):
        if p.get("is_adaptive", False):
            x = interval + restart if full else restart
            desired = end + 0.5 * (start - end) * (1 + math.cos(math.pi * x))
            multiplier = desired / start
        else:
            multiplier = pow(p.get("lr_multiplier", 1.0), idx)
        peaks.append(start * multiplier)

    def restart_lr(w):
        peak = peaks[max(bisect.bisect(restarts, w) - 1, 0)]
        w = w / interval if full else (w % interval) / interval
        return end + 0.5 * (peak - end) * (1 + math.cos(math.pi * w))

    return restart_lr


# configs/config/pretrain/simclr/simclr_8node_resnet.yaml (100 epochs) and
# swav/swav_8node_resnet.yaml (400 epochs): OPTIMIZER.param_schedulers.lr.
SIMCLR_LR = {
    "auto_lr_scaling": {"auto_scale": True, "base_value": 0.3, "base_lr_batch_size": 256},
    "schedulers": [
        {"name": "linear", "start_value": 0.6, "end_value": 4.8},
        {"name": "cosine", "start_value": 4.8, "end_value": 0.0},
    ],
    "interval_scaling": ["rescaled", "fixed"],
    "lengths": [0.1, 0.9],
}
SWAV_LR = {
    "auto_lr_scaling": {"auto_scale": True, "base_value": 0.3, "base_lr_batch_size": 256},
    "schedulers": [
        {"name": "linear", "start_value": 0.3, "end_value": 4.8},
        {"name": "cosine", "start_value": 4.8, "end_value": 0.0048},
    ],
    "interval_scaling": ["rescaled", "fixed"],
    "lengths": [0.025, 0.975],
}


def _jssl_vissl_preset(num_epochs, warmup_fraction, final_lr_fraction, **kw):
    fields = dict(
        base_lr=0.3,
        base_lr_batch_size=256,
        schedule="cosine",
        warmup_epochs=warmup_fraction * num_epochs,
        warmup_start_lr=123.0,  # overwritten by the auto-scaling rule, as VISSL's start_value
        warmup_start_nodes=8,
        interval_scaling="fixed",
        final_lr_fraction=final_lr_fraction,
        update_interval="step",
    )
    return _cfg(**{**fields, **kw})


def _curve(schedule, total):
    return np.asarray(jax.jit(jax.vmap(schedule))(jnp.arange(total)), np.float64)


@pytest.mark.parametrize(
    "yaml,num_epochs,final_lr_fraction", [(SIMCLR_LR, 100, 0.0), (SWAV_LR, 400, 0.0048 / 4.8)]
)
def test_imagenet_recipe_curve_is_vissls_value_for_value(yaml, num_epochs, final_lr_fraction):
    batch = 64 * 64  # BATCHSIZE_PER_REPLICA 64, 8 nodes x 8 GPUs
    steps_per_epoch = IMAGENET_TRAIN // batch  # 312
    total = steps_per_epoch * num_epochs
    c = _jssl_vissl_preset(num_epochs, yaml["lengths"][0], final_lr_fraction)
    s = optim.build_schedule(
        c, steps_per_epoch=steps_per_epoch, num_epochs=num_epochs, global_batch=batch
    )
    got = _curve(s, total)
    ref = vissl_composite(yaml, num_nodes=8, gpus_per_node=8, batch_per_gpu=64)
    want = np.array([ref(k / total) for k in range(total)])
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    # The landmarks, in words: warmup from 0.6 (VISSL overwrites SwAV's YAML 0.3 too) to the
    # 4.8 peak, then the cosine on the global progress: a drop below the peak at the switch.
    warm = int(yaml["lengths"][0] * total)
    np.testing.assert_allclose(got[0], 0.6, rtol=1e-6)
    cos_at_switch = 0.5 * (4.8 - 4.8 * final_lr_fraction) * (1 + math.cos(math.pi * warm / total))
    np.testing.assert_allclose(got[warm], 4.8 * final_lr_fraction + cos_at_switch, rtol=1e-6)
    assert got[warm - 1] < 4.8 and got[warm] < got[warm - 1]
    np.testing.assert_allclose(got[-1], ref((total - 1) / total), rtol=1e-4, atol=1e-7)


def test_epoch_update_interval_reads_where_at_the_epoch_start():
    num_epochs, spe, batch = 20, 7, 4096
    c = _jssl_vissl_preset(num_epochs, 0.1, 0.0, update_interval="epoch")
    s = optim.build_schedule(c, steps_per_epoch=spe, num_epochs=num_epochs, global_batch=batch)
    ref = vissl_composite(SIMCLR_LR, num_nodes=8, gpus_per_node=8, batch_per_gpu=64)
    total = spe * num_epochs
    want = [ref((k // spe) * spe / total) for k in range(total)]
    np.testing.assert_allclose(_curve(s, total), want, rtol=2e-6, atol=1e-6)


def test_rescaled_cosine_restarts_from_the_peak():
    yaml = dict(SIMCLR_LR, interval_scaling=["rescaled", "rescaled"])
    c = _jssl_vissl_preset(10, 0.1, 0.0, interval_scaling="rescaled")
    s = optim.build_schedule(c, steps_per_epoch=10, num_epochs=10, global_batch=4096)
    ref = vissl_composite(yaml, num_nodes=8, gpus_per_node=8, batch_per_gpu=64)
    np.testing.assert_allclose(
        _curve(s, 100), [ref(k / 100) for k in range(100)], rtol=2e-6, atol=1e-7
    )
    np.testing.assert_allclose(s(10), 4.8, rtol=1e-6)  # the peak right after the warmup


def test_sqrt_scaling_scales_the_peak_but_not_the_warmup_start():
    # 4096 / 256 = 16: the peak is 0.3 * 4 = 1.2; the warmup start stays linear, 0.3 * 2.
    yaml = dict(SIMCLR_LR, auto_lr_scaling=dict(SIMCLR_LR["auto_lr_scaling"], scaling_type="sqrt"))
    c = _jssl_vissl_preset(10, 0.1, 0.0, lr_scaling="sqrt")
    assert schedules.peak_learning_rate(c, 4096) == pytest.approx(1.2)
    assert schedules.warmup_start_learning_rate(c, 4096) == pytest.approx(0.6)
    s = optim.build_schedule(c, steps_per_epoch=10, num_epochs=10, global_batch=4096)
    ref = vissl_composite(yaml, num_nodes=8, gpus_per_node=8, batch_per_gpu=64)
    np.testing.assert_allclose(
        _curve(s, 100), [ref(k / 100) for k in range(100)], rtol=2e-6, atol=1e-7
    )


@pytest.mark.parametrize("scaling,dropped", [("linear", True), ("sqrt", False)])
def test_one_node_drops_a_warmup_that_would_not_climb(scaling, dropped):
    # The whole batch of 2048 on one node (8 GPUs x 256): the warmup would start at
    # 0.3 * 2048 / 256 = 2.4, the linear peak.
    yaml = dict(SIMCLR_LR, auto_lr_scaling=dict(SIMCLR_LR["auto_lr_scaling"], scaling_type=scaling))
    c = _jssl_vissl_preset(10, 0.1, 0.0, lr_scaling=scaling, warmup_start_nodes=1)
    s = optim.build_schedule(c, steps_per_epoch=10, num_epochs=10, global_batch=2048)
    ref = vissl_composite(yaml, num_nodes=1, gpus_per_node=8, batch_per_gpu=256)
    got = _curve(s, 100)
    np.testing.assert_allclose(got, [ref(k / 100) for k in range(100)], rtol=2e-6, atol=1e-7)
    peak = 0.3 * (8 if scaling == "linear" else math.sqrt(8))
    if dropped:  # the cosine alone, from the peak, over the whole run
        np.testing.assert_allclose(got[0], peak, rtol=1e-6)
    else:  # sqrt: the start (linear, 2.4) is above the peak, and VISSL keeps the "warmup"
        np.testing.assert_allclose(got[0], 2.4, rtol=1e-6)


def test_without_warmup_start_nodes_the_given_start_is_kept():
    c = _jssl_vissl_preset(10, 0.1, 0.0, warmup_start_nodes=0, warmup_start_lr=0.05)
    s = optim.build_schedule(c, steps_per_epoch=10, num_epochs=10, global_batch=4096)
    np.testing.assert_allclose(s(0), 0.05, rtol=1e-6)
    np.testing.assert_allclose(s(5), 0.05 + (4.8 - 0.05) * 0.5, rtol=1e-6)


def test_bad_schedule_settings_name_the_field():
    kw = dict(steps_per_epoch=10, num_epochs=10, global_batch=256)
    with pytest.raises(ValueError, match="optim.lr_scaling"):
        optim.build_schedule(_cfg(lr_scaling="log"), **kw)
    with pytest.raises(ValueError, match="optim.interval_scaling"):
        optim.build_schedule(_cfg(schedule="cosine", interval_scaling="fixd"), **kw)
    with pytest.raises(ValueError, match="optim.warmup_epochs"):
        optim.build_schedule(_cfg(schedule="cosine", warmup_epochs=10), **kw)


def test_computed_once_keeps_the_values_and_compiles_the_rate_once():
    """The optimizer's rate is evaluated once in the compiled step, not in every parameter's
    update fusion (XLA's CPU fusion copies cheap scalar ops into each consumer)."""
    config = _cfg(schedule="multistep", milestones=(2, 3), gamma=0.1, update_interval="epoch")
    schedule = schedules.build_schedule(config, steps_per_epoch=10, num_epochs=4, global_batch=256)
    once = schedules.computed_once(schedule)
    steps = jnp.arange(45)
    np.testing.assert_array_equal(jax.vmap(once)(steps), jax.vmap(schedule)(steps))

    leaves = [jnp.ones((8 + i, 4)) for i in range(12)]

    def signs(rate) -> int:  # the multistep rate's ops include one sign per milestone
        update = jax.jit(lambda step, leaves: [rate(step) * x for x in leaves])
        return update.lower(jnp.int32(0), leaves).compile().as_text().count(" sign(")

    assert signs(schedule) >= len(leaves)  # what computed_once avoids
    assert signs(once) <= 4


# --------------------------------------------------------------------------------------------
# cosine_warm_restart and inverse_sqrt


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
