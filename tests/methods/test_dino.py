"""DINO: its loss on hand-computed cases, the centre and teacher-temperature schedules, the
weight-normalised last layer, the weight-decay schedule and per-parameter clipping, the
state updates in the real step (frozen last layer, EMA teacher, centre), 1 vs 4 devices,
presets, start-up checks, and a ViT run end to end (the ResNet's: test_contract_runs.py)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from configs import dino
from jssl import data, losses, methods, optim, parallel
from jssl.engines import train
from jssl.methods import common
from jssl.methods.distillation import teacher_temperature
from jssl.models.heads import DINOHead, WeightNormDense
from jssl.parallel import DATA_AXIS
from jssl.training.step import make_train_step

# ---------------------------------------------------------------------------------------------
# The loss


def test_loss_on_hand_computed_logits():
    # Teacher crop 0 says class 0, crop 1 class 1 (one-hot at a tiny temperature); the student
    # gives crop 0 (1/2, 1/2), crop 1 (3/4, 1/4), crop 2 (1/4, 3/4). Pairs with different
    # crops: (t0, s1) -log 3/4, (t0, s2) -log 1/4, (t1, s0) -log 1/2, (t1, s2) -log 3/4.
    student = jnp.array([[[0.0, 0.0]], [[math.log(3), 0.0]], [[0.0, math.log(3)]]])
    teacher = jnp.array([[[1.0, 0.0]], [[0.0, 1.0]]])
    loss, metrics, per_example = losses.dino_cross_entropy(
        student, teacher, jnp.zeros(2), student_temp=1.0, teacher_temp=1e-3
    )
    expected = (-2 * math.log(3 / 4) - math.log(1 / 4) - math.log(1 / 2)) / 4
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(per_example, [expected], rtol=1e-5)
    assert float(metrics["teacher_entropy"]) == pytest.approx(0.0, abs=1e-5)
    assert float(metrics["teacher_mean_entropy"]) == pytest.approx(math.log(2), rel=1e-5)

    # The centre is subtracted before sharpening: centre (1, 0) makes crop 0 (0, 0), uniform;
    # crop 1 becomes (-1, 1), still class 1. The student temperature divides its logits.
    loss, _, _ = losses.dino_cross_entropy(
        student * 2.0, teacher, jnp.array([1.0, 0.0]), student_temp=2.0, teacher_temp=1e-3
    )
    uniform_vs = [-0.5 * (math.log(3 / 4) + math.log(1 / 4))] * 2  # t0 against s1, s2
    expected = (sum(uniform_vs) - math.log(1 / 2) - math.log(3 / 4)) / 4
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_loss_per_example_and_no_gradient_to_the_teacher():
    rng = np.random.RandomState(0)
    student = jnp.asarray(rng.normal(size=(4, 3, 5)), jnp.float32)
    teacher = jnp.asarray(rng.normal(size=(2, 3, 5)), jnp.float32)
    center = jnp.asarray(rng.normal(size=(5,)), jnp.float32)
    loss, _, per_example = losses.dino_cross_entropy(student, teacher, center, 0.1, 0.04)
    # Each image: the mean over the 2 * 3 pairs of different crops, written as loops.
    t = np.exp((np.asarray(teacher) - np.asarray(center)) / 0.04)
    t /= t.sum(-1, keepdims=True)
    s = np.asarray(student) / 0.1
    log_s = s - np.log(np.exp(s).sum(-1, keepdims=True))
    want = np.zeros(3)
    for i in range(3):
        terms = [-(t[a, i] * log_s[b, i]).sum() for a in range(2) for b in range(4) if a != b]
        want[i] = np.mean(terms)
    np.testing.assert_allclose(per_example, want, rtol=1e-5)
    assert float(loss) == pytest.approx(want.mean(), rel=1e-5)

    def total(student, teacher, center):
        return losses.dino_cross_entropy(student, teacher, center, 0.1, 0.04)[0]

    grad_student, grad_teacher, grad_center = jax.grad(total, argnums=(0, 1, 2))(
        student, teacher, center
    )
    assert np.abs(grad_student).max() > 0
    assert np.abs(grad_teacher).max() == 0 and np.abs(grad_center).max() == 0


def test_center_is_an_ema_of_the_global_batch_mean():
    teacher = jnp.array([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]])  # (2 crops, 2, 2)
    batch_center = losses.dino_batch_center(teacher)
    np.testing.assert_allclose(batch_center, [4.0, 5.0])
    center = losses.dino_update_center(jnp.array([10.0, 0.0]), batch_center, 0.9)
    np.testing.assert_allclose(center, [9.4, 0.5], rtol=1e-6)


def test_teacher_temperature_warms_up_linearly_then_holds():
    values = [float(teacher_temperature(s, 0.04, 0.07, 4)) for s in range(6)]
    np.testing.assert_allclose(values, [0.04, 0.05, 0.06, 0.07, 0.07, 0.07], rtol=1e-6)
    assert float(teacher_temperature(0, 0.04, 0.07, 0)) == pytest.approx(0.07)  # no warmup
    one = [float(teacher_temperature(s, 0.04, 0.07, 1)) for s in range(2)]
    np.testing.assert_allclose(one, [0.04, 0.07], rtol=1e-6)  # linspace(a, b, 1) == [a]


# ---------------------------------------------------------------------------------------------
# The head and the optimizer pieces


def test_weight_norm_last_layer_has_unit_norm_whatever_v():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 4))
    layer = WeightNormDense(6)
    params = layer.init(jax.random.PRNGKey(1), x)["params"]
    assert set(params) == {"v"}  # the norm is fixed: no g to learn
    v = np.asarray(params["v"])
    np.testing.assert_allclose(
        layer.apply({"params": params}, x), x @ (v / np.linalg.norm(v, axis=0)), rtol=1e-5
    )
    scaled = {"v": params["v"] * jnp.arange(1.0, 7.0)}  # each unit's v rescaled differently
    np.testing.assert_allclose(
        layer.apply({"params": scaled}, x), layer.apply({"params": params}, x), rtol=1e-5
    )
    free = WeightNormDense(6, fixed_norm=False)
    params = free.init(jax.random.PRNGKey(1), x)["params"]
    np.testing.assert_allclose(params["g"], np.ones(6))
    doubled = dict(params, g=params["g"] * 2.0)
    np.testing.assert_allclose(
        free.apply({"params": doubled}, x), 2.0 * free.apply({"params": params}, x), rtol=1e-5
    )


def test_dino_head_shapes_and_normalised_bottleneck():
    head = DINOHead(out_dim=10, hidden_dim=8, bottleneck_dim=4)
    x = jax.random.normal(jax.random.PRNGKey(0), (5, 12))
    params = head.init(jax.random.PRNGKey(1), x)["params"]
    assert sorted(params) == ["fc0", "fc1", "fc2", "last_layer"]
    assert params["fc2"]["kernel"].shape == (8, 4) and params["last_layer"]["v"].shape == (4, 10)
    logits = head.apply({"params": params}, x)
    # Unit bottleneck and unit-norm prototypes: every logit is a cosine.
    assert logits.shape == (5, 10) and float(jnp.abs(logits).max()) <= 1.0 + 1e-5
    with_bn = DINOHead(out_dim=10, hidden_dim=8, bottleneck_dim=4, use_bn=True)
    variables = with_bn.init(jax.random.PRNGKey(1), x, train=False)
    assert sorted(variables["batch_stats"]) == ["bn0", "bn1"]
    logits, _ = with_bn.apply(variables, x, train=True, mutable=["batch_stats"])
    assert logits.shape == (5, 10) and bool(jnp.all(jnp.isfinite(logits)))


def test_weight_decay_cosine_schedule_values_and_wiring():
    config = dino.get_config("vissl").optim
    config.update_interval = "step"
    schedule = optim.weight_decay_schedule(config, steps_per_epoch=10, num_epochs=10)
    values = [float(schedule(s)) for s in (0, 50, 100)]
    np.testing.assert_allclose(values, [0.04, 0.22, 0.4], rtol=1e-5)  # DINO: 0.04 -> 0.4
    config.update_interval = "epoch"
    schedule = optim.weight_decay_schedule(config, steps_per_epoch=10, num_epochs=10)
    assert float(schedule(19)) == pytest.approx(float(schedule(10)))  # held within an epoch
    assert optim.weight_decay_schedule(dino.get_config().optim, 10, 10) == 1e-4  # constant

    # SGD without momentum on a zero gradient: the step is -lr * wd(step) * p.
    config = dino.get_config().optim
    config.update(
        dict(weight_decay_schedule="cosine", weight_decay=0.1, weight_decay_end=0.3, momentum=0.0)
    )
    config.grad_clip_per_parameter = 0.0
    params = {"w": jnp.ones(2)}
    tx = optim.build_optimizer(config, params, lambda s: 1.0, steps_per_epoch=2, num_epochs=1)
    state = tx.init(params)
    steps = []
    for _ in range(2):
        updates, state = tx.update({"w": jnp.zeros(2)}, state, params)
        steps.append(float(updates["w"][0]))
    np.testing.assert_allclose(steps, [-0.1, -0.2], rtol=1e-5)
    with pytest.raises(ValueError, match="needs the run's length"):
        optim.build_optimizer(config, params, lambda s: 1.0)
    config.name = "larc"
    with pytest.raises(ValueError, match="not supported with optim.name='larc'"):
        optim.build_optimizer(config, params, lambda s: 1.0, steps_per_epoch=2, num_epochs=1)


def test_gradients_are_clipped_per_parameter():
    grads = {"a": jnp.array([6.0, 0.0]), "b": jnp.array([0.0, 1.0])}
    clipped, _ = optim.clip_by_parameter_norm(3.0).update(grads, optax.EmptyState())
    np.testing.assert_allclose(clipped["a"], [3.0, 0.0], rtol=1e-5)  # its own norm, 3
    np.testing.assert_allclose(clipped["b"], [0.0, 1.0])  # below 3: untouched
    # A global clip would have scaled b too.
    together, _ = optax.clip_by_global_norm(3.0).update(grads, optax.EmptyState())
    assert float(together["b"][1]) < 1.0


# ---------------------------------------------------------------------------------------------
# Configs and start-up checks


def test_presets_follow_the_recipes():
    config = dino.get_config()
    m, o, a = config.method, config.optim, config.data.augment
    assert (m.out_dim, m.hidden_dim, m.bottleneck_dim, m.num_layers) == (65536, 2048, 256, 3)
    assert m.norm_last_layer and m.teacher_temp == 0.04 and m.student_temp == 0.1
    assert m.teacher_momentum == 0.996 and m.center_momentum == 0.9
    assert a.num_crops == (1, 1, 8) and a.crop_sizes == (224, 224, 96)
    assert a.blur_prob == (1.0, 0.1, 0.5) and a.solarize_prob == (0.0, 0.2, 0.0)
    assert o.name == "sgd" and o.base_lr == 0.03 and o.grad_clip_per_parameter == 3.0
    assert o.weight_decay == o.weight_decay_end == 1e-4 and config.data.batch_size == 512
    vissl = dino.get_config("vissl")
    assert vissl.optim.name == "adamw" and vissl.optim.weight_decay_schedule == "cosine"
    assert (vissl.optim.weight_decay, vissl.optim.weight_decay_end) == (0.04, 0.4)
    assert (vissl.method.warmup_teacher_temp, vissl.method.teacher_temp) == (0.04, 0.07)
    assert not vissl.method.norm_last_layer and vissl.num_epochs == 300
    for preset in ("", "vissl", "demo", "demo_vit", "test", "test_vit"):
        train.validate(dino.get_config(preset))


def test_demo_presets_are_cpu_sized():
    """The demos (issues 9 and 10): a ResNet-18 and a few-block ViT-Tiny on the 32 px demo
    data, each with the kNN monitor that prints learned vs random-init accuracy."""
    demo = dino.get_config("demo")
    assert demo.data.source == "demo" and demo.data.image_size == 32 and demo.knn.enabled
    assert demo.model.trunk == "resnet18" and demo.optim.name == "lars"
    vit = dino.get_config("demo_vit")
    methods.check_config(vit)
    m, o, a = vit.model, vit.optim, vit.data.augment
    assert vit.data.source == "demo" and vit.data.image_size == 32 and vit.knn.enabled
    assert m.trunk == "vit_tiny" and 0 < m.vit_depth < 12 and m.image_size == 32
    assert m.patch_size in (4, 8) and all(size % m.patch_size == 0 for size in a.crop_sizes)
    assert o.name == "adamw" and o.grad_clip_per_parameter == 3.0
    # The ViT takes the global crops on its 32 px grid (and local ones, if set, resampled).
    method = methods.get(vit, steps_per_epoch=4)
    crops = [jnp.zeros((2, size, size, 3)) for size in a.crop_sizes]
    variables = method.model.init(jax.random.key(0), crops, train=False)
    out = method.model.apply(variables, crops, train=False)
    assert out["head"].shape == (2 * len(crops), vit.method.out_dim)
    assert out["avgpool"].shape == (2 * len(crops), 192)  # ViT-Tiny's width


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("model.head_dims", (64, 32, 16), r"model.head_dims=\(64, 32, 16\).*head_dims='\(\)'"),
        ("method.teacher_crops", 3, "teacher_crops=3 must be the number of crops in the leading"),
        ("method.teacher_crops", 4, r"different sizes \[8, 16\]"),
        ("method.teacher_temp", 0.0, "method.teacher_temp=0.0 must be positive"),
        ("method.center_momentum", 1.5, r"method.center_momentum=1.5 must lie in \[0, 1\]"),
        ("method.out_dim", 0, "method.out_dim=0 must be a positive integer"),
        ("optim.weight_decay_schedule", "linear", "weight_decay_schedule='linear' is not one of"),
    ],
)
def test_bad_settings_name_the_field(field, value, message):
    config = dino.get_config("test")
    config.update_from_flattened_dict({field: value})
    with pytest.raises(ValueError, match=message):
        train.validate(config)
        method = methods.get(config, 4)
        train.make_optimizer(config, method, 4)


# ---------------------------------------------------------------------------------------------
# The real step and a run


def test_frozen_last_layer_ema_teacher_and_center_in_the_step(shared_dirs):
    config = dino.get_config("test")  # last layer frozen for 2 steps, temperature warmup 4
    steps_per_epoch, total = 4, 4 * config.num_epochs
    mesh = parallel.make_mesh()
    method = methods.get(config, steps_per_epoch)
    tx, schedule = train.make_optimizer(config, method, steps_per_epoch)
    state = train.init_state(config, method, tx, mesh)
    step = make_train_step(method, tx, schedule, mesh, probe_config=config)

    def teacher_batch_center(ema_params, ema_batch_stats, crops):
        out, _ = common.forward_crops(method.model, ema_params, ema_batch_stats, crops, True)
        return losses.dino_batch_center(out["head"], DATA_AXIS)

    batch_center = jax.jit(
        jax.shard_map(
            teacher_batch_center,
            mesh=mesh,
            in_specs=(P(), P(), P(DATA_AXIS)),
            out_specs=P(),
            check_vma=False,
        )
    )

    def last_layer(params):
        return np.asarray(params["head"]["last_layer"]["v"])

    start_v = last_layer(state.params)
    np.testing.assert_allclose(
        jax.tree.leaves(state.ema_params)[0], jax.tree.leaves(state.params)[0]
    )
    center = np.zeros(config.method.out_dim)
    for i in range(3):
        batch = parallel.host_batch_to_global(data.synthetic_batch(config.data, 16, seed=i), mesh)
        expected_center = 0.9 * center + 0.1 * np.asarray(
            batch_center(state.ema_params, state.ema_batch_stats, batch["crops"][:2])
        )
        previous_teacher = jax.tree.map(np.asarray, state.ema_params)  # the step donates state
        state, metrics = step(state, batch)
        assert float(metrics["teacher_temp"]) == pytest.approx(0.04 + 0.01 * i, rel=1e-5)
        moved_v = np.abs(last_layer(state.params) - start_v).max()
        assert (moved_v == 0.0) if i < 2 else (moved_v > 1e-6), (i, moved_v)
        # The teacher: m(k) * teacher + (1 - m(k)) * the student after step k.
        m = float(common.cosine_momentum(i, total, config.method.teacher_momentum))
        want = jax.tree.map(lambda t, s, m=m: m * t + (1 - m) * s, previous_teacher, state.params)
        for got, ref in zip(jax.tree.leaves(state.ema_params), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
        center = np.asarray(state.method_state["center"])
        np.testing.assert_allclose(center, expected_center, rtol=1e-4, atol=1e-6)
    assert np.abs(center).max() > 0
    trunk = jax.tree.leaves(state.params["trunk"])[0]
    assert not np.allclose(trunk, jax.tree.leaves(state.ema_params["trunk"])[0])


# Slow tier: CI checks the ViT preset's step and its drop-path masks per row of the global
# batch in tests/training/test_parallel.py (dino_vit), and a run of it in
# tests/evaluation/test_evaluate.py (test_knn_on_a_dino_vit_workdir).
@pytest.mark.slow
def test_vit_trains_with_the_students_drop_path(tmp_path, shared_dirs):
    """DINO on a ViT (the "test_vit" preset: ViT-Tiny/4, drop path 0.1): a run trains end to
    end with no batch norm anywhere, and the step's key drives the student's stochastic depth
    (the same key gives the same loss, another key another)."""
    config = dino.get_config("test_vit")
    methods.check_config(config)
    assert config.model.drop_path_rate == 0.1
    method = methods.get(config, steps_per_epoch=4)
    images = jnp.asarray(np.random.default_rng(0).normal(size=(4, 16, 16, 3)), jnp.float32)
    variables = method.model.init(jax.random.key(0), images, train=False)
    assert "batch_stats" not in variables
    apply = lambda key: method.model.apply(  # noqa: E731
        variables, images, train=True, row_keys=jax.random.split(jax.random.key(key), 4)
    )["avgpool"]
    assert not np.allclose(apply(1), apply(2))

    mesh = parallel.make_mesh()
    tx, schedule = train.make_optimizer(config, method, 4)
    state = train.init_state(config, method, tx, mesh)
    batch = data.synthetic_batch(config.data, 16, seed=0)
    batch = parallel.host_batch_to_global(batch, mesh)

    def per_replica(state, batch, rng):
        out = method.loss(state.params, state, batch, rng, train=True)[1]
        return jax.lax.pmean(out.metrics["loss/cross_entropy"], DATA_AXIS)

    losses_of = jax.jit(
        jax.shard_map(per_replica, mesh=mesh, in_specs=(P(), P(DATA_AXIS), P()), out_specs=P())
    )
    first, again, other = (losses_of(state, batch, jax.random.key(k)) for k in (0, 0, 1))
    assert float(first) == float(again) and float(first) != float(other)

    config.data.data_dir = shared_dirs[0]
    config.checkpoint.async_save = False
    summary = train.run(config, str(tmp_path))
    assert summary["step"] == 8  # a non-finite loss would have stopped the run


def test_vit_small_preset_is_the_papers_recipe():
    config = dino.get_config("vit_small")
    methods.check_config(config)
    assert (config.model.trunk, config.model.patch_size, config.model.drop_path_rate) == (
        "vit_small",
        16,
        0.1,
    )
    o = config.optim
    assert (o.name, o.base_lr, o.weight_decay, o.weight_decay_end) == ("adamw", 5e-4, 0.04, 0.4)
    assert o.grad_clip_per_parameter == 3.0 and config.data.batch_size == 1024
    m = config.method
    assert (m.warmup_teacher_temp, m.teacher_temp, m.warmup_teacher_temp_epochs) == (
        0.04,
        0.07,
        30.0,
    )
    assert tuple(config.data.augment.num_crops) == (1, 1, 10)
    assert tuple(config.data.augment.crop_sizes) == (224, 224, 96)
