"""DINOv2: the presets against dinov2's yaml recipes (the ViT-L/14 and ViT-g/14 states traced
and laid out for 8 devices, as tests/training/test_scale_presets.py does for DINO's ViT-L),
start-up checks, the objective's terms under both centrings on embeddings made by hand, and in
the slow tier iBOT's and DINOv2's first steps on 1 and 4 devices and over micro-batches."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import dinov2
from jssl import losses, methods, parallel
from jssl.engines import train
from jssl.parallel import DATA_AXIS
from jssl.training import state as train_state

DEVICES = 8


def test_presets_follow_the_yaml_recipes():
    c = dinov2.get_config()  # train/vitl14.yaml on ssl_default_config.yaml
    m, o = c.method, c.optim
    assert (c.model.trunk, c.model.patch_size, c.model.ffn) == ("vit_large", 14, "swiglu")
    assert (c.model.layerscale, c.model.drop_path_rate, c.model.num_registers) == (1e-5, 0.4, 0)
    assert (m.out_dim, m.bottleneck_dim, m.patch_out_dim, m.patch_bottleneck_dim) == (
        131072,
        384,
        131072,
        256,
    )
    assert m.separate_head and m.centering == "sinkhorn_knopp" and m.sinkhorn_iterations == 3
    assert (tuple(m.mask_ratio_min_max), m.mask_sample_probability) == ((0.1, 0.5), 0.5)
    assert dict(c.loss.weights)["koleo"] == 0.1 and m.teacher_momentum == 0.994
    assert (o.base_lr, o.lr_scaling, o.base_lr_batch_size, o.weight_decay_end) == (
        2e-4,
        "sqrt",
        1024,
        0.2,
    )
    assert tuple(c.data.augment.crop_sizes) == (224, 224, 98)
    # 500 DINOv2 epochs of 1250 iterations at batch 3072: 625k iterations, in ImageNet-1k
    # epochs of 417 steps; the warmups and the freeze likewise.
    steps_per_epoch = dinov2.IMAGENET_TRAIN // c.data.batch_size
    assert abs(c.num_epochs * steps_per_epoch - 625_000) < steps_per_epoch
    assert o.warmup_epochs * steps_per_epoch == pytest.approx(80 * 1250, rel=2e-3)
    assert m.freeze_last_layer_epochs * steps_per_epoch == pytest.approx(1250, rel=2e-3)
    short = dinov2.get_config("vitl16_short")
    assert (short.model.patch_size, short.model.ffn, short.method.centering) == (
        16,
        "mlp",
        "centering",
    )
    assert not short.method.separate_head and short.optim.layer_decay == 0.9
    assert short.data.batch_size == 2048 and short.num_epochs == 200  # 125k iterations
    assert dinov2.get_config("vitg14").model.trunk == "vit_giant2"
    for preset in dinov2.PRESETS:
        train.validate(dinov2.get_config(preset))
    names = [t.name for t in methods.loss_terms(c)]
    assert names == [f"{f}_crop{t}" for f in ("dino", "ibot", "koleo") for t in (0, 1)]


def _vit_params(width: int, depth: int, swiglu_hidden: int, patch: int, grid: int) -> int:
    """A ViT's trunk parameters with LayerScale, a SwiGLU feed-forward and a mask token, by
    hand: patch projection, class and mask tokens, position embeddings, per block two norms,
    qkv, proj, w12, w3 and two LayerScales, the final norm."""
    block = 4 * width + (width + 1) * 3 * width + (width + 1) * width
    block += (width + 1) * 2 * swiglu_hidden + (swiglu_hidden + 1) * width + 2 * width
    stem = (patch * patch * 3 + 1) * width + 2 * width + (1 + grid * grid) * width
    return stem + depth * block + 2 * width


@pytest.mark.parametrize(
    "preset, trunk_params",
    [
        # SwiGLU widths: int(4096 * 2 / 3) and int(6144 * 2 / 3) rounded up to multiples of 8
        # (dinov2 SwiGLUFFNFused); 16 x 16 patches at 224 px.
        ("", _vit_params(1024, 24, 2736, 14, 16)),  # 303,655,168
        ("vitg14", _vit_params(1536, 40, 4096, 14, 16)),  # 1,134,771,200
    ],
)
def test_large_presets_split_their_state(preset, trunk_params):
    config = dinov2.get_config(preset)
    assert config.parallel.shard_params and config.model.remat == "full"
    method = methods.get(config, steps_per_epoch=100)
    tx, _ = train.make_optimizer(config, method, steps_per_epoch=100)
    shapes = train.abstract_state(config, method, tx, parallel.make_mesh())
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes.params["trunk"]))
    assert count == trunk_params
    heads = shapes.params["head"]
    assert heads["cls"]["last_layer"]["v"].shape == (384, 131072)
    assert heads["patch"]["last_layer"]["v"].shape == (256, 131072)
    specs = train_state.partition_specs(shapes, DEVICES, config.parallel)
    for field in ("params", "ema_params", "opt_state"):
        for x, spec in zip(
            jax.tree.leaves(getattr(shapes, field)),
            jax.tree.leaves(getattr(specs, field)),
            strict=True,
        ):
            if int(np.prod(x.shape)) * x.dtype.itemsize >= 4 * 2**20:
                assert parallel.sharded_dim(spec) is not None, (field, x.shape)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("method.centering", "softmax", "use 'sinkhorn_knopp'"),
        ("method.koleo_group_size", 3, "koleo_group_size=3.*must divide data.batch_size=16"),
        ("method.koleo_group_size", 1, "at least 2"),
        ("method.mask_ratio_min_max", (0.5, 0.1), r"0 <= min <= max <= 1"),
        ("method.patch_out_dim", 0, "patch_out_dim=0 must be a positive integer"),
        ("model.trunk", "resnet18", "needs a ViT trunk"),
    ],
)
def test_bad_settings_name_the_field(field, value, message):
    config = dinov2.get_config("test")
    config.update_from_flattened_dict({field: value})
    with pytest.raises(ValueError, match=message):
        train.validate(config)


class _State(NamedTuple):
    step: jax.Array
    method_state: Any = None


def _objective(method, embeddings, state):
    """The objective compiled with the data axis of one replica (vmap names it)."""
    batched = jax.tree.map(lambda x: x[None], embeddings)
    run = jax.vmap(lambda e, s: method.objective(e, s, {}, True), (0, None), axis_name=DATA_AXIS)
    return jax.tree.map(lambda x: x[0], jax.jit(run)(batched, state))


def _embeddings(n: int = 8, slots: int = 8, k: int = 32):
    keys = iter(jax.random.split(jax.random.key(0), 6))
    normal = lambda *shape: jax.random.normal(next(keys), shape)  # noqa: E731
    mask = (jax.random.uniform(next(keys), (2, n, slots)) < 0.4).astype(jnp.float32)
    return {
        "student": normal(4, n, k),
        "teacher": normal(2, n, k),
        "student_patch": normal(2, n, slots, k),
        "teacher_patch": normal(2, n, slots, k),
        "mask": mask,
        "cls_tokens": normal(2, n, 12),
    }


@pytest.mark.parametrize("centering", ["sinkhorn_knopp", "centering"])
def test_the_objectives_terms_under_either_centring(centering):
    config = dinov2.get_config("test")
    config.method.centering = centering
    method = methods.get(config, steps_per_epoch=4)
    e = _embeddings()
    centers = {"center": jnp.full((32,), 0.2), "patch_center": jnp.linspace(-1, 1, 32)}
    state = _State(jnp.int32(10), centers if centering == "centering" else {})
    out = _objective(method, e, state)
    temperature = 0.07  # after the warmup of 4 steps
    mask = e["mask"]
    if centering == "sinkhorn_knopp":
        # Every teacher row over the batch, the patch targets over the masked places only.
        cls_targets = losses.sinkhorn_centering(e["teacher"], temperature)
        cls, _ = losses.dino_teacher_crop_losses(
            e["student"], losses.as_teacher_logits(cls_targets), 0.0, 0.1, 1.0
        )
        targets = losses.sinkhorn_centering(e["teacher_patch"], temperature, mask > 0)
        assert out.carry is None
    else:
        cls, _ = losses.dino_teacher_crop_losses(
            e["student"], e["teacher"], centers["center"], 0.1, temperature
        )
        targets = losses.centred_probs(e["teacher_patch"], centers["patch_center"], temperature)
        want = (np.asarray(e["teacher_patch"]) * np.asarray(mask)[..., None]).sum((0, 1, 2))
        np.testing.assert_allclose(
            out.carry["patch_batch_center"], want / float(mask.sum()), rtol=1e-5
        )
    patch = losses.masked_patch_losses(e["student_patch"], targets, mask, 0.1)
    for t in range(2):
        np.testing.assert_allclose(out.terms[f"dino_crop{t}"], cls[t], rtol=1e-5)
        np.testing.assert_allclose(out.terms[f"ibot_crop{t}"], patch[t], rtol=1e-5)
        # KoLeo within groups of 8 (the test preset) of each crop's class tokens.
        np.testing.assert_allclose(
            out.terms[f"koleo_crop{t}"], losses.koleo_losses(e["cls_tokens"][t], 8), rtol=1e-5
        )


# ---------------------------------------------------------------------------------------------
# Slow tier (JSSL_SLOW_TESTS=1): compiled steps on 1 and 4 devices. CI holds each method's
# step once (test_contract.py, test_accumulation.py) and the losses' cross-device parts
# (tests/losses/test_masked_distillation.py: KoLeo's groups and Sinkhorn over 4 devices); the
# runs end to end with a test phase are test_contract_runs.py's (slow tier).

PARITY = ("ibot", "dinov2", "ibot_accum", "dinov2_accum")


def _parity_runs(tmp_path) -> dict[int, dict]:
    """tests/support/step_parity.py on 1 device and on 4 with the state split and the
    ``*_accum`` rows in 2 micro-batches per device, side by side: each method's "test" preset
    (drop path and masks keyed per example) with SGD, 2 steps on the same global batches."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "tests", "support", "step_parity.py")
    extra = {1: [], 4: ["--shard_params", "1", "--accumulation_steps", "2"]}
    procs = {}
    for n in (1, 4):
        env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + (
            f" --xla_force_host_platform_device_count={n}"
        )
        args = [sys.executable, script, str(tmp_path / f"{n}.npz"), "--methods", ",".join(PARITY)]
        procs[n] = subprocess.Popen(
            args + extra[n], env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    logs = {n: p.communicate(timeout=1800)[0].decode() for n, p in procs.items()}
    for n, p in procs.items():
        assert p.returncode == 0, f"step_parity on {n} device(s):\n{logs[n][-5000:]}"
    return {n: dict(np.load(tmp_path / f"{n}.npz")) for n in (1, 4)}


@pytest.mark.slow
def test_one_and_four_devices_and_micro_batches_give_the_same_steps(tmp_path):
    runs = _parity_runs(tmp_path)
    one, four = runs[1], runs[4]
    assert int(one["devices"]) == 1 and int(four["devices"]) == 4
    for name in PARITY:
        loss = one[f"{name}:loss"]
        assert np.all(np.isfinite(loss)) and not np.allclose(loss[0], loss[1]), name
        # Step 1: the same parameters, only the float32 reduction order differs; step 2 also
        # carries the parameters' differences (no batch norm here to amplify them).
        np.testing.assert_allclose(four[f"{name}:loss"], loss, rtol=2e-5, err_msg=name)
        for part in ("params", "ema", "state"):
            key = f"{name}:{part}"
            if key in one:
                a, b = one[key], four[key]
                assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(a), key
    assert int(four["ibot_accum:accumulation_steps"]) == 2
