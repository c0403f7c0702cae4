"""MAE: patches and back, MAE's sin-cos table by hand, the random masking (exact counts, keyed
by example index, new every step), the decoder's unshuffle, the forward's embeddings, the
pictures hook, presets and start-up checks, 1 vs 4 devices (tests/support/step_parity.py), and
a run end to end with a test phase (slow tier). The contract: tests/methods/test_contract.py;
the loss: tests/losses/test_reconstruction.py.
"""

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import mae as mae_config
from jssl import methods, parallel
from jssl.engines import train
from jssl.models import mae
from jssl.training import summaries

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ---------------------------------------------------------------------------------------------
# Patches, position embeddings, masking, the decoder


def test_patchify_order_and_round_trip():
    images = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 12, 3)), jnp.float32)
    patches = mae.patchify(images, 4)
    assert patches.shape == (2, 6, 48)  # a 2 x 3 grid, row-major
    # Patch 4 is row 1, column 1: its pixels row by row, channels last (MAE's nhwpqc).
    np.testing.assert_array_equal(patches[1, 4], images[1, 4:8, 4:8].reshape(-1))
    np.testing.assert_array_equal(mae.unpatchify(patches, 4, (2, 3)), images)
    with pytest.raises(ValueError, match="4 px patches"):
        mae.patchify(images[:, :7], 4)


def test_sincos_position_embeddings_are_maes():
    """util/pos_embed.py for a 2 x 3 grid (rows x columns), width 8: quarters sin(col w),
    cos(col w), sin(row w), cos(row w), w = (1, 1/100); a zero row for the class token."""
    table = np.asarray(mae.sincos_pos_embed((2, 3), 8))
    assert table.shape == (7, 8)
    np.testing.assert_array_equal(table[0], 0.0)
    for row in range(2):
        for col in range(3):
            want = []
            for coord in (col, row):
                want += [math.sin(coord), math.sin(coord / 100)]
                want += [math.cos(coord), math.cos(coord / 100)]
            np.testing.assert_allclose(table[1 + 3 * row + col], want, rtol=1e-6, atol=1e-7)


def test_random_masking_counts_and_inverse():
    keys = jax.random.split(jax.random.key(0), 5)
    masking = mae.random_masking(keys, 16, 0.75)
    keep, restore, mask = map(np.asarray, masking)
    assert keep.shape == (5, 4) and restore.shape == (5, 16) and mask.shape == (5, 16)
    np.testing.assert_array_equal(mask.sum(axis=1), 12)  # exactly L - int(L / 4) per row
    for row in range(5):
        assert len(set(keep[row])) == 4 and not mask[row, keep[row]].any()
        # restore[j]: where grid position j sits among (kept, then masked) patches.
        np.testing.assert_array_equal(restore[row, keep[row]], np.arange(4))
    assert len({tuple(sorted(k)) for k in keep}) > 1  # rows differ
    assert mae.num_visible(196, 0.75) == 49 and mae.num_visible(10, 0.75) == 2  # int(), as MAE


def _decoder_case():
    decoder = mae.MAEDecoder(embed_dim=8, depth=0, num_heads=2, patch_size=2)
    latent = jnp.asarray(np.random.default_rng(1).normal(size=(1, 7, 6)), jnp.float32)
    identity = jnp.arange(6, dtype=jnp.int32)[None]
    params = decoder.init(jax.random.key(0), latent, identity, (2, 3), False)
    return decoder, params, latent, identity


def test_decoder_unshuffle_puts_tokens_back_in_place():
    # No blocks: each output row is a function of its own token and position alone (the
    # blocks' decoder runs in the forward test).
    decoder, params, latent, identity = _decoder_case()
    everything = decoder.apply(params, latent, identity, (2, 3), False)  # all 6 visible
    masking = mae.random_masking(jax.random.key(3)[None], 6, 0.5)
    keep = np.asarray(masking.keep[0])
    visible = jnp.concatenate([latent[:, :1], latent[:, 1 + keep]], axis=1)
    out = decoder.apply(params, visible, masking.restore, (2, 3), False)
    assert out.shape == (1, 6, 2 * 2 * 3)
    np.testing.assert_allclose(out[0, keep], everything[0, keep], rtol=1e-5)
    # Masked positions hold the mask token (plus their position), whatever the visible tokens.
    masked = np.asarray(masking.mask[0])
    other = decoder.apply(params, visible * 3.0, masking.restore, (2, 3), False)
    np.testing.assert_allclose(out[0, masked], other[0, masked], rtol=1e-6)
    assert not np.allclose(out[0, masked][0], out[0, masked][1])  # positions differ


# ---------------------------------------------------------------------------------------------
# The method


