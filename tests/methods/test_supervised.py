"""Supervised training and fine-tuning: the loss (one output or several, VISSL's multiple-output
cross-entropy) and top-k hits by hand, exact test-phase accuracy with padding rows, presets,
start-up checks, per-prefix learning rates in the real optimizer, a run end to end and a
fine-tune from its checkpoint, 1 vs 4 devices. Classifiers on trunk taps and the head's own
weight decay: tests/test_supervised_heads.py."""

import ast
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import supervised
from jssl import losses, methods, parallel
from jssl.checkpoints import warm_start
from jssl.engines import train
from jssl.evaluation import monitor


def test_cross_entropy_by_hand():
    # Probabilities (1/4, 1/2, 1/4); label 1: -ln(1/2) = ln 2.
    logits = jnp.log(jnp.array([[1.0, 2.0, 1.0], [1.0, 2.0, 1.0]]))
    labels = jnp.array([1, 0])
    np.testing.assert_allclose(
        losses.cross_entropy(logits, labels), [math.log(2), math.log(4)], rtol=1e-6
    )
    # Smoothing 0.3 over K=3: targets 0.1 + 0.7 * one_hot. Row 0: -(0.1 ln 1/4 + 0.8 ln 1/2 +
    # 0.1 ln 1/4) = 1.2 ln 2; row 1: -(0.8 ln 1/4 + 0.1 ln 1/2 + 0.1 ln 1/4) = 1.9 ln 2.
    np.testing.assert_allclose(
        losses.cross_entropy(logits, labels, 0.3), [1.2 * math.log(2), 1.9 * math.log(2)], rtol=1e-6
    )


def test_multiple_outputs_by_hand():
    # VISSL's criterion: each output against the same labels, logits / T (normalised first
    # with normalize_output), label smoothing, the losses SUMMED over outputs.
    labels = jnp.array([1, 0])
    a = jnp.log(jnp.array([[1.0, 2.0, 1.0], [1.0, 2.0, 1.0]]))  # CE: ln 2, ln 4
    b = jnp.array([[0.0, 0.0], [2 * math.log(3), 0.0]])  # at T=2: (1/2, 1/2), (3/4, 1/4)
    loss, per_output = losses.multi_output_cross_entropy({"a": a, "b": b}, labels, temperature=2)
    # a at T=2: probabilities prop. to sqrt(1, 2, 1): label 1 -> -ln(sqrt2 / (2 + sqrt2)).
    want_a = [-math.log(math.sqrt(2) / (2 + math.sqrt(2))), -math.log(1 / (2 + math.sqrt(2)))]
    np.testing.assert_allclose(per_output["a"], want_a, rtol=1e-6)
    np.testing.assert_allclose(per_output["b"], [math.log(2), -math.log(3 / 4)], rtol=1e-6)
    assert float(loss) == pytest.approx(np.mean(want_a) + (math.log(2) - math.log(0.75)) / 2)
    # A list of outputs is named by position; smoothing 0.5 on b at T=1, K=2: targets
    # (0.25, 0.75) and (0.75, 0.25).
    _, listed = losses.multi_output_cross_entropy([b], labels, label_smoothing=0.5)
    p1 = 1 / (1 + 9)  # row 1 at T=1: logits (2 ln 3, 0) -> (9/10, 1/10)
    want = [math.log(2), -(0.75 * math.log(1 - p1) + 0.25 * math.log(p1))]
    np.testing.assert_allclose(listed["0"], want, rtol=1e-6)
    # normalize_output: rows scaled to unit norm first, so the scale of the logits is gone.
    scaled = losses.cross_entropy(10.0 * b + 0.0, labels, normalize_output=True, temperature=0.5)
    unit = jnp.array([[0.0, 0.0], [2.0, 0.0]])  # row 1 normalised (1, 0), / 0.5
    np.testing.assert_allclose(scaled, losses.cross_entropy(unit, labels), rtol=1e-6)


def test_top_k_hits_by_hand():
    logits = jnp.array([[0.0, 5.0, 4.0, 3.0, 2.0, 1.0, -1.0]] * 3)  # ranks: 1, 2, 3, 4, 5, 0, 6
    hits = losses.top_k_hits(logits, jnp.array([1, 0, 6]), ks=(1, 5))
    np.testing.assert_array_equal(hits[1], [1, 0, 0])
    np.testing.assert_array_equal(hits[5], [1, 0, 0])  # class 0 ranks 6th, class 6 7th
    hits = losses.top_k_hits(logits, jnp.array([5, 0, 2]), ks=(1, 5))
    np.testing.assert_array_equal(hits[5], [1, 0, 1])
    # Fewer classes than k: top-5 of 3 classes counts every example.
    three = losses.top_k_hits(jnp.array([[0.0, 1.0, 2.0]]), jnp.array([0]), ks=(1, 5))
    assert float(three[1][0]) == 0.0 and float(three[5][0]) == 1.0


