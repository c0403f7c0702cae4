"""iBOT: the preset against the README's ViT-S/16 command, start-up checks, the head's patch
path and shared last layers, and the forward's masks and the objective's terms on a tiny ViT
(forward and objective compiled apart; the contract test compiles iBOT's step). Its first
steps on 1 and 4 devices and over micro-batches: tests/methods/test_dinov2.py (slow tier)."""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import ibot
from jssl import data, losses, methods
from jssl.engines import train
from jssl.models.heads import DINOHead
from jssl.parallel import DATA_AXIS


def test_default_preset_is_the_readme_vit_small_recipe():
    c = ibot.get_config()
    m, o, a = c.method, c.optim, c.data.augment
    assert (c.model.trunk, c.model.patch_size, c.model.drop_path_rate) == ("vit_small", 16, 0.1)
    assert (m.out_dim, m.patch_out_dim, m.shared_head, m.shared_head_teacher) == (
        8192,
        8192,
        True,
        True,
    )
    assert not m.norm_last_layer and (m.teacher_temp, m.teacher_patch_temp) == (0.07, 0.07)
    assert m.warmup_teacher_temp_epochs == 30 and m.teacher_momentum == 0.996
    assert (tuple(m.pred_ratio), tuple(m.pred_ratio_var), m.pred_shape) == (
        (0.0, 0.3),
        (0.0, 0.2),
        "block",
    )
    assert (m.center_momentum, m.patch_center_momentum) == (0.9, 0.9)
    assert dict(c.loss.weights)["cls"] == dict(c.loss.weights)["patch"] == 1.0
    assert tuple(a.num_crops) == (1, 1, 10) and tuple(a.crop_scale[0]) == (0.25, 1.0)
    assert (c.data.batch_size, c.num_epochs, o.name, o.base_lr) == (1024, 800, "adamw", 5e-4)
    assert (o.weight_decay, o.weight_decay_end, o.grad_clip_per_parameter) == (0.04, 0.4, 3.0)
    for preset in ibot.PRESETS:
        train.validate(ibot.get_config(preset))
    names = [t.name for t in methods.loss_terms(c)]
    assert names == ["cls_crop0", "cls_crop1", "patch_crop0", "patch_crop1"]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("model.trunk", "resnet18", "needs a ViT trunk"),
        ("method.pred_ratio", (0.0, 0.1), r"0 <= r - v <= r \+ v <= 1"),
        ("method.pred_shape", "square", "use 'block' or 'rand'"),
        ("method.patch_out_dim", 16, "patch_out_dim=16 differs from method.out_dim=32"),
        ("method.teacher_patch_temp", 0.0, "teacher_patch_temp=0.0 must be positive"),
        ("method.pred_start_epoch", -1.0, "pred_start_epoch=-1.0 must be >= 0"),
        ("method.teacher_crops", 3, "teacher_crops=3 must be the number of crops"),
    ],
)
def test_bad_settings_name_the_field(field, value, message):
    config = ibot.get_config("test")
    config.update_from_flattened_dict({field: value})
    with pytest.raises(ValueError, match=message):
        train.validate(config)


def test_head_on_patch_tokens_with_its_own_or_the_shared_last_layer():
    tokens = jax.random.normal(jax.random.key(0), (2, 5, 12))  # (rows, tokens, D)
    head = DINOHead(out_dim=6, hidden_dim=8, bottleneck_dim=4, patch_out_dim=7)

    def both(module, x):
        return module(x[:, 0]), module(x, patches=True)

    params = head.init(jax.random.key(1), tokens, method=both)["params"]
    assert params["last_layer2"]["v"].shape == (4, 7)
    cls, patch = head.apply({"params": params}, tokens, method=both)
    assert cls.shape == (2, 6) and patch.shape == (2, 5, 7)
    # The MLP acts token by token: a patch's output is its own, whatever the other tokens.
    alone = head.apply({"params": params}, tokens[:, 2:3], patches=True)
    np.testing.assert_allclose(alone[:, 0], patch[:, 2], rtol=1e-5)
    # A shared head (iBOT's teacher): the patch tokens go through the [CLS] last layer.
    shared = head.clone(patch_out_dim=0).apply({"params": params}, tokens, patches=True)
    np.testing.assert_allclose(
        shared[:, 0], head.apply({"params": params}, tokens[:, 0]), rtol=1e-5
    )


class _State(NamedTuple):
    """The fields of the TrainState a forward and an objective read."""

    step: jax.Array
    params: Any = None
    ema_params: Any = None
    method_state: Any = None
    batch_stats: Any = {}  # noqa: RUF012 (never mutated)
    ema_batch_stats: Any = {}  # noqa: RUF012


def _objective_under_axis(method, embeddings, state):
    """The objective (compiled: a fraction of its op-by-op time), with the data axis of one
    replica (vmap names it)."""
    batched = jax.tree.map(lambda x: x[None], embeddings)
    run = jax.vmap(lambda e, s: method.objective(e, s, {}, True), (0, None), axis_name=DATA_AXIS)
    return jax.tree.map(lambda x: x[0], jax.jit(run)(batched, state))