@pytest.fixture(scope="module")
def setup():
    config = mae_config.get_config("test")
    method = methods.get(config, steps_per_epoch=4)
    mesh = parallel.make_mesh()
    tx, _ = train.make_optimizer(config, method, steps_per_epoch=4)
    state = train.init_state(config, method, tx, mesh)
    images = np.random.default_rng(2).normal(size=(6, 1, 16, 16, 3)).astype(np.float32)
    return config, method, jax.device_get(state), images


def _forward(setup, order, rng):
    config, method, state, images = setup
    batch = {"crops": (jnp.asarray(images[order]),), "index": jnp.asarray(order + 100)}
    forward = jax.jit(method.forward, static_argnums=4)  # one compile beats eager op by op
    return jax.device_get(forward(state.params, state, batch, rng, True))


def test_forward_masks_by_example_index_and_step(setup):
    config, method, state, images = setup
    order = np.arange(6)
    rng = jax.random.key(7)
    out = _forward(setup, order, rng)
    emb = out.embeddings
    assert emb["pred"].shape == (1, 6, 16, 48) and emb["target"].shape == (1, 6, 16, 48)
    np.testing.assert_array_equal(emb["mask"].sum(-1), 12)  # 75% of 16 patches
    assert out.features.shape == (6, 192)
    # The target is the input crop, as patches.
    np.testing.assert_array_equal(emb["target"][0], mae.patchify(images[:, 0], 4))
    # The same examples in another order (another row, another device): the same masks and
    # predictions, row for row.
    shuffled = np.array([4, 2, 0, 5, 1, 3])
    again = _forward(setup, shuffled, rng).embeddings
    np.testing.assert_array_equal(again["mask"][0], emb["mask"][0][shuffled])
    np.testing.assert_allclose(again["pred"][0], emb["pred"][0][shuffled], rtol=1e-5, atol=1e-6)
    # Another step's key: other masks.
    other = _forward(setup, order, jax.random.fold_in(rng, 1)).embeddings
    assert (other["mask"] != emb["mask"]).any()
    # The loss term: the masked patches' error, per example.
    terms = method.objective(emb, state, {}, True).terms["reconstruction"]
    assert terms.shape == (6,) and np.all(terms > 0)
    # In evaluation mode the features are the whole crop's class token, as the kNN bank's.
    batch = {"crops": (jnp.asarray(images),), "index": jnp.arange(6)}
    evaluated = jax.jit(method.forward, static_argnums=4)(state.params, state, batch, rng, False)
    whole = method.model.apply({"params": state.params}, images[:, 0], train=False)
    np.testing.assert_allclose(evaluated.features, whole["avgpool"], rtol=1e-4, atol=1e-5)
    assert not np.allclose(out.features, whole["avgpool"], atol=1e-3)  # training: masked


def test_pictures_hook_writes_one_grid(setup):
    config, method, state, images = setup

    class Writer:
        def write_images(self, step, images):
            self.written = (step, images)

    pictures = summaries.MethodPictures.of(config)
    host = {"crops": (images,), "index": np.arange(6)}
    pictures.keep(host)
    pictures.keep({"crops": (images[::-1],), "index": np.arange(6)})  # the first batch stays
    writer = Writer()
    pictures.write(writer, state, step=8)
    step, written = writer.written
    ((name, grid),) = written.items()
    # 6 examples x 16 px rows; crop | masked | reconstruction | pasted columns.
    assert step == 8 and name.startswith("mae/") and grid.shape == (1, 6 * 16, 4 * 16, 3)
    assert 0.0 <= grid.min() and grid.max() <= 1.0
    mean, std = np.asarray(config.data.augment.mean), np.asarray(config.data.augment.std)
    np.testing.assert_allclose(grid[0, :16, :16], np.clip(images[0, 0] * std + mean, 0, 1))
    # The pasted column is the crop where patches are visible, the masked column the mean.
    crop, masked, pasted = (grid[0, :16, 16 * c : 16 * (c + 1)] for c in (0, 1, 3))
    same = np.isclose(pasted, crop, atol=1e-6).all(-1)
    grey = np.isclose(masked, np.clip(mean, 0, 1), atol=1e-6).all(-1)
    assert same.mean() == 0.25 and np.array_equal(same | grey, np.ones_like(same))


def test_methods_without_pictures_get_none():
    from configs import moco

    assert summaries.MethodPictures.of(moco.get_config("test")) is None


# ---------------------------------------------------------------------------------------------
# Presets and start-up checks


