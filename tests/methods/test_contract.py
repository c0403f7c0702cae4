"""Every registered method against the contract of jssl/methods/__init__.py, one row each.

On a tiny batch of the method's "test" preset (and DINO's and MoCo v3's ViT variants): init,
the forward's outputs (types, shapes, finite), the objective on the forward's embeddings, on
perturbed ones and on ones made by hand (a function of embeddings alone, differentiable in
them), the loss through the real train step (the same value, every term logged weighted and
unweighted), and ``after_update`` (the state keeps its layout). The contract's own checks (a
missing output, a term of the wrong shape) are tested on a method made here. Each method's run
end to end with a test phase: test_contract_runs.py.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jssl import data, methods, parallel
from jssl.data import device_augment
from jssl.engines import train
from jssl.methods import Forward, Method, Objective, common
from jssl.parallel import DATA_AXIS
from jssl.training.step import make_train_step


class Row(NamedTuple):
    """What a method's row expects.

    method_state: the keys of its ``state.method_state`` (queues, centres).
    teacher: whether it has a momentum encoder / teacher (``ema_params``).
    """

    method_state: tuple[str, ...] = ()
    teacher: bool = False


ROWS = {
    "moco": Row(method_state=("queue", "queue_ptr"), teacher=True),
    "simclr": Row(),
    "byol": Row(teacher=True),
    "mocov3": Row(teacher=True),
    "simsiam": Row(),
    "barlow_twins": Row(),
    "vicreg": Row(),
    "swav": Row(method_state=("queue", "queue_filled", "queue_ptr")),
    "deepclusterv2": Row(
        method_state=("assignments", "bank", "bank_epoch", "centroids", "nonempty_clusters")
    ),
    "dino": Row(method_state=("center",), teacher=True),
    "ibot": Row(method_state=("center", "patch_center"), teacher=True),
    "dinov2": Row(teacher=True),  # Sinkhorn centring (the test preset): no centres
    "msn": Row(teacher=True),
    "mae": Row(),
    "supervised": Row(),
}

# The contract's cases: every method's "test" preset, and the ViT variants.
CASES = {name: (name, {}) for name in methods.METHODS}
CASES["dino_vit"] = ("dino", {"preset": "test_vit"})
CASES["ibot_bn"] = ("ibot", {"method.use_bn_in_head": True})  # iBOT's --norm_in_head bn
CASES["mocov3_vit"] = (
    "mocov3",
    {
        # The ViT of tests/methods/test_mocov3.py: a 2-block ViT-Tiny/4.
        "model.trunk": "vit_tiny",
        "model.vit_depth": 2,
        "model.patch_size": 4,
        "model.drop_path_rate": 0.0,
        "model.head_dims": (192, 32, 16),
        "method.freeze_patch_embed": True,
        "method.predictor_last_bn": True,
        "optim.name": "adamw",
        "optim.base_lr": 1e-2,
        "optim.weight_decay": 0.1,
    },
)


def _config(case: str):
    name, overrides = CASES[case]
    overrides = dict(overrides)
    preset = overrides.pop("preset", "test")
    config = importlib.import_module(f"configs.{name}").get_config(preset)
    config.update_from_flattened_dict(overrides)
    return config


def test_every_method_has_a_row_and_a_test_preset():
    assert set(ROWS) == set(methods.METHODS)
    for name in methods.METHODS:
        module = importlib.import_module(f"configs.{name}")
        for preset in ("demo", "test"):
            assert module.get_config(preset).method.name == name
        with pytest.raises(ValueError, match="Unknown preset"):
            module.get_config("nope")


def test_unknown_method_is_clear():
    config = _config("moco")
    config.method.name = "moco_v9"
    with pytest.raises(ValueError, match="method.name"):
        methods.get(config)


def _perturbed(tree: Any, key: jax.Array, scale: float | None) -> Any:
    """``tree`` plus Gaussian noise of ``scale`` (None: the noise alone, made by hand)."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    noisy = []
    for leaf, k in zip(leaves, keys, strict=True):
        noise = jax.random.normal(k, leaf.shape, jnp.float32)
        noisy.append((noise if scale is None else leaf + scale * noise).astype(leaf.dtype))
    return treedef.unflatten(noisy)


