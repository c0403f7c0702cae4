"""SwAV: its state updates in the real step (frozen then normalised prototypes, the queue
filling and switching on), its loss terms per assignment crop (their sum is the single loss of
before, a zero weight drops a crop's targets, each is logged), presets and start-up checks.
The loss and Sinkhorn are tested in test_losses*.py; 1 vs 4 devices in test_parallel.py; the
contract and a run end to end (each term written and logged) in test_contract*.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import base, swav
from jssl import data, losses, methods, optim, parallel
from jssl.engines import train
from jssl.methods import common
from jssl.methods.swav import Prototypes
from jssl.parallel import DATA_AXIS


def test_presets_follow_vissl():
    config = swav.get_config()
    assert config.data.augment.num_crops == (2, 6) and config.data.augment.crop_sizes == (224, 96)
    assert config.data.augment.crop_scale == ((0.14, 1.0), (0.05, 0.14))
    assert config.method.num_prototypes == (3000,) and config.method.crops_for_assign == (0, 1)
    assert config.method.freeze_prototypes_iters == 313 and config.optim.name == "larc"
    assert config.optim.final_lr_fraction == pytest.approx(0.0048 / 4.8)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("method.crops_for_assign", (0, 6), r"crops_for_assign=\(0, 6\).*\[0, 6\)"),
        ("method.crops_for_assign", (1, 1), "distinct"),
        ("method.queue_length", 40, "queue_length=40 must be 0.*multiple of data.batch_size=16"),
        ("method.num_prototypes", (), "num_prototypes"),
        ("method.epsilon", 0.0, "method.epsilon=0.0"),
        ("data.augment.crop_sizes", (16,), "at least two crops"),  # with num_crops (1,)
        ("method.use_double_precision", True, "JAX_ENABLE_X64"),
    ],
)
def test_bad_settings_name_the_field(field, value, message):
    config = swav.get_config("test")
    config.update_from_flattened_dict({field: value})
    if field == "data.augment.crop_sizes":
        config.data.augment.num_crops = (1,)
        config.data.augment.crop_scale = (0.2, 1.0)
    with pytest.raises(ValueError, match=message):
        train.validate(config)


def test_frozen_then_normalised_prototypes_and_the_queue(shared_dirs):
    # The step of the end-to-end run in test_contract_runs.py (same config, probe included), so the
    # persistent compilation cache serves one of them to the other.
    config = swav.get_config("test")  # queue of 2 batches, on from step 2; frozen 2 steps
    steps_per_epoch = 4  # 64 examples / batch 16
    mesh = parallel.make_mesh()
    method = methods.get(config, steps_per_epoch)
    tx, schedule = train.make_optimizer(config, method, steps_per_epoch)
    state = train.init_state(config, method, tx, mesh)
    from jssl.training.step import make_train_step

    step = make_train_step(method, tx, schedule, mesh, probe_config=config)

    def prototypes(s):
        return np.asarray(s.params["prototypes"]["prototypes0"]["kernel"])

    start = prototypes(state)
    np.testing.assert_allclose(np.linalg.norm(start, axis=0), 1.0, rtol=1e-5)
    trunk = np.asarray(jax.tree.leaves(state.params["trunk"])[0])
    seen = []
    for i in range(4):
        batch = parallel.host_batch_to_global(data.synthetic_batch(config.data, 16, seed=i), mesh)
        state, metrics = step(state, batch)
        seen.append(
            (
                float(metrics["queue_on"]),
                int(state.method_state["queue_filled"]),
                int(state.method_state["queue_ptr"]),
                prototypes(state),
            )
        )
    # Steps 1-2: prototypes held fixed (the rest moves); then they move and stay unit-norm.
    np.testing.assert_allclose(seen[1][3], start, atol=1e-6)  # renormalised only
    assert not np.allclose(np.asarray(jax.tree.leaves(state.params["trunk"])[0]), trunk)
    assert np.abs(seen[2][3] - start).max() > 1e-6
    np.testing.assert_allclose(np.linalg.norm(seen[3][3], axis=0), 1.0, rtol=1e-5)
    # The queue fills 16 rows a step (32 in all) and is used from the 3rd step (full).
    assert [s[:3] for s in seen] == [(0.0, 16, 16), (0.0, 32, 0), (1.0, 32, 16), (1.0, 32, 0)]
    queue = np.asarray(state.method_state["queue"])
    assert queue.shape == (2, 32, config.model.head_dims[-1])
    np.testing.assert_allclose(np.linalg.norm(queue, axis=-1), 1.0, rtol=1e-5)


def test_freeze_for_steps_holds_only_the_named_parameters():
    import jax.numpy as jnp
    import optax

    params = {"prototypes": {"w": jnp.ones(3)}, "head": {"w": jnp.ones(3)}}
    tx = optim.freeze_for_steps(optax.sgd(0.1, momentum=0.9), params, (("prototypes", 2),))
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    moved = []
    for _ in range(3):
        updates, state = tx.update(grads, state, params)
        moved.append((float(updates["prototypes"]["w"][0]), float(updates["head"]["w"][0])))
    assert moved[0][0] == moved[1][0] == 0.0 and moved[2][0] == pytest.approx(-0.1)
    assert moved[0][1] == pytest.approx(-0.1)  # the rest trains from the first step
    with pytest.raises(ValueError, match="match no parameter"):
        optim.freeze_for_steps(optax.sgd(0.1), params, (("protos", 2),))


# ---------------------------------------------------------------------------------------------
# Loss terms per assignment crop


def _loss_and_grads(config, batch_seed: int = 0, reference: bool = False):
    """The method's loss, gradients, metrics and per-example outputs in the real sharded
    setting; with ``reference`` also the loss of before the split into terms (the mean over
    prototype sets of ``losses.swav_loss``), from the same forward."""
    mesh = parallel.make_mesh()
    method = methods.get(config, steps_per_epoch=4)
    tx, _ = train.make_optimizer(config, method, 4)
    state = train.init_state(config, method, tx, mesh)
    batch = data.synthetic_batch(config.data, 16, seed=batch_seed)
    batch = parallel.host_batch_to_global(batch, mesh)
    mcfg = config.method

    def old_loss(params, batch):
        count = common.num_crops(batch)
        model_params = {k: v for k, v in params.items() if k != "prototypes"}
        out, _ = common.forward_crops(
            method.model, model_params, state.batch_stats, batch["crops"], True
        )
        z = losses.l2_normalize(out["head"].astype(jnp.float32))
        scores = Prototypes(tuple(mcfg.num_prototypes)).apply({"params": params["prototypes"]}, z)
        per_example = 0.0
        for set_scores in scores:
            per_example = (
                per_example
                + losses.swav_loss(
                    common.split_crops(set_scores, count),
                    crops_for_assign=tuple(mcfg.crops_for_assign),
                    temperature=mcfg.temperature,
                    epsilon=mcfg.epsilon,
                    num_iters=mcfg.sinkhorn_iterations,
                    axis_name=DATA_AXIS,
                )[2]
            )
        return per_example / len(scores)

    def per_replica(state, batch):
        def loss_fn(params):
            return method.loss(params, state, batch, state.rng, True)

        (value, out), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        old = old_loss(state.params, batch) if reference else out.per_example_loss
        mean = lambda tree: jax.lax.pmean(tree, DATA_AXIS)  # noqa: E731
        return mean(value), mean(grads), mean(out.metrics), out.per_example_loss, out.terms, old

    run = jax.jit(
        jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(P(), P(DATA_AXIS)),
            out_specs=(P(), P(), P(), P(DATA_AXIS), P(DATA_AXIS), P(DATA_AXIS)),
            check_vma=False,
        )
    )
    return run(state, batch)


def _terms_config(num_prototypes=(8,)):
    config = swav.get_config("test")
    config.method.queue_length = 0
    config.method.num_prototypes = num_prototypes
    return config


@functools.cache
def _default_terms(num_prototypes):
    """``_loss_and_grads`` of the default weights with the loss of before, computed once for
    the tests that compare with it (a compile each)."""
    return jax.device_get(_loss_and_grads(_terms_config(num_prototypes), reference=True))


# Two prototype heads (8, 6) in the slow tier: the crop terms' sum is per head.
@pytest.mark.parametrize("num_prototypes", [(8,), pytest.param((8, 6), marks=pytest.mark.slow)])
def test_crop_terms_sum_to_the_single_loss_of_before(num_prototypes):
    config = _terms_config(num_prototypes)
    assert [t.name for t in methods.loss_terms(config)] == [
        "swapped_prediction_crop0",
        "swapped_prediction_crop1",
    ]
    value, _, metrics, per_example, terms, old = _default_terms(num_prototypes)
    crop0, crop1 = terms["swapped_prediction_crop0"], terms["swapped_prediction_crop1"]
    assert not np.allclose(crop0, crop1)  # two different targets
    if len(num_prototypes) == 1:
        # Two assignment crops at weight 1/2: the mean of before, bit for bit.
        np.testing.assert_array_equal(per_example, old)
    else:
        np.testing.assert_allclose(per_example, old, rtol=1e-6)
    np.testing.assert_allclose(per_example, 0.5 * crop0 + 0.5 * crop1, rtol=1e-6)
    np.testing.assert_array_equal(terms["swapped_prediction"], per_example)
    # Logged: each term unweighted and weighted, its weight, and the family's mean.
    assert float(metrics["loss_weight/swapped_prediction_crop1"]) == 0.5
    np.testing.assert_allclose(metrics["loss/swapped_prediction_crop0"], np.mean(crop0), 1e-5)
    np.testing.assert_allclose(
        metrics["loss/swapped_prediction_crop1_weighted"], 0.5 * np.mean(crop1), rtol=1e-5
    )
    np.testing.assert_allclose(metrics["loss/swapped_prediction"], value, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss/swapped_prediction_weighted"], value, rtol=1e-5)


def test_a_zero_weight_removes_that_crops_targets_from_the_gradient():
    default = _default_terms((8,))
    config = _terms_config()
    config.loss.weights.swapped_prediction_crop1 = 0.0
    methods.check_config(config)
    value, grads, metrics, per_example, terms, _ = _loss_and_grads(config)
    np.testing.assert_allclose(per_example, 0.5 * terms["swapped_prediction_crop0"], rtol=1e-6)
    assert float(metrics["loss_weight/swapped_prediction_crop1"]) == 0.0
    # The same gradients as SwAV assigning from crop 0 alone (weight 1), halved.
    only0 = _terms_config()
    only0.method.crops_for_assign = (0,)
    base.loss_terms(only0, swapped_prediction=1.0)
    assert [t.name for t in methods.loss_terms(only0)] == ["swapped_prediction_crop0"]
    ref_value, ref_grads = _loss_and_grads(only0)[:2]
    np.testing.assert_allclose(value, 0.5 * ref_value, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(got, 0.5 * want, rtol=1e-4, atol=1e-7)
    changed = [
        not np.allclose(g, f, rtol=1e-3, atol=1e-6)
        for g, f in zip(jax.tree.leaves(grads), jax.tree.leaves(default[1]), strict=True)
    ]
    assert sum(changed) > len(changed) // 2  # crop 1's targets moved most gradients


def test_family_weight_scales_every_crop_and_a_crop_weight_replaces_its_share():
    config = _terms_config()
    config.loss.weights.swapped_prediction = 2.0
    config.loss.weights.swapped_prediction_crop0 = 0.25
    weights = common.loss_weights(config, methods.loss_terms(config))(jnp.asarray(0))
    assert {k: float(v) for k, v in weights.items()} == {
        "swapped_prediction_crop0": 0.5,
        "swapped_prediction_crop1": 1.0,
    }
    # A ramp of the family moves every crop's weight; a crop's own ramp only its own.
    ramp = config.loss.ramps.swapped_prediction
    ramp.kind, ramp.initial, ramp.begin, ramp.end, ramp.unit = "linear", 0.0, 0.0, 4.0, "steps"
    crop1 = config.loss.ramps.swapped_prediction_crop1
    crop1.kind, crop1.initial, crop1.begin, crop1.end, crop1.unit = "linear", 0.0, 2.0, 2.0, "steps"
    weights_at = common.loss_weights(config, methods.loss_terms(config))
    got = [{k: float(v) for k, v in weights_at(jnp.asarray(s)).items()} for s in (0, 1, 2, 4)]
    assert [g["swapped_prediction_crop0"] for g in got] == [0.0, 0.125, 0.25, 0.5]
    assert [g["swapped_prediction_crop1"] for g in got] == [0.0, 0.0, 0.5, 1.0]
