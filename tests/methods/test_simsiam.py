"""SimSiam: its loss on hand-computed cases (the stop-gradient branch gets no gradient), its
state in the real step (predictor subtree, its batch norm), presets, start-up checks (1 vs 4
devices: tests/training/test_parallel.py; the contract and a run end to end:
test_contract*.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import simsiam
from jssl import data, losses, methods, parallel
from jssl.engines import train
from jssl.training.step import make_train_step


def test_negative_cosine_hand_computed():
    # Example 0: p1 = [1, 0] vs z2 = [0, 2] (cos 0), p2 = [3, 3] vs z1 = [1, 1] (cos 1):
    # -(0 + 1) / 2. Example 1: p1 opposite z2 (cos -1), p2 at 60 degrees to z1 (cos 0.5).
    predictions = jnp.array([[[1.0, 0.0], [0.0, -5.0]], [[3.0, 3.0], [1.0, 0.0]]])
    targets = jnp.array([[[1.0, 1.0], [0.5, np.sqrt(3) / 2]], [[0.0, 2.0], [0.0, 2.0]]])
    value, metrics, per_example = losses.simsiam_loss(predictions, targets)
    np.testing.assert_allclose(per_example, [-0.5, 0.25], atol=1e-6)
    assert float(value) == pytest.approx(-0.125, abs=1e-6)
    assert float(metrics["cosine"]) == pytest.approx(0.125, abs=1e-6)


def test_output_std_detects_collapse():
    spread = jnp.eye(4)[None].repeat(2, axis=0)  # 4 orthogonal outputs
    collapsed = jnp.ones((2, 4, 4))
    _, m_spread, _ = losses.simsiam_loss(spread, spread)
    _, m_collapsed, _ = losses.simsiam_loss(collapsed, collapsed)
    # One-hot rows: each channel is 1 for a quarter of the rows, std sqrt(3) / 4.
    assert float(m_spread["output_std"]) == pytest.approx(np.sqrt(3) / 4, rel=1e-5)
    assert float(m_collapsed["output_std"]) == pytest.approx(0.0, abs=1e-6)


def test_gradient_flows_through_the_predictor_branch_only():
    # One shared weight makes both branches: p = w * x through the "predictor", z = w * y the
    # "projection". With the stop-gradient, d loss/dw only sees p's dependence on w.
    x = jnp.array([[[1.0, 0.0]], [[0.0, 1.0]]])  # views 1, 2
    y = jnp.array([[[1.0, 1.0]], [[1.0, -1.0]]])

    def apply(w, views):
        return jnp.einsum("ij,vnj->vni", w, views)

    def loss(w):
        return losses.simsiam_loss(apply(w, x), apply(w, y))[0]

    def frozen_target_loss(w, w_target):
        return losses.simsiam_loss(apply(w, x), apply(w_target, y))[0]

    def no_stop_gradient_loss(w):
        p, z = losses.l2_normalize(apply(w, x)), losses.l2_normalize(apply(w, y))
        return -jnp.mean(jnp.sum(p * z[::-1], -1))

    w = jnp.array([[1.0, 0.5], [-0.3, 2.0]])
    grad = jax.grad(loss)(w)
    np.testing.assert_allclose(grad, jax.grad(frozen_target_loss)(w, w), atol=1e-6)
    # Without the stop-gradient the target's dependence on w would add to it.
    assert float(no_stop_gradient_loss(w)) == pytest.approx(float(loss(w)), abs=1e-6)
    assert not np.allclose(grad, jax.grad(no_stop_gradient_loss)(w), atol=1e-3)
    grad_z = jax.grad(lambda z: losses.simsiam_loss(x, z)[0])(y)
    np.testing.assert_array_equal(grad_z, 0.0)


def test_state_in_the_real_step():
    config = simsiam.get_config("test")
    mesh = parallel.make_mesh()
    method = methods.get(config, 4)
    tx, schedule = train.make_optimizer(config, method, 4)
    state = train.init_state(config, method, tx, mesh)
    assert set(state.params) == {"trunk", "head", "predictor"}
    # The projector: BN on every hidden layer and an affine-free BN on its output.
    head = state.params["head"]
    assert {"bn0", "bn1"} <= set(head) and "bn2" not in head and "bn2" in state.batch_stats["head"]
    assert state.params["predictor"]["fc0"]["kernel"].shape == (16, 8)
    before = jax.tree.map(np.asarray, (state.params["predictor"], state.batch_stats["predictor"]))
    step = make_train_step(method, tx, schedule, mesh)
    batch = parallel.host_batch_to_global(data.synthetic_batch(config.data, 16), mesh)
    state, metrics = step(state, batch)
    assert -1.0 <= float(metrics["loss"]) <= 1.0 and float(metrics["output_std"]) > 0
    for old, new in zip(
        jax.tree.leaves(before),
        jax.tree.leaves((state.params["predictor"], state.batch_stats["predictor"])),
        strict=True,
    ):
        assert np.abs(np.asarray(new) - old).max() > 0  # predictor trained, its BN updated


def test_presets_follow_the_paper():
    config = simsiam.get_config()
    assert config.model.head_dims == (2048, 2048, 2048, 2048)
    assert config.model.head_bn and config.model.head_last_bn
    assert config.method.predictor_dims == (2048, 512, 2048)
    o = config.optim
    assert (o.name, o.base_lr, o.weight_decay, o.momentum) == ("sgd", 0.05, 1e-4, 0.9)
    assert config.data.batch_size == 512 and config.num_epochs == 100
    assert o.schedule == "cosine" and o.warmup_epochs == 0
    assert dict(config.loss.weights) == {"negative_cosine": 1.0}
    for preset in ("demo", "test"):
        methods.check_config(simsiam.get_config(preset))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("data.augment.num_crops", (2, 4), r"num_crops=\(2, 4\): SimSiam takes exactly two"),
        ("method.predictor_dims", (16, 8, 32), r"predictor_dims=\(16, 8, 32\).*head_dims\[-1\]"),
    ],
)
def test_bad_settings_name_the_field(field, value, message):
    config = simsiam.get_config("test")
    config.update_from_flattened_dict({field: value})
    with pytest.raises(ValueError, match=message):
        methods.check_config(config)
