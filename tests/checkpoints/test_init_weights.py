"""Tests of ``jssl.checkpoints.warm_start.init_train_state`` (training from ``init.checkpoint``)
and of the evaluation loaders' fallback past a corrupt newest checkpoint.

States are built from the shapes of the "test" preset of configs/moco.py with random values
(no compiled init: seconds, not tens of seconds, on 2 CPU cores) and saved with orbax in
the layout of ``jssl.checkpoints.manager.save``: ``workdir/checkpoints/<step>/{state,data}``.
"""

import errno
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import moco
from jssl import methods, optim, parallel
from jssl.checkpoints import warm_start, weights
from jssl.training import state as train_state

STEPS = (2, 4)


def make_config(**model):
    config = moco.get_config("test")
    config.model.update(model)
    return config


def make_state(config, seed: int, optimizer: str = "sgd") -> train_state.TrainState:
    """A TrainState of ``config``'s method with random values, replicated over the mesh."""
    method = methods.get(config)
    size = config.data.image_size
    shapes = jax.eval_shape(method.init, jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3)))
    rng = np.random.default_rng(seed)
    sharding = parallel.replicated(parallel.make_mesh())

    def fill(s):
        if jnp.issubdtype(s.dtype, jnp.floating):
            return jax.device_put(rng.standard_normal(s.shape).astype(s.dtype), sharding)
        return jax.device_put(np.zeros(s.shape, s.dtype), sharding)

    fields = jax.tree.map(fill, shapes)
    config.optim.name = optimizer
    tx = optim.build_optimizer(config.optim, fields["params"], lambda step: 0.1)
    return train_state.create(**fields, tx=tx, rng=jax.random.PRNGKey(seed)), tx


def save_workdir(workdir, states: dict) -> str:
    """Saves ``{step: state}`` as jssl.checkpoints.manager.save does; returns the workdir."""
    manager = ocp.CheckpointManager(
        os.path.join(workdir, "checkpoints"),
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
        item_names=("state", "data"),
    )
    for step, state in states.items():
        state = state.replace(step=jnp.asarray(step, jnp.int32))
        manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave({"epoch": 0, "step_in_epoch": step}),
            ),
        )
    manager.wait_until_finished()
    manager.close()
    return str(workdir)


def make_sources(tmp_path_factory):
    """A workdir with checkpoints at STEPS (different random values each) and their states."""
    config = make_config()
    states = {step: make_state(config, seed=step)[0] for step in STEPS}
    return save_workdir(tmp_path_factory.mktemp("source"), states), states


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return make_sources(tmp_path_factory)


@pytest.fixture
def workdir(tmp_path, sources):
    copy = tmp_path / "source"
    shutil.copytree(sources[0], copy)
    return copy


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _assert_equal(actual, expected):
    jax.tree.map(np.testing.assert_array_equal, _host(actual), _host(expected))


def _messages(caplog, level=logging.INFO) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= level)


def _truncate(step_dir) -> None:
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
        for name in files:
            with open(os.path.join(root, name), "r+b") as f:
                f.truncate(0)


