"""MSN (jssl.methods.msn): the random and focal masks (kept count, a draw per example index,
contiguous focal blocks), the forward's masked anchors and target, the schedules, the presets
against the reference's yaml, start-up checks, and the first steps on 1 and on 4 devices with
the target encoder's EMA (the contract and a run: test_contract.py).

Run as a script (``python tests/methods/test_msn.py OUT.npz``) this file trains the first
steps on every visible device and saves losses and parameters; the 4-device test starts it in
a fresh process with 4 forced CPU devices.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P
from support.devices import run_on_devices

from configs import msn
from jssl import data, methods, parallel
from jssl.engines import train
from jssl.methods import common
from jssl.methods import msn as msn_method
from jssl.methods.msn import PROTOTYPES, kept_patches, linear_schedule
from jssl.parallel import DATA_AXIS
from jssl.training.step import make_train_step

# ---------------------------------------------------------------------------------------------
# Masks

random_keep = jax.jit(msn_method.random_keep, static_argnums=(1, 2))
focal_keep = jax.jit(msn_method.focal_keep, static_argnums=(1, 2))


def _mask_keys(step: int, index) -> jax.Array:
    rng = jax.random.fold_in(jax.random.key(0), step)
    return common.example_keys(rng, jnp.asarray(index), stream=1)


def test_random_masks_keep_the_count_and_follow_the_example_index():
    assert kept_patches(196, 0.15) == 166  # ViT-S/16 at 224 px: the reference's T_H
    assert kept_patches(16, 0.25) == 12 and kept_patches(16, 0.0) == 16
    keep = np.asarray(random_keep(_mask_keys(3, [5, 9, 2, 7]), 16, 12))
    assert keep.shape == (4, 12) and keep.dtype == np.int32
    for row in keep:
        assert np.all(np.diff(row) > 0) and row.min() >= 0 and row.max() < 16  # distinct
    assert len({tuple(row) for row in keep}) == 4  # each example its own mask
    # An example's mask depends on its index and the step, not on its row in the batch.
    moved = np.asarray(random_keep(_mask_keys(3, [7, 5]), 16, 12))
    np.testing.assert_array_equal(moved, keep[[3, 0]])
    later = np.asarray(random_keep(_mask_keys(4, [5, 9, 2, 7]), 16, 12))
    assert not np.array_equal(later, keep)


def test_focal_blocks_are_contiguous_squares_anywhere_on_the_grid():
    keep = np.asarray(focal_keep(_mask_keys(0, np.arange(256)), (6, 6), 3))
    assert keep.shape == (256, 9)
    corners = set()
    for row in keep:
        rows, cols = row // 6, row % 6
        assert len(set(row)) == 9
        np.testing.assert_array_equal(np.unique(rows), rows.min() + np.arange(3))
        np.testing.assert_array_equal(np.unique(cols), cols.min() + np.arange(3))
        corners.add((rows.min(), cols.min()))
    assert corners == {(r, c) for r in range(4) for c in range(4)}  # every position drawn
    np.testing.assert_array_equal(focal_keep(_mask_keys(0, [9]), (6, 6), 3), keep[[9]])
    with pytest.raises(ValueError, match="does not fit a 2x2 patch grid"):
        focal_keep(_mask_keys(0, [0]), (2, 2), 3)


def test_schedules_rise_linearly_over_the_horizon():
    values = [float(linear_schedule(s, 10, 0.996, 1.0)) for s in (0, 5, 10, 20)]
    np.testing.assert_allclose(values, [0.996, 0.998, 1.0, 1.0], rtol=1e-7)
    # The recipe's horizon is 1.25 runs: the last step's momentum is 0.996 + 0.004 / 1.25.
    assert float(linear_schedule(8000, 10000, 0.996, 1.0)) == pytest.approx(0.9992, abs=1e-6)


# ---------------------------------------------------------------------------------------------
# The forward


def test_forward_masks_each_example_by_its_index():
    """In eval mode (running statistics: rows independent) the random-masked anchor of an
    example is the model on its kept patches, drawn from (step key, crop 1, its index); the
    focal anchors and the target view are whole; the target uses the EMA encoder and the
    online prototypes."""
    config = msn.get_config("test")
    method = methods.get(config, steps_per_epoch=4)
    mesh = parallel.make_mesh(jax.devices()[:1])
    tx, _ = train.make_optimizer(config, method, 4)
    state = train.init_state(config, method, tx, mesh)
    state = state.replace(ema_params=jax.tree.map(lambda x: x * 0.9, state.ema_params))
    batch = data.synthetic_batch(config.data, 4, seed=0)
    batch["index"] = np.array([11, 3, 8, 5])
    rng = jax.random.key(7)

    def forward(state, crops, index):
        out = method.forward(state.params, state, {"crops": crops, "index": index}, rng, False)
        return out.embeddings, out.features

    run = jax.jit(
        jax.shard_map(
            forward,
            mesh=mesh,
            in_specs=(P(), P(DATA_AXIS), P(DATA_AXIS)),
            out_specs=P(),
            check_vma=False,
        )
    )
    (embeddings, features) = run(state, batch["crops"], batch["index"])
    assert embeddings["anchor"].shape == (3, 4, 32) and embeddings["target"].shape == (1, 4, 32)

    mask_rng = jax.random.fold_in(rng, common.MASK_STREAM)
    keep = random_keep(common.example_keys(mask_rng, jnp.asarray(batch["index"]), 1), 16, 12)

    @jax.jit
    def references(state, crops, keep):
        """The cosines of the masked anchor, the same anchor whole, the focal anchor and the
        target, and the target's features, each from its own model call."""
        params = {k: v for k, v in state.params.items() if k != PROTOTYPES}
        online = {"params": params, "batch_stats": state.batch_stats}
        ema = {"params": state.ema_params, "batch_stats": state.ema_batch_stats}
        prototypes = state.params[PROTOTYPES]
        prototypes = prototypes / jnp.linalg.norm(prototypes, axis=1, keepdims=True)

        def cosines(out):
            z = out["head"] / jnp.linalg.norm(out["head"], axis=1, keepdims=True)
            return z @ prototypes.T

        apply = method.model.apply
        target = apply(ema, crops[0][:, 0], train=False)
        return (
            cosines(apply(online, crops[0][:, 1], train=False, keep=keep)),
            cosines(apply(online, crops[0][:, 1], train=False)),
            cosines(apply(online, crops[1][:, 0], train=False)),
            cosines(target),
            target["avgpool"],
        )

    masked, whole, focal, target, target_features = references(state, batch["crops"], keep)
    close = dict(rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(embeddings["anchor"][0], masked, **close)
    assert not np.allclose(embeddings["anchor"][0], whole, atol=1e-4)
    np.testing.assert_allclose(embeddings["anchor"][1], focal, **close)
    np.testing.assert_allclose(embeddings["target"][0], target, **close)
    np.testing.assert_allclose(features, target_features, **close)


# ---------------------------------------------------------------------------------------------
# Configs and start-up checks


def test_default_preset_is_the_references_vits16_recipe():
    config = msn.get_config()
    methods.check_config(config)
    m, o, a = config.method, config.optim, config.data.augment
    assert (config.model.trunk, config.model.patch_size, config.model.drop_path_rate) == (
        "vit_small",
        16,
        0.0,
    )
    assert (m.hidden_dim, m.output_dim, m.num_prototypes, m.use_bn_in_head) == (
        2048,
        256,
        1024,
        True,
    )
    assert (m.temperature, m.sharpen, m.final_sharpen, m.use_sinkhorn) == (0.1, 0.25, 0.25, True)
    assert (m.patch_drop, m.target_momentum, m.schedule_horizon) == (0.15, 0.996, 1.25)
    assert dict(config.loss.weights) == {
        "cross_entropy": 1.0,
        "me_max": 1.0,
        "entropy": 0.0,
        "koleo": None,  # not MSN's (jssl.methods.koleo): off
    }
    assert a.num_crops == (2, 10) and a.crop_sizes == (224, 96)
    assert a.crop_scale == ((0.3, 1.0), (0.05, 0.3)) and a.blur_prob == (0.5,)
    assert (o.name, o.base_lr, o.base_lr_batch_size, o.warmup_start_lr) == ("adamw", 1e-3, 0, 2e-4)
    assert (o.warmup_epochs, o.weight_decay, o.weight_decay_end, o.grad_clip_norm) == (
        15,
        0.04,
        0.4,
        3.0,
    )
    assert o.param_groups == (("prototypes", 1.0, 0.0),) and config.num_epochs == 800
    assert config.data.batch_size == 1024
    for preset in ("", "demo", "test"):
        train.validate(msn.get_config(preset))
    demo = msn.get_config("demo")
    assert demo.data.source == "demo" and demo.knn.enabled and demo.model.trunk == "vit_tiny"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model.trunk": "resnet18"}, "needs a ViT trunk"),
        ({"model.head_dims": (64, 32)}, r"head_dims='\(\)'"),
        ({"method.patch_drop": 1.0}, r"patch_drop=1.0 must lie in \[0, 1\)"),
        (
            {
                "data.augment.num_crops": (1,),
                "data.augment.crop_sizes": (),
                "data.augment.crop_scale": (0.3, 1.0),
            },
            "needs a target view",
        ),
        (
            {
                "data.augment.num_crops": (1, 2, 1),
                "data.augment.crop_sizes": (16, 8, 16),
                "data.augment.crop_scale": (0.3, 1.0),
            },
            "target's size .* must come first",
        ),
        ({"method.focal_block": 3}, r"focal_block=3 .* \(\[2\] patches a side\)"),
        ({"method.temperature": 0.0}, "temperature=0.0 must be positive"),
        ({"method.label_smoothing": 1.0}, r"label_smoothing=1.0 must lie in \[0, 1\)"),
        ({"method.target_momentum": 1.5}, r"target_momentum=1.5 must lie in \[0, 1\]"),
    ],
)
def test_bad_settings_name_the_field(overrides, message):
    config = msn.get_config("test")
    config.update_from_flattened_dict(overrides)
    with pytest.raises(ValueError, match=message):
        methods.check_config(config)


