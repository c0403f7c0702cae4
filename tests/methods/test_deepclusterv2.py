"""DeepCluster-v2 (jssl/methods/deepclusterv2.py): presets and start-up checks; the objective
and ``after_update`` on hand-made embeddings (k-means at an epoch's first step only, over the
bank's rows written the epoch before, with the key of (seed, epoch); the targets of the batch's
rows; the bank written at ``batch["index"]``); the memory pass's frozen parameters; and the
real step across an epoch boundary, resumed from a checkpoint there and on 4 devices.
k-means and the loss themselves: tests/losses/test_clustering.py; the contract and a run end
to end: test_contract*.py.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from configs import deepclusterv2 as configs
from jssl import data, losses, methods, optim, parallel
from jssl.methods import deepclusterv2
from jssl.parallel import DATA_AXIS
from jssl.training import state as train_state

STEPS_PER_EPOCH = 4  # the test preset: 64 examples, batches of 16


def test_presets_follow_vissl_and_the_swav_repository():
    config = configs.get_config()
    m = config.method
    assert m.num_clusters == (3000, 3000, 3000) and m.crops_for_mb == (0, 1)
    assert m.temperature == 0.1 and m.kmeans_iters == 10
    assert config.data.augment.num_crops == (2,) and config.data.augment.crop_scale == (0.08, 1.0)
    assert config.model.head_dims == (2048, 2048, 128) and not config.model.head_bn
    assert config.num_epochs == 100 and config.optim.warmup_epochs == 10
    assert config.optim.name == "larc" and config.optim.final_lr_fraction == 0.0
    multicrop = configs.get_config("multicrop")
    assert multicrop.data.augment.num_crops == (2, 4) and multicrop.num_epochs == 400
    assert multicrop.optim.final_lr_fraction == pytest.approx(0.0048 / 4.8)
    demo = configs.get_config("demo")
    assert demo.data.augment.crop_sizes == (32,) and demo.knn.enabled
    # The memory pass holds the parameters through the warmup's first epoch: the warmup must
    # reach past it, or the first trained step is taken at the peak rate.
    assert demo.optim.warmup_epochs > demo.method.memory_fill_epochs
    assert configs.get_config("test").method.temperature == 0.1  # the reference's


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("method.crops_for_mb", (0, 4), r"crops_for_mb=\(0, 4\).*\[0, 4\)"),
        ("method.crops_for_mb", (1, 1), "distinct"),
        ("method.num_clusters", (), "num_clusters"),
        ("method.num_clusters", (8, 65), "an epoch holds 64"),
        ("method.temperature", 0.0, "method.temperature=0.0"),
        ("method.kmeans_iters", -1, "kmeans_iters=-1"),
        ("method.memory_fill_epochs", -1, "memory_fill_epochs=-1"),
        ("method.num_examples", -2, "num_examples=-2"),
        ("model.head_dims", (), "head_dims"),
    ],
)
def test_bad_settings_name_the_field(field, value, message):
    config = configs.get_config("test")
    config.update_from_flattened_dict({field: value})
    with pytest.raises(ValueError, match=message):
        methods.check_config(config)


def test_the_bank_rows_are_whole_batches_split_over_the_devices():
    config = configs.get_config("test")
    config.method.num_examples = 60  # padded to 64: four batches of 16
    assert deepclusterv2.bank_rows(config) == 64
    method = methods.get(config, STEPS_PER_EPOCH)
    shapes = jax.eval_shape(lambda: method.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3))))
    state = train_state.create(**shapes, tx=optax.sgd(0.1), rng=jax.random.key(0), probe={})
    assert state.method_state["bank"].shape[1] == 64
    for devices, bank in ((4, P(None, DATA_AXIS)), (8, P(None, DATA_AXIS)), (3, P())):
        specs = train_state.partition_specs(state, devices, config.parallel, method.split_state)
        assert specs.method_state["bank"] == bank, devices
        assert specs.method_state["assignments"] == P()  # every device reads its targets


def test_the_memory_pass_holds_every_parameter_for_its_epochs():
    config = configs.get_config("demo")
    config.method.num_examples = 2048  # the demo's train subset, without reading it
    method = methods.get(config, steps_per_epoch=16)
    assert method.frozen_params == (("trunk", 16), ("head", 16))
    config.method.memory_fill_epochs = 0
    assert methods.get(config, steps_per_epoch=16).frozen_params == ()
    # The optimizer holds them fixed (jssl.optim.freeze_for_steps): nothing else is trainable.
    config.method.memory_fill_epochs = 2
    params = {"trunk": {"w": jnp.ones(2)}, "head": {"w": jnp.ones(2)}}
    tx = optim.freeze_for_steps(optax.sgd(0.1), params, methods.get(config, 3).frozen_params)
    opt_state, grads = tx.init(params), jax.tree.map(jnp.ones_like, params)
    moved = []
    for _ in range(7):
        updates, opt_state = tx.update(grads, opt_state, params)
        moved.append(max(float(jnp.abs(u).max()) for u in jax.tree.leaves(updates)))
    assert moved == [0.0] * 6 + [pytest.approx(0.1)]


# ---------------------------------------------------------------------------------------------
# The objective and after_update on hand-made embeddings (one device)


def _fresh(config, seed: int = 0):
    method = methods.get(config, STEPS_PER_EPOCH)
    fields = jax.jit(method.init)(jax.random.PRNGKey(seed), jnp.zeros((1, 16, 16, 3)))
    state = train_state.create(**fields, tx=optax.identity(), rng=jax.random.PRNGKey(seed + 1))
    return method, state


def _objective(method):
    def run(state, z, batch, train):
        out = method.objective(z, state, batch, train)
        return out.terms["cluster_prediction"], out.carry

    def compiled(train):
        return jax.jit(
            jax.shard_map(
                lambda s, z, b: run(s, z, b, train),
                mesh=parallel.make_mesh(),
                in_specs=(P(), P(None, DATA_AXIS), P(DATA_AXIS)),
                out_specs=(P(DATA_AXIS), P()),
                check_vma=False,
            )
        )

    return compiled(True), compiled(False)


def _expected_clusters(config, memory, key, written):
    """Each head's k-means of the bank as the module documents it, from jssl.losses."""
    out = []
    for h, k in enumerate(config.method.num_clusters):
        bank = memory["bank"][h % 2]
        start = losses.initial_centroids(jax.random.fold_in(key, h), bank, k, written)
        out.append(losses.kmeans(bank, start, config.method.kmeans_iters, written)[:2])
    return out


