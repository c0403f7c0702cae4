"""Every registered method against the contract of jssl/methods/__init__.py, one row each.

On a tiny batch of the method's "test" preset (and DINO's and MoCo v3's ViT variants): init,
the forward's outputs (types, shapes, finite), the objective on the forward's embeddings, on
perturbed ones and on ones made by hand (a function of embeddings alone, differentiable in
them), the loss through the real train step (the same value, every term logged weighted and
unweighted), and ``after_update`` (the state keeps its layout). Then each method's run end to
end with a test phase, whose written outputs each row bounds. The contract's own checks (a
missing output, a term of the wrong shape) are tested on a method made here.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.launch import scalar_values

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
    run: its end-to-end run's expectations, or where else its run is tested.
    """

    method_state: tuple[str, ...] = ()
    teacher: bool = False
    run: Any = None


class Run(NamedTuple):
    """A run end to end (8 steps, a test phase on test[:40] after epoch 2).

    overrides: config fields set for the run. loss_range: (low, high) bounds of every
    per-example test loss, exclusive where ``strict``; None: a positive mean. loss_term: the
    written term equal to the per-example loss (one term at weight 1). check: ``(config,
    summary, outputs dir, workdir)`` for what only this method has.
    """

    overrides: dict[str, Any] = {}
    loss_range: tuple[float, float] | None = None
    strict: bool = True
    loss_term: str | None = None
    check: Any = None


def _simclr_run(config, summary, outputs, workdir):
    for leaf in np.asarray(summary["state"].params["head"]["fc1"]["kernel"]).ravel()[:5]:
        assert np.isfinite(leaf)


def _barlow_twins_run(config, summary, outputs, workdir):
    assert "bias" not in summary["state"].params["head"]["fc1"]  # VISSL's use_bias False
    for term in ("invariance", "redundancy_reduction"):
        assert np.all(np.isfinite(np.load(outputs / f"term_{term}.npy")))


def _vicreg_run(config, summary, outputs, workdir):
    # The test phase feeds the same centre crop as both views: no invariance cost.
    np.testing.assert_allclose(np.load(outputs / "term_invariance.npy"), 0.0, atol=1e-6)


def _swav_run(config, summary, outputs, workdir):
    per_example = np.load(outputs / "per_example_loss.npy")
    embeddings = np.load(outputs / "embeddings.npy")
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-4)
    # Each assignment crop's term per example, and their mean (the loss at default weights).
    crop0, crop1 = (np.load(outputs / f"term_swapped_prediction_crop{a}.npy") for a in (0, 1))
    np.testing.assert_allclose(0.5 * crop0 + 0.5 * crop1, per_example, rtol=1e-6)
    np.testing.assert_allclose(
        np.load(outputs / "term_swapped_prediction.npy"), per_example, rtol=1e-6
    )
    # The test phase feeds the centre crop as every crop: both crops' targets are the same.
    np.testing.assert_allclose(crop0, crop1, rtol=1e-4)
    logdir = workdir / "tensorboard"
    for tag in (
        "loss/swapped_prediction_crop0",
        "loss/swapped_prediction_crop1_weighted",
        "loss_weight/swapped_prediction_crop1",
        "loss/swapped_prediction",
        "test/loss/swapped_prediction_crop0",
    ):
        assert scalar_values(logdir, tag), tag
    assert set(scalar_values(logdir, "loss_weight/swapped_prediction_crop0").values()) == {0.5}


def _dino_run(config, summary, outputs, workdir):
    assert np.load(outputs / "features.npy").shape[0] == 40


