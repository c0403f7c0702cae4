"""Export of trunks to PyTorch (jssl.models.torch_export and the export engine): importing an
export gives back the same arrays exactly; PyTorch's forward on the exported tensors equals
jssl's; the engine end to end on a saved workdir, and its errors.

Source workdirs are a saved state of the "test" preset of configs/moco.py with random values
(shapes from ``jax.eval_shape``, no compiled init) and its config.json, so the engine reads
them as it reads a training run's."""

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util
from safetensors.numpy import load_file, save_file

from configs import export as export_config
from configs import moco
from jssl import engines, models
from jssl.checkpoints import source_model, weights
from jssl.models import torch_export, torch_import, vit_import

STEP = 3
VIT = {"trunk": "vit_tiny", "vit_depth": 2, "patch_size": 8, "image_size": 16}


def _random(shapes, seed: int):
    """Values for a tree of shapes that keep activations O(1): kernels scaled by their fan-in,
    norm scales and running variances near 1, small biases and means."""
    rng = np.random.default_rng(seed)

    def fill(path, shape):
        name = path[-1]
        if name == "kernel":
            return rng.normal(0, 1 / np.sqrt(np.prod(shape[:-1])), shape)
        if name in ("scale", "var"):
            return rng.uniform(0.5, 1.5, shape)
        return rng.normal(0, 0.1 if name in ("bias", "mean") else 0.5, shape)

    flat = traverse_util.flatten_dict(shapes)
    return traverse_util.unflatten_dict(
        {k: fill(k, v.shape).astype(np.float32) for k, v in flat.items()}
    )


def _trunk_variables(model_config, size: int, seed: int = 0) -> dict:
    trunk = models.build_trunk(model_config)
    shapes = jax.eval_shape(
        lambda: trunk.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False)
    )
    return {name: _random(tree, seed + i) for i, (name, tree) in enumerate(shapes.items())}


def _model(**fields):
    config = export_config.get_config("test")
    config.model.update(fields)
    config.model.head_dims = ()
    return config.model


def _assert_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, actual, expected)


@pytest.mark.parametrize(
    "fields",
    [{}, {"trunk": "resnet50", "cifar_stem": False}],
    ids=["resnet18_cifar_stem", "resnet50"],
)
def test_resnet_round_trip_is_exact(tmp_path, fields):
    """The :test preset's trunk (basic blocks, CIFAR stem) and a ResNet-50 (bottlenecks, the
    7x7 stem): export -> safetensors -> import gives the same params and batch stats."""
    model_config = _model(**fields)
    variables = _trunk_variables(model_config, 32)
    state = torch_export.trunk_state_dict(model_config, variables, num_batches_tracked=7)
    assert state["layer1.0.conv1.weight"].shape[1:] == (
        variables["params"]["layer1_0"]["conv1"]["kernel"].shape[2],
        *variables["params"]["layer1_0"]["conv1"]["kernel"].shape[:2],
    )  # OIHW
    assert state["bn1.num_batches_tracked"].dtype == np.int64
    path = str(tmp_path / "trunk.safetensors")
    save_file(state, path)
    imported = torch_import.import_torch_resnet(path, model_config)
    _assert_equal({k: v["trunk"] for k, v in imported.items()}, variables)


def test_vit_round_trip_is_exact(tmp_path):
    model_config = _model(**VIT)
    variables = _trunk_variables(model_config, 16)
    state = torch_export.trunk_state_dict(model_config, variables)
    assert state["blocks.1.mlp.fc1.weight"].shape == (768, 192)  # Linear (out, in)
    assert state["patch_embed.proj.weight"].shape == (192, 3, 8, 8)
    path = str(tmp_path / "trunk.safetensors")
    save_file(state, path)
    imported = vit_import.import_torch_vit(path, model_config)
    _assert_equal(imported["params"]["trunk"], variables["params"])


def _save_workdir(workdir, config, seed: int = 0) -> dict:
    """A jssl workdir holding ``checkpoints/<STEP>/state`` with the online model's random
    params and batch stats (what the weight reader restores), and its config.json; returns
    the trunk's arrays per collection."""
    shapes = weights.abstract_variables(config)
    state = {name: _random(tree, seed + i) for i, (name, tree) in enumerate(shapes.items())}
    state["step"] = np.asarray(STEP, np.int32)
    with ocp.CheckpointManager(
        os.path.join(workdir, "checkpoints"),
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
        item_names=("state", "data"),
    ) as manager:
        manager.save(
            STEP,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({"epoch": 0})
            ),
        )
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))
    return {name: tree.get("trunk", {}) for name, tree in state.items() if name != "step"}