@pytest.mark.parametrize("layout", ["workdir", "checkpoints", "step"])
def test_init_from_a_jssl_checkpoint(sources, layout, caplog):
    caplog.set_level(logging.INFO)
    workdir, saved = sources
    path = {
        "workdir": workdir,
        "checkpoints": os.path.join(workdir, "checkpoints"),
        "step": os.path.join(workdir, "checkpoints", "2"),
    }[layout]
    step = 2 if layout == "step" else 4  # a workdir gives its newest checkpoint
    config = make_config()
    config.init.checkpoint = path
    fresh, tx = make_state(config, seed=7)
    state = warm_start.init_train_state(config, fresh)

    _assert_equal(state.params, saved[step].params)
    _assert_equal(state.batch_stats, saved[step].batch_stats)
    # The momentum encoder gets the online weights (not the saved momentum encoder), in
    # buffers of its own, so a donated state never aliases.
    _assert_equal(state.ema_params, saved[step].params)
    _assert_equal(state.ema_batch_stats, saved[step].batch_stats)
    for online, ema in zip(
        jax.tree.leaves(state.params), jax.tree.leaves(state.ema_params), strict=True
    ):
        assert online.unsafe_buffer_pointer() != ema.unsafe_buffer_pointer()
    # Everything else stays fresh; the optimizer state still fits the parameters.
    _assert_equal(state.method_state, fresh.method_state)
    _assert_equal(state.opt_state, tx.init(state.params))
    assert int(state.step) == 0
    for new, old in zip(jax.tree.leaves(state.params), jax.tree.leaves(fresh.params), strict=True):
        assert new.sharding == old.sharding and new.dtype == old.dtype
    log = _messages(caplog)
    assert "params: loaded 66 of 66 arrays" in log, log
    assert f"checkpoints/{step}/state" in log and "momentum encoder" in log


@pytest.mark.parametrize("optimizer", ["lars", "adamw"])
def test_optimizer_state_does_not_depend_on_loaded_values(sources, optimizer):
    """init_train_state keeps opt_state; that is right only while tx.init ignores values."""
    config = make_config()
    config.init.checkpoint = sources[0]
    fresh, tx = make_state(config, seed=7, optimizer=optimizer)
    state = warm_start.init_train_state(config, fresh)
    _assert_equal(state.opt_state, tx.init(state.params))


def test_init_without_a_momentum_encoder(sources):
    config = make_config()
    config.init.checkpoint = sources[0]
    fresh = make_state(config, seed=7)[0].replace(ema_params={}, ema_batch_stats={})
    state = warm_start.init_train_state(config, fresh)
    assert state.ema_params == {} and state.ema_batch_stats == {}
    _assert_equal(state.params, sources[1][4].params)


def test_head_of_another_shape_keeps_its_fresh_init(sources, caplog):
    caplog.set_level(logging.INFO)
    config = make_config(head_dims=(64, 32, 8))  # the checkpoint's embedding is 16-d
    config.method.queue_size = 64
    config.init.checkpoint = sources[0]
    fresh = make_state(config, seed=7)[0]
    state = warm_start.init_train_state(config, fresh)
    saved = sources[1][4]
    _assert_equal(state.params["trunk"], saved.params["trunk"])
    _assert_equal(state.params["head"]["fc0"], saved.params["head"]["fc0"])  # same shape
    _assert_equal(state.params["head"]["fc1"], fresh.params["head"]["fc1"])
    _assert_equal(state.batch_stats["head"]["bn1"], fresh.batch_stats["head"]["bn1"])
    _assert_equal(state.ema_params["head"]["fc1"], fresh.ema_params["head"]["fc1"])
    warnings = _messages(caplog, logging.WARNING)
    assert "4 arrays keep their fresh (random) init" in warnings, warnings
    assert "params/head/fc1/kernel: checkpoint (32, 16), model (32, 8)" in warnings


def test_skip_keeps_named_parts_fresh(sources, caplog):
    caplog.set_level(logging.INFO)
    config = make_config()
    config.init.checkpoint = sources[0]
    config.init.skip = ("head", "trunk/layer4_1")
    fresh = make_state(config, seed=7)[0]
    state = warm_start.init_train_state(config, fresh)
    saved = sources[1][4]
    for name in ("params", "batch_stats", "ema_params"):
        _assert_equal(getattr(state, name)["head"], getattr(fresh, name)["head"])
        _assert_equal(
            getattr(state, name)["trunk"]["layer4_1"], getattr(fresh, name)["trunk"]["layer4_1"]
        )
    _assert_equal(state.params["trunk"]["layer4_0"], saved.params["trunk"]["layer4_0"])
    log = _messages(caplog)
    assert "20 arrays keep their fresh init (init.skip=('head', 'trunk/layer4_1'))" in log, log
    assert not _messages(caplog, logging.WARNING)  # nothing kept for a mismatch

    config.init.skip = ("heads",)
    with pytest.raises(weights.WeightsError, match=r"'heads' names no parameter.*'head'"):
        warm_start.init_train_state(config, fresh)


