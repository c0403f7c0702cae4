"""SwAV: its state updates in the real step (frozen then normalised prototypes, the queue
filling and switching on), presets, start-up checks, and a run end to end. The loss and
Sinkhorn are tested in test_losses*.py; 1 vs 4 devices in test_parallel.py."""

import jax
import numpy as np
import pytest
from test_launch import enable_compilation_cache, prepare_shared_dirs

from configs import swav
from jssl import data, methods, optim, parallel
from jssl.engines import train


@pytest.fixture(scope="module")
def shared_dirs(tmp_path_factory):
    dirs = prepare_shared_dirs(tmp_path_factory)
    enable_compilation_cache(dirs[1])
    return dirs


def test_presets_follow_vissl():
    config = swav.get_config()
    assert config.data.augment.num_crops == (2, 6) and config.data.augment.crop_sizes == (224, 96)
    assert config.data.augment.crop_scale == ((0.14, 1.0), (0.05, 0.14))
    assert config.method.num_prototypes == (3000,) and config.method.crops_for_assign == (0, 1)
    assert config.method.freeze_prototypes_iters == 313 and config.optim.name == "larc"
    assert config.optim.final_lr_fraction == pytest.approx(0.0048 / 4.8)
    for preset in ("demo", "test"):
        assert swav.get_config(preset).method.name == "swav"
    with pytest.raises(ValueError, match="Unknown preset"):
        swav.get_config("nope")


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
    # The step of the end-to-end run below (same config, probe included), so the persistent
    # compilation cache serves it there.
    config = swav.get_config("test")  # queue of 2 batches, on from step 2; frozen 2 steps
    steps_per_epoch = 4  # 64 examples / batch 16
    mesh = parallel.make_mesh()
    method = methods.get(config, steps_per_epoch)
    tx, schedule = train.make_optimizer(config, method, steps_per_epoch)
    state = train.init_state(config, method, tx, mesh)
    from jssl.train_step import make_train_step

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


def test_trains_end_to_end(tmp_path, shared_dirs):
    config = swav.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.checkpoint.async_save = False
    config.test_every_epochs = 2
    config.data.test_split = "test[:40]"
    summary = train.run(config, str(tmp_path))
    assert summary["step"] == 8
    losses = np.load(tmp_path / "eval" / "epoch_2" / "per_example_loss.npy")
    assert losses.shape == (40,) and np.all(np.isfinite(losses)) and losses.mean() > 0
    embeddings = np.load(tmp_path / "eval" / "epoch_2" / "embeddings.npy")
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-4)