def test_presets_follow_vissl():
    c = supervised.get_config()
    assert c.model.head_dims == (2048, 1000) and c.data.augment.num_crops == (1,)
    assert (c.optim.name, c.optim.base_lr, c.optim.base_lr_batch_size) == ("sgd", 0.1, 256)
    assert c.optim.nesterov and c.optim.weight_decay == 1e-4 and not c.optim.regularize_bn
    assert c.optim.milestones == (30, 60, 90, 100) and c.num_epochs == 105
    assert c.optim.update_interval == "epoch" and c.test_every_epochs == 1
    for preset, name in (("finetune_1pct", "1pct"), ("finetune_10pct", "10pct")):
        f = supervised.get_config(preset)
        assert f.data.name == f"imagenet2012_subset/{name}" and f.data.test_split == "validation"
        assert (f.optim.base_lr, f.optim.milestones, f.num_epochs) == (0.05, (30,), 70)
        assert f.optim.weight_decay == 0.0 and f.optim.nesterov and f.data.batch_size == 256
        assert f.init.skip == ("head",) and f.method.require_init_checkpoint
        assert f.optim.param_groups == (("head", 1.0),)
        assert f.data.augment.color_jitter_prob == (0.0,)  # crop + flip only
    assert supervised.get_config("finetune_demo").method.name == "supervised"


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("data.augment.num_crops", (2,), r"num_crops=\(2,\).*'\(1,\)'"),
        ("method.label_smoothing", 1.0, "method.label_smoothing=1.0"),
        ("model.head_dims", (), r"model.head_dims=\(\)"),
        ("method.require_init_checkpoint", True, "init.checkpoint is empty"),
        ("model.head_dims", (64, 5), r"10 classes.*5 outputs.*'\(64, 10\)'"),
    ],
)
def test_bad_settings_name_the_field(field, value, message, shared_dirs):
    config = supervised.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.update_from_flattened_dict({field: value})
    with pytest.raises(ValueError, match=message):
        train.validate(config)


