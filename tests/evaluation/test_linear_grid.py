"""The grid of linear heads (evaluation.linear_grid): each point trains the head a run with
its (lr, weight decay) alone trains, and the SGD a numpy reference computes; the choice on
held-out scores; ImageNet-A/-R's logit restriction (evaluation.robustness_sets)."""

import sys

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
from support.devices import run_on_devices

from configs import linear_eval as linear_eval_config
from jssl import parallel
from jssl.evaluation import linear, linear_grid, robustness_sets

LAYER, DIMS, CLASSES, BATCH, STEPS = "x", 6, 3, 32, 3


def _config(lrs, wds):
    config = linear_eval_config.get_config("test")  # SGD, Nesterov 0.9, VISSL's masks
    config.linear.layers = (LAYER,)
    config.linear.num_classes = CLASSES
    config.linear.lrs, config.linear.weight_decays = lrs, wds
    config.linear.val_fraction = 0.1
    config.data.batch_size = BATCH
    return config


def _train(config, batches):
    """``STEPS`` grid steps on ``batches`` (features as inputs); the final state."""
    heads = linear.LinearHeads((LAYER,), CLASSES, bn_axis_name=parallel.DATA_AXIS)
    shapes = {LAYER: (DIMS,)}
    params = jax.eval_shape(
        lambda: heads.init(jax.random.PRNGKey(0), linear.sample_features(shapes), train=False)
    )
    grid = linear_grid.Grid.from_config(config)
    grid_opt = linear_grid.GridOptimizer(config, grid, params["params"], steps_per_epoch=10)
    state = linear.init_state(heads, grid_opt, shapes, jax.random.PRNGKey(3))
    mesh = parallel.make_mesh()
    step = linear.make_train_step(heads, grid_opt, mesh, lambda trunk, x: x)
    for batch in batches:
        state, _ = step(state, {}, parallel.host_batch_to_global(batch, mesh))
    return grid, jax.device_get(state)


def _numpy_sgd(params, batches, lr, wd):
    """VISSL's head (BatchNorm in train mode, Linear) and PyTorch's SGD (Nesterov, momentum
    0.9, weight decay added to the gradient of the Linear's weight and bias only), float64."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    trace = {k: np.zeros_like(v) for k, v in p.items()}
    rate = lr * BATCH / 256  # linear scaling from optim.base_lr_batch_size
    for batch in batches:
        x, labels = np.asarray(batch["inputs"][LAYER], np.float64), batch["label"]
        xhat = (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5)
        y = xhat * p["scale"] + p["bn_bias"]
        z = y @ p["kernel"] + p["bias"]
        prob = np.exp(z - z.max(1, keepdims=True))
        prob /= prob.sum(1, keepdims=True)
        dz = (prob - np.eye(CLASSES)[labels]) / len(labels)
        dy = dz @ p["kernel"].T
        grads = {"kernel": y.T @ dz, "bias": dz.sum(0), "scale": (dy * xhat).sum(0)}
        grads["bn_bias"] = dy.sum(0)
        for name, g in grads.items():
            d = g + (wd * p[name] if name in ("kernel", "bias") else 0.0)
            trace[name] = d + 0.9 * trace[name]
            p[name] = p[name] - rate * (d + 0.9 * trace[name])
    return p


def _point_params(state, grid, point):
    head = jax.tree.map(lambda v: v[point.lr_index], state.params[grid.groups[point.wd_index]])
    head = head[LAYER]
    return {
        "scale": head["bn"]["scale"],
        "bn_bias": head["bn"]["bias"],
        "kernel": head["fc"]["kernel"],
        "bias": head["fc"]["bias"],
    }


def _batches():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(CLASSES, DIMS)) * 2.0
    batches = []
    for _ in range(STEPS):
        labels = rng.integers(0, CLASSES, BATCH).astype(np.int32)
        x = (centres[labels] + rng.normal(size=(BATCH, DIMS))).astype(np.float32)
        batches.append({"inputs": {LAYER: x}, "label": labels})
    return batches


def _grid_heads() -> dict[str, np.ndarray]:
    """Every point's trained parameters, by point tag and parameter name."""
    grid, state = _train(_config((0.05, 0.8), (0.0, 0.05)), _batches())
    return {
        f"{p.tag}/{name}": np.asarray(value)
        for p in grid.points
        for name, value in _point_params(state, grid, p).items()
    }


