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