def _source_config(kind: str):
    config = moco.get_config("test")
    if kind == "vit":
        config.model.update(VIT)
        config.model.head_dims = (192, 32, 16)
    else:
        config.model.width_multiplier = 0.25  # the export preset's is 0.125: adopted
        config.model.head_dims = (128, 32, 16)
    return config


@pytest.fixture(scope="module", params=["resnet", "vit"])
def exported(request, tmp_path_factory):
    """(source trunk variables, the export's model config, its workdir, the engine's summary)."""
    source = str(tmp_path_factory.mktemp(f"source_{request.param}"))
    trunk = _save_workdir(source, _source_config(request.param))
    config = export_config.get_config("test")
    config.init.checkpoint = source
    workdir = str(tmp_path_factory.mktemp(f"export_{request.param}"))
    summary = engines.run(config, workdir)
    return trunk, config.model, workdir, summary


def test_engine_writes_the_trunk_and_its_description(exported):
    trunk, model_config, workdir, summary = exported
    vit = models.is_vit(model_config)
    assert summary["step"] == STEP
    with_torch = importlib.util.find_spec("torch") is not None
    written = {"config.json", "export.json", "trunk.safetensors", *["trunk.pth"] * with_torch}
    assert set(os.listdir(workdir)) - {".lock"} == written
    with open(os.path.join(workdir, "export.json")) as f:
        description = json.load(f)
    assert description["source"]["step"] == STEP
    assert description["source"]["checkpoint"].endswith(f"checkpoints/{STEP}")
    architecture = description["architecture"]
    if vit:
        assert architecture["depth"] == 2 and architecture["patch_size"] == 8
        assert description["pytorch"]["kwargs"]["mlp_ratio"] == 4.0
    else:  # the source workdir's model, adopted from its config.json
        assert architecture["width_multiplier"] == 0.25 and architecture["cifar_stem"]
        assert not description["pytorch"]["builds_exactly"]
    state = load_file(summary["safetensors"])
    params = sum(v.size for k, v in state.items() if "running" not in k and "num_b" not in k)
    assert params == summary["num_parameters"]
    # The export read back through the weight reader of every engine equals the checkpoint.
    config = export_config.get_config("test")
    config.init.checkpoint = summary["safetensors"]
    assert source_model.adopt(config, "")  # the export workdir's config.json has the model
    imported = weights.read_torch(summary["safetensors"], config)
    _assert_equal(
        {k: v["trunk"] for k, v in imported.items()}, {k: v for k, v in trunk.items() if v}
    )


def test_pytorch_forward_equals_jssl(exported):
    """trunk.pth in the timm-layout ViT or torchvision-layout ResNet of tests/support, strict,
    gives jssl's avgpool (and res5) features in eval mode."""
    torch = pytest.importorskip("torch")
    from support.torch_resnet import TorchResNet
    from support.torch_vit import TorchViT

    trunk, model_config, workdir, _ = exported
    state = torch.load(os.path.join(workdir, "trunk.pth"), weights_only=True)
    size = 16
    x = np.random.default_rng(0).normal(size=(2, size, size, 3)).astype(np.float32)
    images = torch.from_numpy(x).permute(0, 3, 1, 2)
    if models.is_vit(model_config):
        net = TorchViT(image_size=16, patch=8, dim=192, depth=2, heads=3)
    else:
        net = TorchResNet(18, 0.25, num_classes=None, cifar_stem=True)
    net.load_state_dict(state)  # strict: the exported names are exactly the model's
    with torch.no_grad():
        if models.is_vit(model_config):
            expected = {"avgpool": net.eval().get_class_tokens(images)[-1][:, 0].numpy()}
        else:
            taps = net.eval().taps(images)
            expected = {"avgpool": taps["avgpool"].numpy()}
            expected["res5"] = taps["res5"].permute(0, 2, 3, 1).numpy()
    model = models.build_trunk(model_config)
    variables = {k: v for k, v in trunk.items() if v}
    got = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, x)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, atol=1e-4, rtol=1e-4, err_msg=name)