def test_each_grid_point_trains_its_head_as_alone_and_as_numpy_sgd():
    batches = _batches()
    grid, state = _train(_config((0.05, 0.8), (0.0, 0.05)), batches)
    assert grid.size == 4 and state.params["wd1"][LAYER]["fc"]["kernel"].shape == (2, DIMS, 3)
    one, fresh = _train(_config((0.05,), (0.0,)), [])  # every point starts from these
    initial = _point_params(fresh, one, one.points[0])
    for point in grid.points:
        want = _numpy_sgd(initial, batches, point.lr, point.weight_decay)
        got = _point_params(state, grid, point)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=2e-4, atol=2e-6, err_msg=name)
    # Two points run alone for as many steps: the grid's heads are theirs.
    for point in (grid.points[1], grid.points[2]):
        one, alone = _train(_config((point.lr,), (point.weight_decay,)), batches)
        for name, value in _point_params(alone, one, one.points[0]).items():
            np.testing.assert_allclose(
                _point_params(state, grid, point)[name], value, rtol=1e-5, atol=1e-7
            )
    # The points differ: a lost learning rate or weight decay would make some equal.
    kernels = [_point_params(state, grid, p)["kernel"] for p in grid.points]
    assert min(np.abs(a - b).max() for i, a in enumerate(kernels) for b in kernels[i + 1 :]) > 1e-4


def test_selection_takes_the_best_finite_held_out_point_first_of_ties():
    grid = linear_grid.Grid((0.1, 0.01, 0.001), (0.0, 1e-4))
    rng = np.random.default_rng(1)
    for trial in range(20):
        top1 = rng.integers(0, 4, grid.size).astype(float) * 10  # many ties
        finite = rng.random(grid.size) > 0.3
        finite[rng.integers(grid.size)] = True
        held_out = {"a": [{"top1": v, "top5": 100.0} for v in top1]}
        chosen = linear_grid.select(grid, held_out, {"a": list(finite)})["a"]
        masked = np.where(finite, top1, -np.inf)
        assert chosen.index == int(np.argmax(masked)), trial  # argmax: the first maximum
        assert (chosen.lr, chosen.weight_decay) == (
            grid.lrs[chosen.index // 2],
            grid.weight_decays[chosen.index % 2],
        )
    with pytest.raises(FloatingPointError, match=r"'a' has non-finite .* linear.lrs"):
        linear_grid.select(grid, held_out, {"a": [False] * grid.size})


def test_restricted_logits_score_only_the_sets_classes():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 40, 30)).astype(np.float32)  # (grid points, rows, classes)
    classes = tuple(sorted(rng.choice(30, 8, replace=False).tolist()))
    labels = rng.choice(classes, 40).astype(np.int32)
    labels[:3] = [c for c in range(30) if c not in classes][:3]  # never found
    got = jax.device_get(linear.topk_correct(logits, labels, (1, 5), classes))
    order = np.argsort(-logits[..., list(classes)], axis=-1)
    ranked = np.asarray(classes)[order]
    for k in (1, 5):
        want = (ranked[..., :k] == labels[:, None]).any(-1)
        np.testing.assert_array_equal(got[f"top{k}"], want)
    assert not got["top5"][:, :3].any()
    unrestricted = jax.device_get(linear.topk_correct(logits, labels, (1,)))["top1"]
    np.testing.assert_array_equal(unrestricted, logits.argmax(-1) == labels)


@pytest.mark.parametrize("name", ["imagenet_a", "imagenet_r"])
def test_imagenet_a_and_r_classes_are_located_among_the_tfds_label_names(name, tmp_path):
    names = tfds.builder(name, data_dir=str(tmp_path)).info.features["label"].names
    assert (
        names == tfds.builder("imagenet2012", data_dir=str(tmp_path)).info.features["label"].names
    )  # the sets share ImageNet's labels
    classes = robustness_sets.class_subset(f"{name}:0.1.0", names)
    assert len(classes) == len(set(classes)) == 200 and list(classes) == sorted(classes)
    assert [names[i] for i in classes] == sorted(robustness_sets.RESTRICTED[name])
    # The datasets' first classes: ImageNet-A's stingray (6), ImageNet-R's goldfish (1).
    assert classes[0] == {"imagenet_a": 6, "imagenet_r": 1}[name]
    assert robustness_sets.class_subset("imagenet_v2/matched-frequency", names) is None
    with pytest.raises(ValueError, match="lack 200 of its classes"):
        robustness_sets.class_subset(name, [f"class{i}" for i in range(1000)])


def test_extra_set_specs_parse_or_name_the_field():
    assert robustness_sets.parse("imagenet_v2/matched-frequency:test") == (
        "imagenet_v2/matched-frequency",
        "test",
    )
    assert robustness_sets.parse("imagenet_a:0.1.0:test[:10]") == ("imagenet_a:0.1.0", "test[:10]")
    for bad in ("imagenet_a", ":test", "imagenet_a:", 3):
        with pytest.raises(ValueError, match="linear.extra_test_sets entry"):
            robustness_sets.parse(bad)


@pytest.mark.slow
def test_grid_heads_on_four_devices_are_those_on_one(tmp_path):
    """Sync BN and the gradient mean over 4 devices (each a quarter of every batch), vmapped
    over the grid, train the heads one device trains."""
    four = run_on_devices(__file__, tmp_path / "four.npz", timeout=300)
    assert int(four.pop("num_devices")) == 4
    one = _grid_heads()
    assert set(four) == set(one)
    for name, value in one.items():
        np.testing.assert_allclose(four[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


if __name__ == "__main__":
    np.savez(sys.argv[1], num_devices=jax.device_count(), **_grid_heads())