def _check_clusters(memory, expected):
    for h, (centroids, assigned) in enumerate(expected):
        np.testing.assert_allclose(memory["centroids"][f"head{h}"], centroids, atol=1e-6)
        np.testing.assert_array_equal(memory["assignments"][h], assigned)


def _nearest(z, centroids):
    return jnp.stack([jnp.argmax(z[h] @ c.T, axis=-1) for h, c in enumerate(centroids)])


def test_kmeans_at_epoch_starts_the_targets_and_the_bank_rows():
    config = configs.get_config("test")
    method, state = _fresh(config)
    train_step, test_step = _objective(method)
    after_update = jax.jit(method.after_update)  # one compilation for the three calls
    rs = np.random.RandomState(0)
    z = losses.l2_normalize(jnp.asarray(rs.normal(size=(4, 16, 16)), jnp.float32))
    index = rs.permutation(64)[:16]
    batch = {"index": jnp.asarray(index), "label": jnp.zeros(16, jnp.int32)}

    # init: epoch 0's clusters, of the random bank (every row), with init's key.
    memory = jax.device_get(state.method_state)
    init_key = jax.random.split(jax.random.PRNGKey(0), 3)[2]
    _check_clusters(memory, _expected_clusters(config, memory, init_key, None))
    assert np.all(memory["assignments"] >= 0)
    np.testing.assert_array_equal(memory["bank_epoch"], -1)

    # The objective: the stored assignments of the batch's rows are the targets.
    terms, carry = train_step(state, z, batch)
    heads = [memory["centroids"]["head0"], memory["centroids"]["head1"]]
    temperature = config.method.temperature
    want, _ = losses.cluster_prediction_loss(z, heads, memory["assignments"][:, index], temperature)
    np.testing.assert_allclose(terms, want, rtol=1e-6)
    np.testing.assert_array_equal(carry["bank_rows"], z[:2])  # crops_for_mb (0, 1)
    np.testing.assert_array_equal(carry["bank_index"], index)

    # after_update of step 0 (no epoch boundary): the rows of the batch's indices, stamped
    # epoch 0, no other row; the clusters kept.
    after = jax.device_get(after_update(state.replace(step=jnp.int32(1)), carry))
    after = after.method_state
    np.testing.assert_array_equal(after["bank"][:, index], z[:2])
    others = np.setdiff1d(np.arange(64), index)
    np.testing.assert_array_equal(after["bank"][:, others], memory["bank"][:, others])
    np.testing.assert_array_equal(after["bank_epoch"][index], 0)
    np.testing.assert_array_equal(after["bank_epoch"][others], -1)
    np.testing.assert_array_equal(after["assignments"], memory["assignments"])
    np.testing.assert_array_equal(after["centroids"]["head1"], memory["centroids"]["head1"])

    # after_update of step 3, the last of epoch 0: its rows written, then k-means over the 48
    # rows written in epoch 0 (the rest were "dropped"), with the key of (seed, epoch 1).
    written = np.zeros(64, bool)
    written[rs.permutation(64)[:48]] = True
    written[index] = True
    bank = losses.l2_normalize(jnp.asarray(rs.normal(size=(2, 64, 16)), jnp.float32))
    stamps = jnp.where(written, 0, -1).astype(jnp.int32)
    state = state.replace(
        step=jnp.int32(4), method_state=dict(memory, bank=bank, bank_epoch=stamps)
    )
    after = jax.device_get(after_update(state, carry).method_state)
    np.testing.assert_array_equal(after["bank"][:, index], z[:2])
    key = jax.random.fold_in(jax.random.fold_in(state.rng, deepclusterv2._CENTROID_STREAM), 1)
    _check_clusters(after, _expected_clusters(config, after, key, jnp.asarray(written)))
    assert np.all((after["assignments"] >= 0) == written)
    # Another seed, other initial centroids.
    other = after_update(state.replace(rng=jax.random.PRNGKey(9)), carry).method_state
    assert not np.allclose(other["centroids"]["head0"], after["centroids"]["head0"])

    # Epoch 1's objective: a batch row without a target weighs nothing.
    state = state.replace(step=jnp.int32(4), method_state=after)
    index = np.concatenate([np.flatnonzero(~written)[:4], np.flatnonzero(written)[:12]])
    terms = np.asarray(train_step(state, z, dict(batch, index=jnp.asarray(index)))[0])
    assert np.all(terms[:4] == 0) and np.all(terms[4:] > 0)

    # The test phase: every head's target is its nearest centroid to crop h % 2.
    terms = test_step(state, z, batch)[0]
    heads = [after["centroids"]["head0"], after["centroids"]["head1"]]
    want = losses.cluster_prediction_loss(z, heads, _nearest(z, heads), temperature)[0]
    np.testing.assert_allclose(terms, want, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# The real step: across the epoch boundary, resumed there, and on 4 devices

STEPS = 6  # epoch 0 (steps 0-3) and two steps of epoch 1


def _batches(config):
    """Every example once per epoch, in a new order each epoch."""
    for step in range(STEPS):
        epoch, position = divmod(step, STEPS_PER_EPOCH)
        order = np.random.RandomState(epoch).permutation(64)
        batch = data.synthetic_batch(config.data, 16, seed=step)
        batch["index"] = order[16 * position : 16 * (position + 1)]
        yield batch


def _train(workdir=None, resume_at: int = -1) -> dict:
    """STEPS steps of the test preset on every device; with ``workdir``, saved after step
    ``resume_at`` and resumed from there."""
    from jssl.checkpoints import manager as checkpoint
    from jssl.data import device_augment
    from jssl.engines import train
    from jssl.training.state import specs_of
    from jssl.training.step import make_train_step

    config = configs.get_config("test")
    config.checkpoint.async_save = False
    # Non-chaotic: no BN in the projector (as tests/support/step_parity.py) and small steps.
    # Towards random clusters the per-example gradients nearly cancel, so the float rounding
    # between 1 and 4 devices grows by 1e-4 a step at the preset's rate (measured).
    config.model.head_bn = False
    config.optim.base_lr = 0.003
    mesh = parallel.make_mesh()
    method = methods.get(config, STEPS_PER_EPOCH)
    tx, schedule = train.make_optimizer(config, method, STEPS_PER_EPOCH)
    state = train.init_state(config, method, tx, mesh)
    augment = device_augment.make_batch_augment(config.data)
    step = make_train_step(
        method,
        tx,
        schedule,
        mesh,
        probe_config=config,
        augment=augment,
        state_specs=specs_of(state),
    )
    out = {"loss": [], "assignments": []}
    for i, batch in enumerate(_batches(config)):
        state, metrics = step(state, parallel.host_batch_to_global(batch, mesh))
        memory = parallel.global_to_host(state.method_state)
        out["loss"].append(float(parallel.global_to_host(metrics)["loss"]))
        out["assignments"].append(memory["assignments"])
        if i == resume_at:
            manager, _, _, _ = checkpoint.resume(workdir, config.checkpoint, state)
            checkpoint.save(manager, state, checkpoint.DataPosition())
            checkpoint.finish(manager)
            fresh = train.init_state(config, method, tx, mesh)
            manager, state, _, resumed = checkpoint.resume(workdir, config.checkpoint, fresh)
            checkpoint.finish(manager)
            assert resumed and int(state.step) == resume_at + 1
    out.update({k: memory[k] for k in ("bank", "bank_epoch")})
    out["centroids"] = memory["centroids"]["head0"]
    out["devices"] = jax.device_count()
    # The bank's rows as one device holds them (split over the devices, as the engine lays
    # out the state).
    out["bank_device_rows"] = state.method_state["bank"].addressable_shards[0].data.shape[1]
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.mark.slow
def test_the_step_across_an_epoch_boundary_resumed_and_on_four_devices(tmp_path):
    from support.devices import run_on_devices

    one = _train()
    # Epoch 0 trains on the random bank's clusters; epoch 0's last step clusters the embeddings
    # written in epoch 0 for epoch 1; the bank's rows carry the epoch they were written in.
    assert all(np.array_equal(a, one["assignments"][0]) for a in one["assignments"][1:3])
    assert not np.array_equal(one["assignments"][3], one["assignments"][2])
    assert all(np.array_equal(a, one["assignments"][3]) for a in one["assignments"][4:])
    written = np.random.RandomState(1).permutation(64)[:32]  # epoch 1's two batches
    np.testing.assert_array_equal(one["bank_epoch"][written], 1)
    assert np.sum(one["bank_epoch"] == 0) == 32
    np.testing.assert_allclose(np.linalg.norm(one["bank"], axis=-1), 1.0, rtol=1e-5)
    assert np.all(np.isfinite(one["loss"]))

    # Saved after epoch 0's last step and resumed: the clustering and the rest are the same.
    resumed = _train(str(tmp_path / "run"), resume_at=3)
    for key in ("loss", "assignments", "bank", "bank_epoch", "centroids"):
        np.testing.assert_array_equal(resumed[key], one[key], err_msg=key)

    four = run_on_devices(__file__, tmp_path / "four.npz", timeout=300)
    assert int(four["devices"]) == 4
    assert int(one["bank_device_rows"]) == 64 and int(four["bank_device_rows"]) == 16
    np.testing.assert_allclose(four["loss"], one["loss"], rtol=2e-5)
    np.testing.assert_array_equal(four["assignments"], one["assignments"])
    np.testing.assert_array_equal(four["bank_epoch"], one["bank_epoch"])
    # The parameters agree to 2e-7, the rows written at step 0 to 8e-7; the embeddings of later
    # steps amplify the parameters' rounding (train-mode BN on noise images: measured 3e-4).
    np.testing.assert_allclose(four["bank"], one["bank"], atol=1e-3)
    np.testing.assert_allclose(four["centroids"], one["centroids"], atol=1e-3)


if __name__ == "__main__":
    np.savez(sys.argv[1], **_train())
