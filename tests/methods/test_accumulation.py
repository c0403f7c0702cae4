"""Exact gradient accumulation (jssl.training.accumulation): on a trunk and heads without
batch norm, 4 micro-batches give the loss, metrics, gradient and state updates of the step's
pass over the whole batch, for every method (those whose objective is a mean of per-example
terms, BYOL's, SimSiam's and the supervised method's, with JSSL_SLOW_TESTS=1); with batch
norm each micro-batch is normalised on its own and the new running statistics are the mean of
the micro-batches'."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.step_parity import without_batch_norm
from test_contract import _config

from jssl import data, methods, parallel
from jssl.data import device_augment
from jssl.engines import train
from jssl.parallel import DATA_AXIS
from jssl.training import accumulation
from jssl.training.step import make_train_step

BATCH = 16
STEPS = 4


def _batch(config):
    host = data.synthetic_batch(config.data, BATCH, seed=0)
    host["label"] = np.arange(BATCH, dtype=np.int32) % 10
    return host


def _start(config):
    mesh = parallel.make_mesh()
    method = methods.get(config, steps_per_epoch=4)
    tx, _ = train.make_optimizer(config, method, steps_per_epoch=4)
    state = train.init_state(config, method, tx, mesh)
    batch = parallel.host_batch_to_global(_batch(config), mesh)
    return mesh, method, state, batch


def _whole_and_micro(config):
    """((loss, LossOutput), grads) of the step's whole-batch composition and of
    accumulation over STEPS micro-batches, on the same state and batch, in one program."""
    mesh, method, state, batch = _start(config)
    augment = device_augment.make_batch_augment(config.data)  # as the step does

    def per_replica(state, batch):
        batch = batch if augment is None else augment(batch)
        rng = jax.random.fold_in(state.rng, state.step)
        loss = functools.partial(methods.loss, method)
        whole = jax.value_and_grad(loss, has_aux=True)(state.params, state, batch, rng)
        micro = accumulation.value_and_grad(method, state.params, state, batch, rng, STEPS)
        return whole, micro

    run = jax.shard_map(
        per_replica, mesh=mesh, in_specs=(P(), P(DATA_AXIS)), out_specs=P(), check_vma=False
    )
    return jax.device_get(jax.jit(run)(state, batch))


def _relative(a, b) -> float:
    a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(a)] or [np.zeros(1)])
    b = np.concatenate([np.ravel(x) for x in jax.tree.leaves(b)] or [np.zeros(1)])
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-12))


# Objectives that are means of per-example terms: nothing couples the micro-batches.
PER_EXAMPLE = ("byol", "simsiam", "supervised")
# Slow tier too, for the CI's time: couplings of the kinds the CI rows hold (MoCo's queue,
# SimCLR's negatives, SwAV's Sinkhorn and queue, DINO's centre, Barlow Twins' batch statistics,
# DeepCluster v2's bank): MoCo v3's keys (SimCLR's), VICReg's statistics (Barlow Twins'), iBOT's
# and DINOv2's centres and Sinkhorn (DINO's, SwAV's), MSN's mean entropy, MAE's per-example loss.
COVERED = ("mocov3", "vicreg", "ibot", "dinov2", "msn", "mae")


@pytest.mark.e2e
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n in PER_EXAMPLE + COVERED else n
        for n in methods.METHODS
    ],
)
def test_micro_batches_give_the_whole_batch_step(name):
    """The loss, metrics, carry (what after_update applies: keys to enqueue, DINO's centre,
    SwAV's queue) and the gradient (compared as one vector: float32 sums in another order)."""
    assert jax.device_count() == 1  # the whole local batch is the global batch
    ((whole_loss, whole), whole_grads), ((micro_loss, micro), micro_grads) = _whole_and_micro(
        without_batch_norm(_config(name))
    )
    np.testing.assert_allclose(micro_loss, whole_loss, rtol=2e-5)
    for key, value in whole.metrics.items():
        np.testing.assert_allclose(micro.metrics[key], value, rtol=2e-5, atol=1e-6, err_msg=key)
    assert jax.tree.structure(micro.carry) == jax.tree.structure(whole.carry)
    assert _relative(whole.carry, micro.carry) < 1e-5
    assert _relative(whole.features, micro.features) < 1e-5
    assert _relative(whole_grads, micro_grads) < 1e-4


def test_the_train_step_accumulates():
    """make_train_step(accumulation_steps=4): the same metrics and updated state as one pass."""
    config = without_batch_norm(_config("moco"))
    results = []
    for steps in (1, STEPS):
        mesh, method, state, batch = _start(config)
        before = jax.device_get(state.params)
        tx, schedule = train.make_optimizer(config, method, steps_per_epoch=4)
        step = make_train_step(method, tx, schedule, mesh, accumulation_steps=steps)
        after, metrics = jax.device_get(step(state, batch))
        delta = jax.tree.map(lambda a, b: a - b, after.params, before)
        results.append((metrics, delta, after.method_state, after.ema_params))
    (whole, *whole_state), (micro, *micro_state) = results
    for key in whole:
        np.testing.assert_allclose(micro[key], whole[key], rtol=2e-5, atol=1e-6, err_msg=key)
    for a, b in zip(whole_state, micro_state, strict=True):
        assert _relative(a, b) < 1e-4


def _rows(batch, start, stop):
    return jax.tree.map(lambda x: x[start:stop], batch)


@pytest.mark.e2e
def test_batch_norm_statistics_are_the_micro_batches_mean():
    config = _config("moco")  # ResNet with batch norm, per device
    config.method.shuffle_bn = False
    _, method, state, batch = _start(config)
    augment = device_augment.make_batch_augment(config.data)
    batch = batch if augment is None else jax.jit(augment)(batch)
    rng = jax.random.fold_in(state.rng, state.step)

    def forward_stats(micro):  # per replica: the forward averages the teacher's over devices
        return method.forward(state.params, state, micro, rng, True).batch_stats

    mesh = parallel.make_mesh()
    running_stats = jax.jit(
        jax.shard_map(forward_stats, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    )

    quarter = BATCH // STEPS
    parts = [running_stats(_rows(batch, j * quarter, (j + 1) * quarter)) for j in range(STEPS)]
    expected = jax.tree.map(lambda *x: np.mean(np.stack(x), axis=0), *jax.device_get(parts))
    ((_, whole), _), ((_, micro), _) = _whole_and_micro(config)
    assert _relative(expected, micro.batch_stats) < 1e-5
    # A real difference from the whole batch's statistics, so the test can fail.
    assert _relative(whole.batch_stats, micro.batch_stats) > 1e-3


def test_accumulation_steps_must_divide_each_devices_share():
    config = _config("moco")
    config.optim.accumulation_steps = 3
    with pytest.raises(ValueError, match="accumulation_steps=3 must be >= 1 and divide"):
        accumulation.check_config(config)
    config.optim.accumulation_steps = 4
    accumulation.check_config(config)
