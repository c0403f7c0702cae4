"""Mixup and CutMix with label smoothing (jssl.losses.mixing, timm's Mixup in pair mode) by hand:
the CutMix box and its area-corrected lambda, the mixed images, the soft targets, the
soft-target cross-entropy and the dominant label; the draws' settings; pairs and draws that do
not depend on how the global batch is split over devices or micro-batches; the supervised
method mixing in training only, and its start-up checks."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import supervised as supervised_config
from jssl import losses, methods
from jssl.methods import supervised

MAE = losses.MixSettings(mixup_alpha=0.8, cutmix_alpha=1.0, mix_prob=1.0, switch_prob=0.5)
# Compiled: eager sampling costs more than a compile of each shape.
draw_mixes = jax.jit(losses.draw_mixes, static_argnums=(1, 2, 3))
mix_batch = jax.jit(supervised.mix_batch, static_argnums=(4, 5, 6))


@pytest.mark.parametrize(
    "lam, center, size, box, corrected",
    [
        # 10 x 10, lam 0.64: side int(10 * 0.6) = 6, centre (5, 5): rows and columns 2..7.
        (0.64, (5, 5), (10, 10), (2, 8, 2, 8), 0.64),
        # Clipped by the border: rows -2..3 -> 0..3 (4), columns 5..10 -> 5..9 (5): 1 - 20/100.
        (0.64, (1, 8), (10, 10), (0, 4, 5, 10), 0.8),
        # Odd side int(10 * sqrt(0.5)) = 7: half 3, so 6 rows and columns (timm's rand_bbox).
        (0.5, (5, 5), (10, 10), (2, 8, 2, 8), 0.64),
        # 8 x 12, lam 0.75: sides 4 and 6, centre (0, 0): rows 0..1, columns 0..2: 1 - 6/96.
        (0.75, (0, 0), (8, 12), (0, 2, 0, 3), 0.9375),
        # lam 1 (a pair not mixed): an empty box, lam stays 1.
        (1.0, (3, 3), (10, 10), (3, 3, 3, 3), 1.0),
    ],
)
def test_cutmix_box_and_area_corrected_lambda(lam, center, size, box, corrected):
    got_box, got_lam = losses.cutmix_box(jnp.float32(lam), *center, *size)
    np.testing.assert_array_equal(got_box, box)
    assert float(got_lam) == pytest.approx(corrected, abs=1e-6)


def _constant_images(values, height=4, width=4):
    return jnp.stack([jnp.full((height, width, 1), v, jnp.float32) for v in values])


def test_mixed_images_by_hand():
    # Pair 0 (rows 0, 1) blended at lam 0.3; pair 1 (rows 2, 3) with the box rows 1..2,
    # columns 0..1 swapped; images constant 1, 2, 3, 4.
    mixes = losses.PairMix(
        lam=jnp.array([0.3, 0.75]),
        cutmix=jnp.array([False, True]),
        box=jnp.array([[0, 0, 0, 0], [1, 3, 0, 2]], jnp.int32),
    )
    out = np.asarray(losses.mix_images(_constant_images([1, 2, 3, 4]), mixes))[..., 0]
    np.testing.assert_allclose(out[0], np.full((4, 4), 0.3 * 1 + 0.7 * 2), rtol=1e-6)
    np.testing.assert_allclose(out[1], np.full((4, 4), 0.3 * 2 + 0.7 * 1), rtol=1e-6)
    inside = np.zeros((4, 4), bool)
    inside[1:3, 0:2] = True
    np.testing.assert_array_equal(out[2], np.where(inside, 4.0, 3.0))
    np.testing.assert_array_equal(out[3], np.where(inside, 3.0, 4.0))
    # A pair not mixed (lam 1, no box) keeps its images.
    same = losses.PairMix(jnp.ones(2), jnp.zeros(2, bool), jnp.zeros((2, 4), jnp.int32))
    images = _constant_images([1, 2, 3, 4])
    np.testing.assert_array_equal(losses.mix_images(images, same), images)


def test_soft_targets_with_label_smoothing_by_hand():
    # K = 4, smoothing 0.1: 0.925 on the label, 0.025 elsewhere (timm's mixup_target).
    targets = losses.mixed_targets(jnp.array([0, 1, 2, 2]), jnp.array([0.3, 0.8]), 4, 0.1)
    want = [
        [0.3 * 0.925 + 0.7 * 0.025, 0.3 * 0.025 + 0.7 * 0.925, 0.025, 0.025],
        [0.7 * 0.925 + 0.3 * 0.025, 0.7 * 0.025 + 0.3 * 0.925, 0.025, 0.025],
        [0.025, 0.025, 0.925, 0.025],  # partners of one class: the smoothed label
        [0.025, 0.025, 0.925, 0.025],
    ]
    np.testing.assert_allclose(targets, want, rtol=1e-6)
    # Not mixed, not smoothed: the one-hot labels.
    plain = losses.mixed_targets(jnp.array([3, 0]), jnp.ones(1), 4)
    np.testing.assert_array_equal(plain, [[0, 0, 0, 1], [1, 0, 0, 0]])


def test_soft_target_cross_entropy_by_hand():
    # Probabilities (1/4, 1/2, 1/4), target (1/2, 1/2, 0): -(ln 1/4 + ln 1/2) / 2 = 1.5 ln 2.
    logits = jnp.log(jnp.array([[1.0, 2.0, 1.0]]))
    ce = losses.soft_target_cross_entropy(logits, jnp.array([[0.5, 0.5, 0.0]]))
    np.testing.assert_allclose(ce, [1.5 * math.log(2)], rtol=1e-6)
    # Against the smoothed labels it is the label-smoothed cross-entropy (temperature too).
    logits = jnp.array([[0.3, -1.0, 2.0], [1.0, 0.5, -0.5]])
    labels = jnp.array([2, 1])
    targets = losses.mixed_targets(labels, jnp.ones(1), 3, 0.2)
    np.testing.assert_allclose(
        losses.soft_target_cross_entropy(logits, targets, temperature=0.5),
        losses.cross_entropy(logits, labels, 0.2, temperature=0.5),
        rtol=1e-6,
    )


def test_dominant_label():
    # lam 0.3: the partner's label dominates; lam 0.5: a tie, the own label; same class: own.
    labels = jnp.array([0, 1, 2, 3, 4, 4])
    targets = losses.mixed_targets(labels, jnp.array([0.3, 0.5, 0.3]), 5, 0.1)
    np.testing.assert_array_equal(losses.dominant_labels(labels, targets), [1, 0, 2, 3, 4, 4])


def test_draws_follow_the_settings():
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)
    mixes = draw_mixes(keys, 10, 12, MAE)
    lam, cutmix, box = (np.asarray(x) for x in mixes)
    assert 0.45 < cutmix.mean() < 0.55  # switch_prob 0.5
    assert np.all((lam >= 0) & (lam <= 1))
    # Mixup's lam ~ Beta(0.8, 0.8): mean 1/2, variance 1/4 / (2 * 0.8 + 1) = 0.0962.
    assert abs(lam[~cutmix].mean() - 0.5) < 0.02
    assert abs(lam[~cutmix].var() - 0.25 / 2.6) < 0.01
    # CutMix's lam is 1 - the clipped box's area, and mixup pairs carry no box.
    area = (box[:, 1] - box[:, 0]) * (box[:, 3] - box[:, 2])
    np.testing.assert_allclose(lam[cutmix], 1 - area[cutmix] / 120.0, atol=1e-6)
    assert not area[~cutmix].any()
    # mix_prob 0: nothing mixed; only CutMix on: every pair CutMix.
    off = draw_mixes(keys[:50], 10, 12, MAE._replace(mix_prob=0.0))
    assert np.all(np.asarray(off.lam) == 1.0) and not np.asarray(off.cutmix).any()
    only = draw_mixes(keys[:50], 10, 12, MAE._replace(mixup_alpha=0.0))
    assert np.asarray(only.cutmix).all()
    only = draw_mixes(keys[:50], 10, 12, MAE._replace(cutmix_alpha=0.0))
    assert not np.asarray(only.cutmix).any()


def _global_batch(n=16, size=8, classes=10):
    rs = np.random.RandomState(0)
    images = jnp.asarray(rs.normal(size=(n, size, size, 3)), jnp.float32)
    labels = jnp.asarray(rs.randint(0, classes, n), jnp.int32)
    index = jnp.asarray(rs.permutation(1000)[:n], jnp.int32)  # dataset indices, any order
    return images, labels, index


def test_pairs_and_draws_do_not_depend_on_the_split():
    # The global batch of 16 mixed at once (1 device) and in 4 slices, each mixed alone with
    # the same step key (4 devices, or 4 micro-batches): the same images and targets.
    images, labels, index = _global_batch()
    rng = jax.random.PRNGKey(3)

    def mix(sl):
        return mix_batch(images[sl], labels[sl], index[sl], rng, MAE, 10, 0.1)

    whole_images, whole_targets = mix(slice(None))
    sliced = [mix(slice(i, i + 4)) for i in range(0, 16, 4)]
    np.testing.assert_array_equal(np.concatenate([s[0] for s in sliced]), whole_images)
    np.testing.assert_array_equal(np.concatenate([s[1] for s in sliced]), whole_targets)
    # Something was mixed, and each pair's draw follows its examples, not its position: the
    # pairs in reverse order give the same mixed pairs.
    assert not np.allclose(whole_images, images)
    order = np.arange(16).reshape(8, 2)[::-1].reshape(-1)
    moved_images, moved_targets = mix(order)
    np.testing.assert_array_equal(moved_images, whole_images[order])
    np.testing.assert_array_equal(moved_targets, whole_targets[order])


def _mixing_config(**method):
    config = supervised_config.get_config("test")
    config.method.update(dict(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, **method))
    return config


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_training_mixes_and_the_test_phase_does_not():
    # A one-block ViT whose classifier reads the patch tokens' mean (MAE's global_pool).
    config = _mixing_config(head_input="patch_avg")
    config.model.update(
        dict(trunk="vit_tiny", vit_depth=1, patch_size=8, image_size=16, head_dims=(192, 10))
    )
    method = methods.get(config, steps_per_epoch=4)
    images, labels, index = _global_batch(n=8, size=16)

    @jax.jit  # one compile for all of it: eager, the tiny ViT costs twice as much
    def run(images, labels, index, rng):
        variables = method.init(jax.random.PRNGKey(0), images[:1])
        params = variables["params"]
        state = types.SimpleNamespace(batch_stats=variables["batch_stats"])  # what they read
        batch = dict(crops=[images[:, None]], label=labels, index=index)
        taps = method.model.apply({"params": params}, images, train=False)
        runs = {}
        for train in (False, True):
            out = method.forward(params, state, batch, rng, train)
            runs[train] = out.embeddings, method.objective(out.embeddings, state, batch, train)
        _, targets = supervised.mix_batch(images, labels, index, rng, MAE, 10, 0.1)
        return params["head"]["fc0"], taps, runs, targets

    head, taps, runs, targets = jax.device_get(run(images, labels, index, jax.random.PRNGKey(5)))
    labels = np.asarray(labels)
    clean = taps["patch_avg"] @ head["kernel"] + head["bias"]
    np.testing.assert_allclose(taps["head"], clean, rtol=1e-4, atol=1e-5)
    # Evaluation: the clean images' logits, no soft targets, the label-smoothed cross-entropy.
    embeddings, out = runs[False]
    assert set(embeddings) == {"head"}
    np.testing.assert_allclose(embeddings["head"][0], taps["head"], rtol=1e-5, atol=1e-6)
    smoothed = np.full((8, 10), 0.01) + 0.9 * np.eye(10)[labels]
    want = -np.sum(smoothed * _log_softmax(taps["head"]), -1)
    np.testing.assert_allclose(out.terms["cross_entropy"], want, rtol=1e-5)
    # Training: the images of mix_batch (other logits), its soft targets, hits on the label with
    # the larger share of each target.
    embeddings, out = runs[True]
    np.testing.assert_allclose(embeddings[supervised.MIX_TARGETS][0], targets)
    logits = embeddings["head"][0]
    assert not np.allclose(logits, taps["head"], atol=1e-4)
    want = -np.sum(targets * _log_softmax(logits), -1)
    np.testing.assert_allclose(out.terms["cross_entropy"], want, rtol=1e-5)
    partner = labels.reshape(4, 2)[:, ::-1].reshape(-1)
    own = targets[np.arange(8), labels]
    dominant = np.where(own >= targets[np.arange(8), partner], labels, partner)
    assert (dominant != labels).any()  # some row's partner dominates: the check can fail
    hits = 100.0 * (logits.argmax(-1) == dominant)
    np.testing.assert_array_equal(out.per_example_metrics["top1"], hits)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("method.mixup_alpha", -0.1, "method.mixup_alpha=-0.1 must be >= 0"),
        ("method.switch_prob", 1.5, "method.switch_prob=1.5 is a probability"),
        ("data.batch_size", 17, r"leaves 17 examples \(odd\)"),
        ("optim.accumulation_steps", 16, r"leaves 1 examples \(odd\)"),
        ("method.head_input", "patch_avg", "method.head_input='patch_avg'"),
    ],
)
def test_bad_mixing_settings_name_the_field(field, value, message):
    config = _mixing_config()
    config.update_from_flattened_dict({field: value})
    with pytest.raises(ValueError, match=message):
        methods.check_config(config)