def test_bad_sources_and_trunks_are_named(tmp_path):
    config = export_config.get_config("test")
    with pytest.raises(ValueError, match=r"set --config\.init\.checkpoint"):
        engines.run(config, str(tmp_path / "out0"))
    empty = tmp_path / "empty"
    empty.mkdir()
    config.init.checkpoint = str(empty)
    with pytest.raises(weights.WeightsError, match=r"init\.checkpoint=.*No checkpoint found"):
        engines.run(config, str(tmp_path / "out1"))
    assert not os.path.exists(tmp_path / "out1" / "config.json")  # a rerun is not refused
    config.model.trunk = "regnet_y_16gf"
    with pytest.raises(ValueError, match=r"model\.trunk='regnet_y_16gf' is a RegNet.*ResNets"):
        engines.run(config, str(tmp_path / "out2"), explicit=["model.trunk"])
    assert not os.path.exists(tmp_path / "out2")  # refused before the workdir is made
    config.model.trunk = "alexnet"
    with pytest.raises(ValueError, match=r"model\.trunk='alexnet' is not a trunk jssl knows"):
        torch_export.check_exportable(config.model)


def test_an_export_exports_to_itself(exported, tmp_path):
    """init.checkpoint may be a file: the export's own trunk.safetensors (its model fields from
    the export workdir's config.json) exports to the same tensors; with no step, BN counters
    are 0."""
    _, _, _, summary = exported
    config = export_config.get_config("test")
    config.init.checkpoint = summary["safetensors"]
    config.export.pth = False
    again = engines.run(config, str(tmp_path / "again"))
    assert again["step"] is None and again["pth"] is None
    first, second = load_file(summary["safetensors"]), load_file(again["safetensors"])
    for name in [k for k in first if k.endswith("num_batches_tracked")]:
        assert first.pop(name) == STEP and second.pop(name) == 0, name
    _assert_equal(second, first)


def test_unreadable_safetensors_are_clear(tmp_path):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match="could not be read as a safetensors file"):
        torch_import.load_torch_state_dict(str(cut))
    other = tmp_path / "other.safetensors"
    save_file({"encoder.weight": np.zeros(3, np.float32)}, str(other))
    with pytest.raises(ValueError, match=r"No ResNet weights found.*encoder\.weight"):
        torch_import.load_torch_state_dict(str(other))


def test_a_dinov2_style_vit_exports_in_dinov2s_layout_and_imports_back():
    """LayerScale, registers and SwiGLU: DINOv2's names (ls1.gamma, register_tokens,
    mlp.w12 / w3, a zero (1, D) mask_token so that DinoVisionTransformer loads it strictly),
    its constructor in the record, and the same arrays after import (also from timm's copy of
    that layout: reg_token, packed mlp.fc1 / fc2, no class-token position)."""
    config = models.default_config()
    config.trunk, config.patch_size, config.image_size, config.head_dims = "vit_tiny", 8, 32, ()
    config.vit_depth, config.num_registers, config.ffn, config.layerscale = 2, 4, "swiglu", 0.1
    model = models.build_trunk(config)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes["params"])
    state = torch_export.vit_state_dict(params)
    assert state["blocks.1.ls2.gamma"].shape == (192,) and state["mask_token"].shape == (1, 192)
    assert state["blocks.0.mlp.w12.weight"].shape == (1024, 192)  # 2 x 512 out, PyTorch layout
    assert state["register_tokens"].shape == (1, 4, 192) and "blocks.0.mlp.fc1.weight" not in state
    record = torch_export.pytorch_model(config)["pytorch"]
    assert record["library"] == "dinov2" and record["kwargs"]["ffn_layer"] == "swiglufused"
    assert (record["kwargs"]["init_values"], record["kwargs"]["num_register_tokens"]) == (0.1, 4)
    back = vit_import.torch_vit_to_flax(state, config)["params"]
    jax.tree.map(np.testing.assert_array_equal, back, params)
    timm_state = {
        k.replace("mlp.w12.", "mlp.fc1.").replace("mlp.w3.", "mlp.fc2."): v
        for k, v in state.items()
        if k not in ("register_tokens", "mask_token")
    }
    timm_state["reg_token"] = state["register_tokens"]
    renamed = vit_import.dinov2_names(timm_state, config)
    assert set(renamed) == set(state) - {"mask_token"}
    key = "blocks.0.mlp.w3.weight"
    np.testing.assert_array_equal(renamed[key], state[key])
    timm_state["pos_embed"] = state["pos_embed"][:, 1:]  # no_embed_class: a zero row comes back
    padded = vit_import.dinov2_names(timm_state, config)["pos_embed"]
    assert padded.shape == (1, 17, 192) and not padded[:, 0].any()