def test_init_from_a_torchvision_file(tmp_path, caplog):
    torch = pytest.importorskip("torch")
    from support.torch_resnet import TorchResNet

    caplog.set_level(logging.INFO)
    torch.manual_seed(0)
    model = TorchResNet(18, 0.125)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.normal_()
    path = tmp_path / "resnet18.pth"
    torch.save(model.state_dict(), path)
    config = make_config(cifar_stem=False)  # torchvision's 7x7 stem
    config.init.checkpoint = str(path)
    fresh = make_state(config, seed=7)[0]
    state = warm_start.init_train_state(config, fresh)

    torch_state = model.state_dict()
    trunk = _host(state.params["trunk"])
    np.testing.assert_array_equal(
        trunk["conv1"]["kernel"], torch_state["conv1.weight"].numpy().transpose(2, 3, 1, 0)
    )
    np.testing.assert_array_equal(
        _host(state.batch_stats["trunk"]["layer2_0"]["downsample_bn"]["mean"]),
        torch_state["layer2.0.downsample.1.running_mean"].numpy(),
    )
    _assert_equal(state.ema_params["trunk"], state.params["trunk"])
    _assert_equal(state.params["head"], fresh.params["head"])  # the file has no head
    assert "keep their fresh (random) init" in _messages(caplog, logging.WARNING)

    config.model.width_multiplier = 0.25
    config.model.head_dims = (128, 32, 16)
    with pytest.raises(weights.WeightsError, match=r"(?s)resnet18.pth.*conv1\.weight.*0\.125"):
        warm_start.init_train_state(config, make_state(config, seed=7)[0])


def _garbage(kind: str, tmp_path, workdir) -> str:
    step_dir = os.path.join(workdir, "checkpoints", "4")
    if kind == "missing":
        return str(tmp_path / "nowhere")
    if kind == "empty_dir":
        (tmp_path / "empty").mkdir()
        return str(tmp_path / "empty")
    if kind == "random_files":
        (tmp_path / "junk").mkdir()
        for name in ("a.bin", "state.json", "7"):
            (tmp_path / "junk" / name).write_bytes(os.urandom(64))
        return str(tmp_path / "junk")
    if kind == "plain_file":
        (tmp_path / "weights.npz").write_bytes(os.urandom(64))
        return str(tmp_path / "weights.npz")
    if kind == "step_without_state":
        shutil.rmtree(os.path.join(step_dir, "state"))
    elif kind == "step_with_empty_state":
        shutil.rmtree(os.path.join(step_dir, "state"))
        os.mkdir(os.path.join(step_dir, "state"))
    elif kind == "step_truncated":
        _truncate(step_dir)
    elif kind == "step_random_state":
        shutil.rmtree(os.path.join(step_dir, "state"))
        os.mkdir(os.path.join(step_dir, "state"))
        for name in ("_METADATA", "manifest.ocdbt"):
            with open(os.path.join(step_dir, "state", name), "wb") as f:
                f.write(os.urandom(64))
    return step_dir


GARBAGE = {
    "missing": r"does not exist\. Pass the workdir of a jssl training run",
    "empty_dir": r"No checkpoint found in .*\(it holds: nothing\)\. Pass the workdir",
    "random_files": r"No checkpoint found in .*\(it holds: 7, a\.bin, state\.json\)",
    "plain_file": r"is a file, not a PyTorch checkpoint\. Pass the workdir",
    "step_without_state": r"has no state/ subdirectory.*Pass the workdir",
    "step_with_empty_state": r"incomplete or corrupt \(FileNotFoundError.*Pass the workdir",
    "step_truncated": r"incomplete or corrupt \(JSONDecodeError.*Pass the workdir",
    "step_random_state": r"incomplete or corrupt .*Pass the workdir",
}


