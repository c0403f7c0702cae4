"""Supervised training with several outputs (VISSL's multiple-output cross-entropy): linear
classifiers on trunk taps, each its own loss term with its own top-1 / top-5 in training and in
the test phase, a zero weight that removes an output's gradient, the settings' checks; and the
head's own weight decay (VISSL's head_optimizer_params) in the finetune_full preset and in the
trainer's optimizer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_supervised import one_sgd_update

from configs import base, supervised
from jssl import data, losses, methods, parallel
from jssl.engines import train
from jssl.evaluation import monitor
from jssl.parallel import DATA_AXIS

# ---------------------------------------------------------------------------------------------
# Several outputs: classifiers on trunk taps


def _taps_config(**weights):
    config = supervised.get_config("test")
    config.method.tap_classifiers = ("res4", "res5")
    base.loss_terms(config, cross_entropy=1.0, **weights)
    return config


def test_tap_classifiers_are_terms_summed_with_their_own_accuracy():
    config = _taps_config()
    methods.check_config(config)
    assert [t.name for t in methods.loss_terms(config)] == [
        "cross_entropy",
        "cross_entropy_res4",
        "cross_entropy_res5",
    ]
    assert config.loss.weights.cross_entropy_res4 is None  # a field for the command line
    mesh = parallel.make_mesh()
    method = methods.get(config, steps_per_epoch=4)
    tx, _ = train.make_optimizer(config, method, 4)
    state = train.init_state(config, method, tx, mesh)
    assert set(state.params["tap_classifiers"]) == {"res4", "res5"}
    batch = parallel.host_batch_to_global(data.synthetic_batch(config.data, 16, seed=0), mesh)

    def per_replica(state, batch):
        (value, out), grads = jax.value_and_grad(
            lambda p: method.loss(p, state, batch, state.rng, True), has_aux=True
        )(state.params)
        # The res4 classifier by hand: its tap averaged over positions, then its Dense layer.
        model_params = {k: v for k, v in state.params.items() if k != "tap_classifiers"}
        taps = method.model.apply(
            {"params": model_params, "batch_stats": state.batch_stats},
            batch["crops"][0][:, 0],
            train=True,
            mutable=["batch_stats"],
        )[0]
        dense = state.params["tap_classifiers"]["res4"]
        logits = jnp.mean(taps["res4"], axis=(1, 2)) @ dense["kernel"] + dense["bias"]
        by_hand = losses.cross_entropy(logits, batch["label"])
        mean = lambda tree: jax.lax.pmean(tree, DATA_AXIS)  # noqa: E731
        return (
            mean(value),
            mean(grads),
            mean(out.metrics),
            out.per_example_loss,
            out.terms,
            out.per_example_metrics,
            by_hand,
        )

    run = jax.jit(
        jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(P(), P(DATA_AXIS)),
            out_specs=(P(), P(), P(), *(P(DATA_AXIS),) * 4),
            check_vma=False,
        )
    )
    value, grads, metrics, per_example, terms, hits, by_hand = run(state, batch)
    np.testing.assert_allclose(terms["cross_entropy_res4"], by_hand, rtol=1e-5)
    np.testing.assert_allclose(per_example, sum(terms.values()), rtol=1e-6)  # summed, weight 1
    assert {"top1", "top5", "top1_res4", "top5_res4", "top1_res5", "top5_res5"} <= set(hits)
    assert {"loss/cross_entropy_res5", "top1_res4"} <= set(metrics)
    assert np.abs(jax.tree.leaves(grads["tap_classifiers"]["res4"])[0]).max() > 0

    # The test phase reports each output's accuracy and term over the real rows.
    step = monitor.make_test_step(config, method, mesh)
    rs = np.random.RandomState(0)
    eval_batch = dict(
        image=rs.normal(size=(16, 16, 16, 3)).astype(np.float32),
        label=rs.randint(0, 10, size=16).astype(np.int32),
        index=np.arange(16, dtype=np.int32),
        mask=np.arange(16) < 12,
    )
    totals = jax.device_get(step(state, parallel.host_batch_to_global(eval_batch, mesh))[0])
    for name in ("top1_res4", "top5_res5", "loss/cross_entropy_res4"):
        assert totals[name][1] == 12, name

    # Weight 0 on an output: its classifier gets no gradient; the others are unchanged.
    zero = _taps_config(cross_entropy_res4=0.0)
    zero_method = methods.get(zero, steps_per_epoch=4)
    zero_grads = jax.jit(
        jax.shard_map(
            lambda s, b: jax.lax.pmean(
                jax.grad(lambda p: zero_method.loss(p, s, b, s.rng, True)[0])(s.params), DATA_AXIS
            ),
            mesh=mesh,
            in_specs=(P(), P(DATA_AXIS)),
            out_specs=P(),
            check_vma=False,
        )
    )(state, batch)
    assert all(np.abs(g).max() == 0 for g in jax.tree.leaves(zero_grads["tap_classifiers"]["res4"]))
    for got, want in zip(
        jax.tree.leaves(zero_grads["tap_classifiers"]["res5"]),
        jax.tree.leaves(grads["tap_classifiers"]["res5"]),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)
    assert not np.allclose(
        jax.tree.leaves(zero_grads["trunk"])[0], jax.tree.leaves(grads["trunk"])[0]
    )


def test_tap_classifier_settings_are_checked():
    config = supervised.get_config("test")
    config.method.tap_classifiers = ("res4", "res4")
    with pytest.raises(ValueError, match="distinct trunk tap names"):
        methods.check_config(config)
    config.method.tap_classifiers = ("res9",)
    method = methods.get(config, steps_per_epoch=4)
    with pytest.raises(ValueError, match=r"names \['res9'\].*its taps are"):
        method.init(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3)))


# ---------------------------------------------------------------------------------------------
# The head's own weight decay


def test_finetune_full_preset_gives_the_head_its_own_weight_decay():
    f = supervised.get_config("finetune_full")
    assert f.optim.weight_decay == 1e-4 and f.optim.param_groups == (("head", 1.0, 1e-6),)
    assert (f.optim.base_lr, f.optim.milestones, f.num_epochs, f.seed) == (
        0.1,
        (30, 60, 90, 100),
        105,
        1,
    )
    assert f.data.name == "imagenet2012" and f.init.skip == ("head",)


def test_head_weight_decay_applies_in_the_trainer():
    # Zero gradients: one SGD step is the weight decay alone, the head's 0.3 (its bias too,
    # regularize_bias), the trunk's convolutions 0.1, its batch norm none (regularize_bn).
    updates, lr = one_sgd_update((("head", 1.0, 0.3),), weight_decay=0.1, gradient=0.0)
    for leaf in jax.tree.leaves(updates["head"]):
        np.testing.assert_allclose(leaf, -lr * 0.3 * 0.5, rtol=1e-6)
    flat = jax.tree_util.tree_leaves_with_path(updates["trunk"])
    in_bn = [leaf for path, leaf in flat if any("bn" in str(k).lower() for k in path)]
    convs = [leaf for path, leaf in flat if str(path[-1]) == "['kernel']"]
    assert in_bn and convs
    assert all(np.abs(leaf).max() == 0 for leaf in in_bn)
    for leaf in convs:
        np.testing.assert_allclose(leaf, -lr * 0.1 * 0.5, rtol=1e-6)
