"""Evaluation engines take the evaluated workdir's model fields (jssl.checkpoints.source_model):
from its config.json, except fields given on the command line; a training run only its trunk's,
and only when asked (the fine-tuning presets)."""

import json
import os

import jax
import jax.numpy as jnp
import pytest

from configs import dino, extract_features, knn, linear_eval, moco, supervised
from jssl import cli, methods
from jssl.checkpoints import source_model


def _workdir(tmp_path, config) -> str:
    workdir = tmp_path / "trained"
    (workdir / "checkpoints" / "8").mkdir(parents=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    return str(workdir)


def test_knn_takes_the_vit_model_of_a_dino_workdir(tmp_path):
    trained = dino.get_config("demo_vit")
    config = knn.get_config("demo")
    assert config.model.trunk != trained.model.trunk
    config.init.checkpoint = os.path.join(_workdir(tmp_path, trained), "checkpoints", "8")
    applied = source_model.adopt(config, str(tmp_path / "eval"))
    for field in ("trunk", "patch_size", "vit_depth", "head_dims", "image_size"):
        assert config.model[field] == trained.model[field], field
    assert f"--config.model.trunk={trained.model.trunk}" in applied
    assert isinstance(config.model.head_dims, tuple)


def test_the_compute_dtype_and_attention_kernel_stay_the_evaluations(tmp_path):
    # A workdir trained with cuDNN attention in bf16 on a GPU is evaluated anywhere.
    trained = dino.get_config("demo_vit")
    trained.model.update(dict(dtype="bfloat16", attention="cudnn"))
    config = knn.get_config("demo")
    config.init.checkpoint = _workdir(tmp_path, trained)
    applied = source_model.adopt(config, str(tmp_path / "eval"))
    assert (config.model.dtype, config.model.attention) == ("float32", "auto")
    assert not any("dtype" in flag or "attention" in flag for flag in applied)


def test_a_field_given_on_the_command_line_wins(tmp_path):
    trained = moco.get_config("demo")
    trained.model.width_multiplier = 0.5
    config = linear_eval.get_config("demo")
    config.init.checkpoint = _workdir(tmp_path, trained)
    config.model.width_multiplier = 0.25
    source_model.adopt(config, str(tmp_path / "eval"), explicit=["model.width_multiplier"])
    assert config.model.width_multiplier == 0.25
    source_model.adopt(config, str(tmp_path / "eval"))
    assert config.model.width_multiplier == 0.5


def test_turned_off_training_and_torch_files_keep_the_config(tmp_path):
    trained = dino.get_config("demo_vit")
    path = _workdir(tmp_path, trained)
    config = knn.get_config("demo")
    config.init.checkpoint = path
    config.init.model_from_checkpoint = False
    assert source_model.adopt(config, "x") == []
    train = moco.get_config("demo")
    train.init.checkpoint = path
    assert source_model.adopt(train, "x") == []
    config = knn.get_config("demo")
    config.init.checkpoint = str(tmp_path / "resnet50.pth")
    before = json.loads(config.to_json_best_effort())
    assert source_model.adopt(config, "x") == []
    assert json.loads(config.to_json_best_effort()) == before


def test_command_line_overrides_are_the_explicit_fields():
    argv = ["jssl", "--config=configs/knn.py:demo", "--config.model.trunk=vit_tiny", "--workdir=w"]
    assert cli.overridden_fields(argv) == ["model.trunk"]


def test_a_head_layer_is_read_with_the_method_of_the_evaluated_workdir(tmp_path):
    """The evaluation presets set no method: a layer of the head builds the workdir's own (here
    DINO's prototypes, which MoCo's head would not fit), and fails clearly without one."""
    trained = dino.get_config("test")
    config = extract_features.get_config("test")
    config.init.checkpoint = _workdir(tmp_path, trained)
    source_model.adopt(config, str(tmp_path / "eval"))
    source = source_model.method_config(config, config.init.checkpoint)
    assert source.method.name == "dino" and source.model == config.model

    def shapes(model):
        size = config.data.image_size
        images = jnp.zeros((1, size, size, 3))
        variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), images))
        return jax.tree.map(lambda x: x.shape, variables["params"]["head"])

    assert shapes(methods.get(source).model) == shapes(methods.get(trained).model)
    with pytest.raises(ValueError, match="no jssl config.json naming the method"):
        source_model.method_config(config, str(tmp_path / "resnet50.pth"))


def test_fine_tuning_takes_the_trunk_of_its_workdir_and_sizes_the_head(tmp_path):
    """finetune_vit from a DINO ViT-S workdir: the trunk's fields from its config.json, the
    classifier's input width from that trunk, the head and regularisation its own."""
    trained = dino.get_config("demo_vit")
    trained.model.trunk, trained.model.drop_path_rate = "vit_small", 0.3
    tune = supervised.get_config("finetune_vit")
    tune.init.checkpoint = _workdir(tmp_path, trained)
    applied = source_model.adopt(tune, str(tmp_path / "tune"))
    for field in ("trunk", "patch_size", "vit_depth", "image_size"):
        assert tune.model[field] == trained.model[field], field
    assert tune.model.head_dims == (384, 1000) and "--config.model.head_dims=(384, 1000)" in applied
    assert (tune.model.drop_path_rate, tune.model.dtype) == (0.1, "bfloat16")  # the recipe's
    # A flag given wins; a training config without the field adopts nothing.
    again = supervised.get_config("finetune_vit")
    again.init.checkpoint = tune.init.checkpoint
    source_model.adopt(again, str(tmp_path / "tune2"), {"model.trunk", "model.head_dims"})
    assert (again.model.trunk, again.model.head_dims) == ("vit_base", (768, 1000))
    plain = moco.get_config("demo")
    plain.init.checkpoint = tune.init.checkpoint
    assert source_model.adopt(plain, str(tmp_path / "plain")) == []