# ---------------------------------------------------------------------------------------------
# The first steps, on 1 device and on 4

STEPS, BATCH = 2, 16


def _steps() -> dict[str, np.ndarray]:
    """The "test" preset as a non-chaotic recipe (no BN in the head, plain SGD) for STEPS steps
    on every visible device: the loss per step, the parameters and the target encoder, and how
    far the target is from ``m * target + (1 - m) * online`` after each step."""
    config = msn.get_config("test")
    config.method.use_bn_in_head = False
    config.model.vit_depth = 1  # compile time: the masks and sums are the trunk's depth's alike
    config.optim.name = "sgd"
    config.optim.base_lr = 0.5
    config.data.batch_size = BATCH
    method = methods.get(config, steps_per_epoch=4)
    mesh = parallel.make_mesh()
    tx, schedule = train.make_optimizer(config, method, 4)
    state = train.init_state(config, method, tx, mesh)
    step = make_train_step(method, tx, schedule, mesh)
    horizon = 1.25 * 4 * config.num_epochs
    losses, ema_error = [], 0.0
    for i in range(STEPS):
        target = jax.device_get(state.ema_params)
        batch = data.synthetic_batch(config.data, BATCH, seed=i)
        state, metrics = step(state, parallel.host_batch_to_global(batch, mesh))
        losses.append(float(jax.device_get(metrics)["loss"]))
        m = config.method.target_momentum + (1 - config.method.target_momentum) * i / horizon
        online = {k: v for k, v in jax.device_get(state.params).items() if k != PROTOTYPES}
        want = jax.tree.map(lambda t, s, m=m: m * t + (1 - m) * s, target, online)
        got = jax.device_get(state.ema_params)
        ema_error = max(
            ema_error, float(np.abs(ravel_pytree(got)[0] - ravel_pytree(want)[0]).max())
        )
    return dict(
        devices=jax.device_count(),
        loss=np.array(losses),
        params=np.asarray(ravel_pytree(jax.device_get(state.params))[0]),
        ema=np.asarray(ravel_pytree(jax.device_get(state.ema_params))[0]),
        ema_error=ema_error,
    )