@pytest.mark.parametrize("kind", GARBAGE)
def test_garbage_init_checkpoint_is_a_clear_error(kind, tmp_path, workdir):
    config = make_config()
    config.init.checkpoint = _garbage(kind, tmp_path, workdir)
    with pytest.raises(weights.WeightsError, match=GARBAGE[kind]):
        warm_start.init_train_state(config, make_state(config, seed=7)[0])


class _NotATensor:
    """A pickled object of this class stands for arbitrary code in a downloaded file."""


def test_pickled_objects_are_refused_not_unpickled(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "objects.pth"
    torch.save({"model": _NotATensor()}, path)
    config = make_config(cifar_stem=False)
    config.init.checkpoint = str(path)
    with pytest.raises(weights.WeightsError, match=r"holds pickled objects other than tensors"):
        warm_start.init_train_state(config, make_state(config, seed=7)[0])


def test_garbage_torch_file_is_a_clear_error(tmp_path):
    pytest.importorskip("torch")
    config = make_config(cifar_stem=False)
    garbage = np.random.default_rng(0).bytes(300)
    cases = (
        ("empty.pth", b""),
        ("random.torch", garbage),
        # Past the format check into the unpickler: random opcodes fail there in many ways.
        *((f"pickle_like{i}.pth", b"\x80\x02" + garbage[i * 30 :]) for i in range(8)),
    )
    for name, content in cases:
        config.init.checkpoint = str(tmp_path / name)
        (tmp_path / name).write_bytes(content)
        with pytest.raises(weights.WeightsError, match=r"could not be read as a PyTorch"):
            warm_start.init_train_state(config, make_state(config, seed=7)[0])


def test_eval_falls_back_past_a_truncated_newest_checkpoint(workdir, sources, caplog):
    caplog.set_level(logging.INFO)
    step_dir = os.path.join(workdir, "checkpoints", "4")
    _truncate(step_dir)
    before = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
    config = make_config()
    variables = weights.load_variables(str(workdir), config)
    _assert_equal(variables["params"], sources[1][2].params)
    _assert_equal(variables["batch_stats"], sources[1][2].batch_stats)
    errors = _messages(caplog, logging.ERROR)
    assert f"Skipping the checkpoint {step_dir}: it is incomplete or corrupt" in errors, errors
    # Evaluation leaves a training workdir as it found it.
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == before
    # Named explicitly, a corrupt step is an error, not silently another step.
    with pytest.raises(weights.WeightsError, match=r"checkpoints/4/state is incomplete"):
        weights.load_variables(step_dir, config)
    _truncate(os.path.join(workdir, "checkpoints", "2"))
    with pytest.raises(weights.WeightsError, match=r"(?s)Every checkpoint at .*/4: .*/2: "):
        weights.load_variables(str(workdir), config)


def test_a_read_error_is_not_taken_for_corruption(sources, monkeypatch):
    """An I/O error says nothing about the files: no fallback to an older checkpoint."""

    def failing_restore(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(weights, "_restore", failing_restore)
    with pytest.raises(OSError, match="Input/output error"):
        weights.load_variables(sources[0], make_config())


def test_head_without_batch_norm_ignores_the_saved_ones(sources, caplog):
    caplog.set_level(logging.INFO)
    config = make_config(head_bn=False, head_last_bn=False)
    config.init.checkpoint = sources[0]
    fresh = make_state(config, seed=7)[0]
    state = warm_start.init_train_state(config, fresh)
    saved = sources[1][4]
    _assert_equal(state.params["head"]["fc1"]["kernel"], saved.params["head"]["fc1"]["kernel"])
    warnings = _messages(caplog, logging.WARNING)
    assert "6 arrays of" in warnings and "not in the configured model" in warnings, warnings
    assert "params/head/bn0/scale" in warnings