ROWS = {
    # Its run with a test phase: tests/training/test_train.py (test_phase_writes_validation_loss).
    "moco": Row(method_state=("queue", "queue_ptr"), teacher=True),
    "simclr": Row(
        run=Run(
            # Multi-crop: 2 crops at 16 px and 2 at 8 px (VISSL multicrop_simclr_info_nce_loss).
            overrides={
                "data.augment.num_crops": (2, 2),
                "data.augment.crop_sizes": (16, 8),
                "data.augment.crop_scale": ((0.2, 1.0), (0.05, 0.2)),
            },
            check=_simclr_run,
        )
    ),
    # Identical centre-crop views in the test phase: 2 - 2 cos per direction, in [0, 8].
    "byol": Row(teacher=True, run=Run(loss_range=(0, 8), strict=False, loss_term="regression")),
    # 2T * two cross-entropies over the 16 keys of a test batch, each at most about
    # 2 / T + log 16 for unit vectors.
    "mocov3": Row(
        teacher=True,
        run=Run(loss_range=(0, 2 * 0.2 * 2 * (2 / 0.2 + np.log(16))), loss_term="info_nce"),
    ),
    "simsiam": Row(run=Run(loss_range=(-1, 1), strict=False, loss_term="negative_cosine")),
    "barlow_twins": Row(run=Run(check=_barlow_twins_run)),
    "vicreg": Row(run=Run(check=_vicreg_run)),
    "swav": Row(
        method_state=("queue", "queue_filled", "queue_ptr"),
        run=Run(overrides={"log_every_steps": 4}, check=_swav_run),
    ),
    "dino": Row(
        method_state=("center",), teacher=True, run=Run(loss_term="cross_entropy", check=_dino_run)
    ),
    # Its run with a test phase: the ``pretrained`` fixture of tests/methods/test_supervised.py.
    "supervised": Row(),
}

# The contract's cases: every method's "test" preset, and the ViT variants.
CASES = {name: (name, {}) for name in methods.METHODS}
CASES["dino_vit"] = ("dino", {"preset": "test_vit"})
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


@pytest.mark.parametrize("case", list(CASES))
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


RUNS = [name for name in methods.METHODS if ROWS[name].run is not None]


@pytest.mark.parametrize("name", RUNS)
def test_trains_end_to_end(name, tmp_path, shared_dirs):
    row, expect = ROWS[name], ROWS[name].run
    config = _config(name)
    config.update_from_flattened_dict(expect.overrides)
    config.data.data_dir = shared_dirs[0]
    config.checkpoint.async_save = False
    config.test_every_epochs = 2
    config.data.test_split = "test[:40]"
    summary = train.run(config, str(tmp_path))
    assert summary["step"] == 8
    state = summary["state"]
    if not row.teacher:
        assert state.ema_params == {}
    if not row.method_state:
        assert state.method_state == {}
    outputs = tmp_path / "eval" / "epoch_2"
    np.testing.assert_array_equal(np.load(outputs / "inds.npy"), np.arange(40))
    losses = np.load(outputs / "per_example_loss.npy")
    assert losses.shape == (40,) and np.all(np.isfinite(losses))
    if expect.loss_range is None:
        assert losses.mean() > 0
    elif expect.strict:
        assert np.all((losses > expect.loss_range[0]) & (losses < expect.loss_range[1]))
    else:
        assert np.all((losses >= expect.loss_range[0]) & (losses <= expect.loss_range[1]))
    specs = methods.loss_terms(config)
    for term in {t.name for t in specs} | {t.family for t in specs}:
        written = np.load(outputs / f"term_{term}.npy")
        assert written.shape == (40,) and np.all(np.isfinite(written)), term
    if expect.loss_term is not None:
        written = np.load(outputs / f"term_{expect.loss_term}.npy")
        np.testing.assert_allclose(written, losses, rtol=1e-6)
    if expect.check is not None:
        expect.check(config, summary, outputs, tmp_path)


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


def _toy_inputs():
    batch = {"crops": (jnp.arange(4 * 2 * 2 * 2 * 3, dtype=jnp.float32).reshape(4, 2, 2, 2, 3),)}
    return {"w": jnp.float32(0.5)}, SimpleNamespace(step=jnp.int32(0)), batch


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