# Slow tier (JSSL_SLOW_TESTS=1): about 30 s of CPU for two processes' imports and compiles. CI
# holds what a sharding bug would break elsewhere: Sinkhorn's and me-max's sums over devices and
# their gradients (tests/losses/test_msn.py, 4 vmapped devices), the masks drawn per example
# index (test_forward_masks_each_example_by_its_index), the EMA target's wiring (DINO's rows of
# tests/training/test_parallel.py).
@pytest.mark.slow
def test_first_steps_are_the_same_on_one_and_four_devices(tmp_path):
    """What a sharding bug would break: Sinkhorn's and me-max's sums over every device, the
    masks drawn per example index, the target encoder's EMA; on 4 forced CPU devices."""
    one = _steps()
    four = run_on_devices(__file__, tmp_path / "four.npz", devices=4, timeout=300)
    assert int(one["devices"]) == 1 and int(four["devices"]) == 4
    assert one["ema_error"] < 1e-6 and four["ema_error"] < 1e-6
    assert len(set(one["loss"].round(4))) == STEPS  # the runs move
    np.testing.assert_allclose(four["loss"], one["loss"], rtol=1e-5)
    np.testing.assert_allclose(four["params"], one["params"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(four["ema"], one["ema"], rtol=1e-4, atol=1e-6)


if __name__ == "__main__":
    np.savez(sys.argv[1], **_steps())