def test_presets_follow_the_paper():
    config = mae_config.get_config("")
    m, o, a = config.method, config.optim, config.data.augment
    assert (config.model.trunk, config.model.patch_size, config.num_epochs) == (
        "vit_large",
        16,
        800,
    )
    assert (m.mask_ratio, m.decoder_dim, m.decoder_depth, m.decoder_heads) == (0.75, 512, 8, 16)
    assert m.norm_pix_loss and config.model.pos_embed_init == "sincos"
    assert (o.name, tuple(o.betas), o.base_lr, o.weight_decay, o.warmup_epochs) == (
        "adamw",
        (0.9, 0.95),
        1.5e-4,
        0.05,
        40,
    )
    assert config.data.batch_size == 4096 and tuple(a.crop_scale) == (0.2, 1.0)
    assert tuple(a.color_jitter_prob) == (0.0,) and tuple(a.grayscale_prob) == (0.0,)
    base = mae_config.get_config("vit_base")
    assert (base.model.trunk, base.num_epochs) == ("vit_base", 1600)
    huge = mae_config.get_config("vit_huge")
    assert (huge.model.trunk, huge.model.patch_size) == ("vit_huge", 14)
    demo = mae_config.get_config("demo")
    assert demo.data.source == "demo" and demo.knn.enabled and demo.data.image_size == 32
    for preset in ("", "vit_base", "demo", "test"):
        methods.check_config(mae_config.get_config(preset))
    # The encoder's sin-cos embeddings are held fixed for the whole run.
    method = methods.get(mae_config.get_config("test"), steps_per_epoch=4)
    assert method.frozen_params == (("trunk/pos_embed", 2**31 - 1),)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("model.trunk", "resnet18", "ViT trunk"),
        ("model.head_dims", (192, 32), "head_dims"),
        ("method.mask_ratio", 0.99, "leaves 0 of the 16"),
        ("method.mask_ratio", 1.5, "must lie in"),
        ("method.decoder_dim", 30, "multiple of 4"),
        ("data.augment.crop_sizes", (16, 8), "share one size"),
    ],
)
def test_bad_config_is_refused_at_start_up(field, value, message):
    config = mae_config.get_config("test")
    if field == "data.augment.crop_sizes":
        config.data.augment.num_crops = (1, 1)
    config.update_from_flattened_dict({field: value})
    with pytest.raises(ValueError, match=message):
        methods.check_config(config)


# ---------------------------------------------------------------------------------------------
# Devices, and a whole run


# Slow tier: two subprocesses' start-up and compiles (a minute of CPU); in CI, MAE's steps on 1
# and 4 devices run in tests/training/test_parallel.py's shared subprocesses (PARITY).
@pytest.mark.slow
def test_four_devices_match_one(tmp_path):
    """tests/support/step_parity.py's MAE steps (its "test" preset, SGD) on 1 and 4 devices:
    each example's masks follow its index, so the losses and parameters agree."""
    script = os.path.join(REPO, "tests", "support", "step_parity.py")
    procs = {}
    for n in (1, 4):
        env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
        flag = f" --xla_force_host_platform_device_count={n}"
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + flag
        out = tmp_path / f"devices{n}.npz"
        command = [sys.executable, script, str(out), "--methods", "mae", "--steps", "3"]
        procs[n] = (
            out,
            subprocess.Popen(
                command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            ),
        )
    results = {}
    for n, (out, proc) in procs.items():
        log = proc.communicate(timeout=600)[0].decode()
        assert proc.returncode == 0, log[-5000:]
        results[n] = dict(np.load(out))
    one, four = results[1], results[4]
    assert int(one["devices"]) == 1 and int(four["devices"]) == 4
    assert not np.allclose(one["mae:loss"][0], one["mae:loss"][-1])  # it trains
    np.testing.assert_allclose(one["mae:loss"], four["mae:loss"], rtol=1e-5)
    error = np.linalg.norm(one["mae:params"] - four["mae:params"])
    assert error / np.linalg.norm(one["mae:params"]) < 1e-5


@pytest.mark.slow
def test_trains_end_to_end_with_a_test_phase(tmp_path, shared_dirs):
    from support.launch import scalar_values

    config = mae_config.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.checkpoint.async_save = False
    config.test_every_epochs = 2
    config.data.test_split = "test[:40]"
    summary = train.run(config, str(tmp_path))
    assert summary["step"] == 8 and summary["state"].ema_params == {}
    outputs = tmp_path / "eval" / "epoch_2"
    losses = np.load(outputs / "per_example_loss.npy")
    assert losses.shape == (40,) and np.all(np.isfinite(losses)) and np.all(losses > 0)
    np.testing.assert_allclose(np.load(outputs / "term_reconstruction.npy"), losses, rtol=1e-6)
    assert np.load(outputs / "features.npy").shape == (40, 192)
    logdir = tmp_path / "tensorboard"
    assert scalar_values(logdir, "test/loss/reconstruction")
    # The pictures hook: at the test phase after epoch 2 (step 8, also the run's end), once.
    import tensorflow as tf

    written = [
        (event.step, value.tag)
        for path in logdir.glob("events.out.tfevents.*")
        for event in tf.compat.v1.train.summary_iterator(str(path))
        for value in event.summary.value
        if value.tag.startswith("mae/")
    ]
    assert written == [(8, "mae/crop_masked_reconstruction_pasted")]