# Slow tier (JSSL_SLOW_TESTS=1): the ViT variants run the same method code as their ResNet
# rows; their ViT steps are in CI elsewhere (DINO's: test_parallel.py's dino_vit row; MoCo
# v3's: test_mocov3.py's frozen patch projection and momentum encoder tests). For the CI's
# time, also the methods whose real step their own files compile in CI: BYOL
# (test_byol.py's EMA target), SimSiam (test_simsiam.py's stop-gradient) and MoCo v3
# (test_mocov3.py, and test_parallel.py's mocov3 row on 1 and 4 devices); DINOv2, whose step
# is iBOT's (its row here) with KoLeo and Sinkhorn, compiled in test_dinov2.py's terms tests;
# Barlow Twins and VICReg (their train steps on 1 and 4 devices: test_barlow_twins.py and
# test_vicreg.py through tests/support/decorrelation_parity.py); SwAV (test_swav.py's frozen
# prototypes and queue, its compiled step); DeepCluster v2 (test_deepclusterv2.py's k-means at
# epoch starts, its compiled step); the supervised method (test_supervised.py trains it end to
# end with test phases); iBOT (test_ibot.py compiles its forward and runs its objective).
SLOW_CASES = ("dino_vit", "mocov3_vit", "byol", "simsiam", "mocov3", "dinov2")
SLOW_CASES += ("barlow_twins", "vicreg", "swav", "deepclusterv2", "supervised", "ibot")


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES]
)
def test_method_meets_the_contract(case):
    config = _config(case)
    row = ROWS[CASES[case][0]]
    mesh = parallel.make_mesh()
    method = methods.get(config, steps_per_epoch=4)
    assert isinstance(method, Method) and method.name == config.method.name
    assert [t.name for t in method.terms] == [t.name for t in methods.loss_terms(config)]
    tx, schedule = train.make_optimizer(config, method, steps_per_epoch=4)
    state = train.init_state(config, method, tx, mesh)
    assert sorted(state.method_state) == sorted(row.method_state)
    if row.teacher:
        assert jax.tree.leaves(state.ema_params)
    else:
        assert state.ema_params == {} and state.ema_batch_stats == {}
    host_batch = data.synthetic_batch(config.data, 16, seed=0)
    host_batch["label"] = np.arange(16, dtype=np.int32) % 10
    batch = parallel.host_batch_to_global(host_batch, mesh)
    rng = jax.random.fold_in(state.rng, state.step)  # the step's key
    augment = device_augment.make_batch_augment(config.data)  # as the train engine's step
    seen = {}

    def per_replica(state, batch):
        batch = batch if augment is None else augment(batch)
        out = method.forward(state.params, state, batch, rng, True)
        seen["forward"] = out

        def value_of(embeddings):
            return methods.objective_loss(method, embeddings, state, batch, True)

        (value, weighted), grads = jax.value_and_grad(value_of, has_aux=True)(out.embeddings)
        key = jax.random.fold_in(jax.random.key(1), jax.lax.axis_index(DATA_AXIS))
        perturbed = value_of(_perturbed(out.embeddings, key, 0.5))[0]
        made = value_of(_perturbed(out.embeddings, key, None))[0]
        scalars = dict(value=value, perturbed=perturbed, made=made)
        scalars["grad_norm"] = jnp.sqrt(
            jax.lax.psum(
                sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)),
                DATA_AXIS,
            )
        )
        finite = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves((out, grads, weighted))]
        scalars["finite"] = jnp.all(jnp.stack(finite)).astype(jnp.float32)
        rows = dict(features=out.features, per_example_loss=weighted.per_example_loss)
        rows.update({f"term_{k}": v for k, v in weighted.terms.items()})
        mean = lambda tree: jax.lax.pmean(tree, DATA_AXIS)  # noqa: E731
        return mean(scalars), rows

    run = jax.jit(
        jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(P(), P(DATA_AXIS)),
            out_specs=(P(), P(DATA_AXIS)),
            check_vma=False,
        )
    )
    scalars, rows = jax.device_get(run(state, batch))
    n = 16 // jax.device_count()

    # The forward: the contract's types and layouts, seen at trace time.
    forward = seen["forward"]
    assert isinstance(forward, Forward)
    for leaf in jax.tree.leaves(forward.embeddings):
        assert leaf.ndim >= 2 and leaf.shape[1] == n, leaf.shape  # (crops, n, ...)
    assert forward.features.shape[0] == n
    assert forward.head is None or forward.head.shape[0] == n
    assert jax.tree.structure(forward.batch_stats) == jax.tree.structure(state.batch_stats)
    assert rows["features"].shape[0] == 16
    # The objective: every term per example, finite, and a function of the embeddings alone:
    # other embeddings give another loss, and its gradient reaches them.
    assert scalars["finite"] == 1.0 and np.isfinite(scalars["made"])
    names = [t.name for t in method.terms]
    for name in ("per_example_loss", *(f"term_{t}" for t in names)):
        assert rows[name].shape == (16,), name
    np.testing.assert_allclose(np.mean(rows["per_example_loss"]), scalars["value"], rtol=1e-5)
    assert scalars["perturbed"] != scalars["value"] and scalars["made"] != scalars["value"]
    assert scalars["grad_norm"] > 0

    # The loss through the step: the same value, each term logged weighted and unweighted.
    probe_config = config if config.probe.num_classes else None
    step = make_train_step(method, tx, schedule, mesh, probe_config=probe_config, augment=augment)
    before = jax.device_get(state)
    new_state, metrics = step(state, batch)
    metrics = jax.device_get(metrics)
    np.testing.assert_allclose(metrics["loss"], scalars["value"], rtol=1e-5)
    for name in names:
        for key in (f"loss/{name}", f"loss/{name}_weighted", f"loss_weight/{name}"):
            assert np.isfinite(metrics[key]), key
    for family in {t.family for t in method.terms}:
        assert np.isfinite(metrics[f"loss/{family}"]), family
    total = sum(float(metrics[f"loss/{name}_weighted"]) for name in names)
    np.testing.assert_allclose(total, metrics["loss"], rtol=1e-5)

    # after_update: one step taken, the state's layout kept; teachers and queues moved.
    assert int(new_state.step) == 1 and int(new_state.nonfinite_step) == -1
    after = jax.device_get(new_state)
    assert jax.tree.structure(after) == jax.tree.structure(before)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype

    def moved(a, b):
        return max(
            float(np.abs(np.asarray(x, np.float64) - y).max())
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        )

    assert moved(after.params, before.params) > 0
    if row.teacher:
        assert moved(after.ema_params, before.ema_params) > 0
    if row.method_state:
        assert moved(after.method_state, before.method_state) > 0