def test_forward_masks_the_student_from_pred_start_epoch_and_the_objectives_terms():
    config = ibot.get_config("test")
    config.method.pred_start_epoch = 0.5  # masks from step 2 of 4 per epoch
    config.model.drop_path_rate = 0.0
    method = methods.get(config, steps_per_epoch=4)
    batch = data.synthetic_batch(config.data, 6, seed=0)
    batch = jax.tree.map(jnp.asarray, {k: batch[k] for k in ("crops", "index")})
    params = jax.jit(method.init)(jax.random.key(0), jnp.zeros((1, 16, 16, 3)))["params"]
    assert "last_layer2" in params["head"]  # the test preset: main_ibot.py's shared_head=False
    forward = jax.jit(lambda state: method.forward(params, state, batch, jax.random.key(5)))
    masked = []
    for step in (0, 2):
        e = forward(_State(jnp.int32(step), params, params)).embeddings
        masked.append(float(e["mask"].sum()))
    assert masked[0] == 0 and masked[1] > 0
    slots = math.ceil(0.5 * 16)  # the highest ratio of the 4 x 4 grid
    assert e["student"].shape == (4, 6, 32) and e["teacher"].shape == (2, 6, 32)
    assert e["student_patch"].shape == e["teacher_patch"].shape == (2, 6, slots, 32)
    assert e["mask"].shape == (2, 6, slots) and e["teacher_patch_mean"].shape == (2, 6, 32)

    # The terms: DINO's loss per teacher crop, and the patch loss against the patch centre at
    # the patch temperature (0.04 -> 0.07 over epoch 1, held until masking starts at step 2).
    centers = {"center": jnp.full((32,), 0.1), "patch_center": jnp.linspace(0, 1, 32)}
    state = _State(jnp.int32(3), method_state=centers)
    objective = _objective_under_axis(method, e, state)
    temp = 0.04 + 0.03 * 1 / 3  # one step into the patch warmup of 4 steps
    assert float(objective.metrics["teacher_patch_temp"]) == pytest.approx(temp, rel=1e-6)
    assert float(objective.metrics["teacher_temp"]) == pytest.approx(0.07, rel=1e-6)
    targets = losses.centred_probs(e["teacher_patch"], centers["patch_center"], temp)
    want = losses.masked_patch_losses(e["student_patch"], targets, e["mask"], 0.1)
    for t in range(2):
        np.testing.assert_allclose(objective.terms[f"patch_crop{t}"], want[t], rtol=1e-5)
    cls, _ = losses.dino_teacher_crop_losses(
        e["student"], e["teacher"], centers["center"], 0.1, 0.07
    )
    np.testing.assert_allclose(objective.terms["cls_crop1"], cls[1], rtol=1e-5)
    # The patch centre's new term: the teacher's mean over every patch of the batch.
    np.testing.assert_allclose(
        objective.carry["patch_batch_center"],
        np.asarray(e["teacher_patch_mean"]).mean((0, 1)),
        rtol=1e-5,
    )


def test_batch_norm_in_the_head_normalises_each_batch_and_updates_both_statistics():
    """``use_bn_in_head`` (iBOT's ``--norm_in_head bn``): BN between the MLP's layers of the
    student's and the teacher's head, each in train mode with its batch's statistics, the
    student's running statistics in the forward's ``batch_stats``, the teacher's in its carry."""
    config = ibot.get_config("test")
    config.method.use_bn_in_head = True
    config.model.drop_path_rate = 0.0
    method = methods.get(config, steps_per_epoch=4)
    init = jax.jit(method.init)(jax.random.key(0), jnp.zeros((1, 16, 16, 3)))
    stats = init["batch_stats"]
    assert set(stats) == {"head"} and set(stats["head"]) == {"bn0", "bn1"}
    params = init["params"]
    state = _State(jnp.int32(2), params, params, None, stats, init["ema_batch_stats"])
    batch = data.synthetic_batch(config.data, 6, seed=0)
    batch = jax.tree.map(jnp.asarray, {k: batch[k] for k in ("crops", "index")})

    @jax.jit
    def forward(batch):  # one replica under the data axis (the carry's mean over devices)
        run = lambda b: method.forward(params, state, b, jax.random.key(5))  # noqa: E731
        batched = jax.tree.map(lambda x: x[None], batch)
        return jax.tree.map(lambda x: x[0], jax.vmap(run, axis_name=DATA_AXIS)(batched))

    out = forward(batch)
    for new in (out.batch_stats, out.carry["ema_batch_stats"]):
        assert jax.tree.structure(new) == jax.tree.structure(stats)
        # PyTorch's momentum 0.1 from the initial zero means: a tenth of the batch's means.
        assert float(jnp.abs(new["head"]["bn0"]["mean"]).max()) > 0
    # Batch statistics: image 0's outputs move when only the other images change.
    other = dict(batch, crops=[x.at[1:].set(x[1:][::-1] * 0.5) for x in batch["crops"]])
    changed = forward(other).embeddings
    for name in ("student", "teacher"):
        assert not np.allclose(changed[name][:, 0], out.embeddings[name][:, 0], atol=1e-4)