def one_sgd_update(param_groups: tuple, weight_decay: float, gradient: float):
    """The train engine's optimizer for the supervised test preset (SGD, constant rate) given
    ``param_groups``: one update of parameters all 0.5 under gradients all ``gradient``.
    Returns (updates, the base learning rate)."""
    config = supervised.get_config("test")
    config.optim.update_from_flattened_dict(
        {
            "param_groups": param_groups,
            "weight_decay": weight_decay,
            "nesterov": False,
            "schedule": "constant",
        }
    )
    method = methods.get(config, steps_per_epoch=4)
    tx, _ = train.make_optimizer(config, method, steps_per_epoch=4)
    size = config.data.image_size
    shapes = jax.eval_shape(method.init, jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3)))
    params = jax.tree.map(lambda x: jnp.full(x.shape, 0.5), shapes["params"])
    grads = jax.tree.map(lambda x: jnp.full_like(x, gradient), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    lr = config.optim.base_lr * config.data.batch_size / config.optim.base_lr_batch_size
    return updates, lr


def test_head_learning_rate_applies_in_the_trainer():
    # The train engine's optimizer with the head at 10x: one SGD step on equal gradients
    # moves every head weight 10x as far as every trunk weight.
    updates, lr = one_sgd_update((("head", 10.0),), weight_decay=0.0, gradient=1.0)
    for leaf in jax.tree.leaves(updates["trunk"]):
        np.testing.assert_allclose(leaf, -lr, rtol=1e-6)
    for leaf in jax.tree.leaves(updates["head"]):
        np.testing.assert_allclose(leaf, -10 * lr, rtol=1e-6)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def pretrained(shared_dirs, tmp_path_factory):
    """(config, workdir, summary, logged lines) of 2 epochs of the test preset, a test phase
    after each on 40 examples: 2 batches of 16 and one of 8 real rows and 8 padding rows."""
    config = supervised.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.checkpoint.async_save = False
    config.data.test_split = "test[:40]"
    workdir = tmp_path_factory.mktemp("supervised")
    root, handler = logging.getLogger(), _Lines()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        summary = train.run(config, str(workdir))
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return config, workdir, summary, handler.lines


def test_trains_and_each_test_phase_logs_exact_accuracies(pretrained):
    _, workdir, summary, lines = pretrained
    assert summary["step"] == 8
    phases = [line for line in lines if line.startswith("Test phase after epoch")]
    assert len(phases) == 2
    # The last phase's figures agree with the per-example logits it saved (real rows only).
    result = ast.literal_eval(phases[-1].split(": ", 1)[1])
    outputs = workdir / "eval" / "epoch_2"
    logits, labels = np.load(outputs / "embeddings.npy"), np.load(outputs / "labels.npy")
    assert logits.shape == (40, 10) and result["num_examples"] == 40
    top5 = np.argsort(-logits, axis=1)[:, :5]
    np.testing.assert_allclose(result["top1"], 100 * np.mean(top5[:, 0] == labels), rtol=1e-5)
    np.testing.assert_allclose(result["top5"], 100 * np.mean(np.any(top5 == labels[:, None], 1)))
    ce = np.load(outputs / "term_cross_entropy.npy")
    np.testing.assert_allclose(result["loss"], ce.mean(), rtol=1e-5)


def test_test_phase_counts_hits_over_real_rows_only(pretrained):
    # One device shows the masking: the padding rows' labels are set to their predictions, so
    # counting them would raise the accuracy. The test phase's own eval step.
    config, _, summary, _ = pretrained
    mesh = parallel.make_mesh()
    state = summary["state"]
    step = monitor.make_test_step(config, methods.get(config), mesh)
    rs = np.random.RandomState(0)
    n, real = 16, 11
    batch = dict(
        image=rs.normal(size=(n, 16, 16, 3)).astype(np.float32),
        label=np.zeros(n, np.int32),
        index=np.arange(n, dtype=np.int32),
        mask=np.ones(n, bool),
    )
    _, outputs = step(state, parallel.host_batch_to_global(batch, mesh))
    logits = np.asarray(parallel.global_to_host(outputs)["embeddings"])
    predicted = logits.argmax(1)
    labels = rs.randint(0, 10, size=n).astype(np.int32)
    labels[real:] = predicted[real:]
    batch = dict(batch, label=labels, mask=np.arange(n) < real)
    totals = jax.device_get(step(state, parallel.host_batch_to_global(batch, mesh))[0])
    top1_hits = predicted[:real] == labels[:real]
    top5 = np.argsort(-logits, axis=1)[:real, :5]
    top5_hits = np.any(top5 == labels[:real, None], axis=1)
    assert totals["top1"][1] == real and totals["top5"][1] == real
    np.testing.assert_allclose(totals["top1"][0], 100.0 * top1_hits.sum(), rtol=1e-6)
    np.testing.assert_allclose(totals["top5"][0], 100.0 * top5_hits.sum(), rtol=1e-6)
    assert top1_hits.sum() < real  # the padding rows (all hits) would have changed it


def test_fine_tuning_starts_from_the_trunk_with_a_fresh_classifier(pretrained):
    # The fine-tuning preset from the tiny run's workdir: trunk weights and BN statistics
    # loaded, the classifier fresh (init.skip) whatever the checkpoint's head holds.
    config, workdir, summary, _ = pretrained
    tune = supervised.get_config("finetune_demo")
    # The tiny run's model and data, and its optimizer (the same state to build: compiled).
    tune.model, tune.data, tune.optim = config.model, config.data, config.optim
    tune.init.checkpoint = str(workdir)
    train.validate(tune)
    mesh = parallel.make_mesh()
    method = methods.get(tune, steps_per_epoch=4)
    tx, _ = train.make_optimizer(tune, method, steps_per_epoch=4)
    fresh = train.init_state(tune, method, tx, mesh)
    start = warm_start.init_train_state(tune, fresh)
    trained = summary["state"]
    for name in ("params", "batch_stats"):
        for a, b in zip(
            jax.tree.leaves(getattr(trained, name)["trunk"]),
            jax.tree.leaves(getattr(start, name)["trunk"]),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kernel = np.asarray(start.params["head"]["fc0"]["kernel"])
    np.testing.assert_array_equal(kernel, np.asarray(fresh.params["head"]["fc0"]["kernel"]))
    assert not np.allclose(kernel, np.asarray(trained.params["head"]["fc0"]["kernel"]))


# --------------------------------------------------------------------------------------------
# finetune_vit: MAE's ViT fine-tuning recipe


def test_finetune_vit_preset_is_maes_recipe():
    # FINETUNE.md's ViT-Base command over main_finetune.py's defaults (the paper's Table 9).
    c = supervised.get_config("finetune_vit")
    assert (c.model.trunk, c.model.patch_size, c.model.head_dims) == ("vit_base", 16, (768, 1000))
    assert c.model.drop_path_rate == 0.1 and c.method.head_input == "patch_avg"
    m = c.method
    assert (m.mixup_alpha, m.cutmix_alpha, m.mix_prob, m.switch_prob) == (0.8, 1.0, 1.0, 0.5)
    assert m.label_smoothing == 0.1 and m.require_init_checkpoint and c.init.skip == ("head",)
    o = c.optim
    assert (o.name, o.betas, o.base_lr, o.base_lr_batch_size) == ("adamw", (0.9, 0.999), 5e-4, 256)
    assert (o.layer_decay, o.weight_decay, o.warmup_epochs) == (0.65, 0.05, 5.0)
    assert not o.regularize_bias and not o.regularize_bn
    assert o.param_groups == (("trunk/pos_embed", 1.0, 0.0), ("trunk/cls_token", 1.0, 0.0))
    peak = o.base_lr * c.data.batch_size / o.base_lr_batch_size
    assert c.data.batch_size == 1024 and o.final_lr_fraction * peak == pytest.approx(1e-6)
    assert c.num_epochs == 100 and c.data.augment.crop_scale == (0.08, 1.0)
    assert c.data.augment.color_jitter_prob == (0.0,)


def tiny_finetune_vit(data_dir: str, checkpoint: str):
    """finetune_vit at the size of configs/dino.py:test_vit (its trunk, so its workdir loads)
    on the demo data: 2-block ViT-Tiny, 4 px patches on 16 px images, batch 16, one step."""
    from configs import dino

    source = dino.get_config("test_vit")
    c = supervised.get_config("finetune_vit")
    for field in ("trunk", "vit_depth", "patch_size", "image_size", "pos_embed_init"):
        c.model[field] = source.model[field]
    c.model.head_dims, c.model.dtype = (192, 10), "float32"
    for field in ("source", "name", "train_split", "test_split", "image_size", "train_subset"):
        c.data[field] = source.data[field]
    c.data.data_dir, c.data.batch_size = data_dir, 16
    c.init.checkpoint = checkpoint
    c.num_epochs, c.test_every_epochs, c.debug.max_steps = 1, 0, 1
    c.optim.warmup_epochs = 0.0  # the one step at the peak rate, not at the warmup's 0
    c.checkpoint.async_save, c.checkpoint.every_steps = False, 0
    return c


@pytest.mark.slow
def test_finetune_vit_starts_from_a_dino_vit_workdir(shared_dirs, tmp_path):
    # One step of configs/dino.py:test_vit, then finetune_vit from its workdir: the trunk
    # loaded, a fresh classifier on the patch tokens' mean, and a step of the whole recipe
    # (layer decay, mixup / CutMix, drop path, AdamW) that stays finite.
    from configs import dino

    source = dino.get_config("test_vit")
    source.data.data_dir = shared_dirs[0]
    source.checkpoint.async_save = False
    source.debug.max_steps = 1
    dino_dir = tmp_path / "dino"
    pretrained = train.run(source, str(dino_dir))["state"]
    tune = tiny_finetune_vit(shared_dirs[0], str(dino_dir))
    train.validate(tune)
    method = methods.get(tune, steps_per_epoch=4)
    tx, _ = train.make_optimizer(tune, method, steps_per_epoch=4)
    fresh = train.init_state(tune, method, tx, parallel.make_mesh())
    start = warm_start.init_train_state(tune, fresh)
    for a, b in zip(
        jax.tree.leaves(pretrained.params["trunk"]),
        jax.tree.leaves(start.params["trunk"]),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(
        start.params["head"]["fc0"]["kernel"], fresh.params["head"]["fc0"]["kernel"]
    )
    summary = train.run(tune, str(tmp_path / "finetune"))
    assert summary["step"] == 1  # a non-finite loss would have stopped the run
    moved = jax.tree.map(
        lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
        summary["state"].params["trunk"],
        start.params["trunk"],
    )
    assert moved["blocks_1"]["fc1"]["kernel"] > 0