# ---------------------------------------------------------------------------------------------
# The contract's own checks, on a method made here (no model: the crops' means are its
# "embeddings")


def _toy_method(forward=None, objective=None) -> Method:
    def toy_forward(params, state, batch, rng, train=True):
        pixels = jnp.mean(batch["crops"][0], axis=(2, 3))  # (n, crops, 3)
        embeddings = params["w"] * jnp.swapaxes(pixels, 0, 1)  # (crops, n, 3)
        return Forward(embeddings=embeddings, features=pixels[:, 0], batch_stats={})

    def toy_objective(embeddings, state, batch, train=True):
        return Objective(terms={"gap": jnp.sum(jnp.square(embeddings[0] - embeddings[1]), -1)})

    return Method(
        init=lambda rng, images: {},
        forward=forward or toy_forward,
        objective=objective or toy_objective,
        model=None,
        name="toy",
        terms=common.as_loss_terms(("gap",)),
        weights_at=lambda step: {"gap": jnp.float32(2.0)},
    )


@flax.struct.dataclass
class _ToyState:
    """The fields of a train state that the step's composition reads."""

    step: jax.Array
    params: Any = None


def _toy_inputs():
    batch = {"crops": (jnp.arange(4 * 2 * 2 * 2 * 3, dtype=jnp.float32).reshape(4, 2, 2, 2, 3),)}
    return {"w": jnp.float32(0.5)}, _ToyState(step=jnp.int32(0)), batch


def test_the_step_weighs_the_objectives_terms():
    params, state, batch = _toy_inputs()
    value, out = methods.loss(_toy_method(), params, state, batch, None)
    gap = out.terms["gap"]
    assert gap.shape == (4,) and float(jnp.min(gap)) > 0
    np.testing.assert_allclose(out.per_example_loss, 2.0 * gap, rtol=1e-6)
    np.testing.assert_allclose(value, 2.0 * jnp.mean(gap), rtol=1e-6)
    assert {"loss/gap", "loss/gap_weighted", "loss_weight/gap"} <= set(out.metrics)
    assert out.features.shape == (4, 3) and out.embeddings is None and out.carry is None
    # Differentiable through forward and objective alike.
    grad = jax.grad(lambda p: methods.loss(_toy_method(), p, state, batch, None)[0])(params)
    np.testing.assert_allclose(grad["w"], 2.0 * value / params["w"], rtol=1e-5)


def test_a_method_that_breaks_the_contract_fails_with_a_clear_message():
    params, state, batch = _toy_inputs()
    with pytest.raises(TypeError, match="features"):
        Forward(embeddings=jnp.zeros((2, 4, 3)), batch_stats={})  # a required output left out
    with pytest.raises(TypeError, match="terms"):
        Objective(metrics={})

    def loss_of(**pieces):
        return methods.loss(_toy_method(**pieces), params, state, batch, None)

    def flat(params, state, batch, rng, train=True):  # embeddings (n, d), not (crops, n, d)
        return Forward(jnp.zeros((4, 3)), jnp.zeros((4, 3)), {})

    with pytest.raises(ValueError, match=r"'toy'.*Forward.embeddings.*\(crops, 4, \.\.\.\)"):
        loss_of(forward=flat)
    with pytest.raises(TypeError, match="must return jssl.methods.Forward"):
        loss_of(forward=lambda *args: (jnp.zeros((2, 4, 3)), {}))
    with pytest.raises(ValueError, match=r"terms are \['other'\].*are \['gap'\]"):
        loss_of(objective=lambda e, *args: Objective(terms={"other": jnp.zeros(4)}))
    with pytest.raises(ValueError, match=r"terms\['gap'\] has shape \(\).*\(4,\), per example"):
        loss_of(objective=lambda e, *args: Objective(terms={"gap": jnp.sum(e)}))
    unweighted = _toy_method()._replace(weights_at=None)
    with pytest.raises(ValueError, match="jssl.methods.get"):
        methods.loss(unweighted, params, state, batch, None)
