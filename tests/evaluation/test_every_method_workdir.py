"""Every registered method's workdir read by every engine that reads a trained trunk: feature
extraction, weighted kNN and the PyTorch export, each run as ``launch.py`` runs it
(``jssl.engines.run``, the model fields taken from the workdir's config.json) on the workdir
of a two-step run of the method's ``:test`` preset, trained once per method for the module.

What differs per method is what the trained model holds beside the evaluated one: iBOT's and
DINOv2's trunk has a mask token the evaluated trunk is built without (and DINOv2's export
carries the trained one), iBOT's head a patch last layer its eval-mode call does not build,
MSN's prototypes and MAE's decoder sit beside the model, BYOL's, SimSiam's and MoCo v3's
predictor, SwAV's prototypes. A wrong load is caught by the export: its tensors, imported
back, must equal the checkpoint's trunk.

CI tier: the methods whose trained model differs from the evaluated one in a way no other
ResNet method adds (iBOT, DINOv2, MSN, MAE) and MoCo, the ResNet whose train step other tests
of the session compile too. Each other method (JSSL_SLOW_TESTS=1) costs about 15-25 s of CPU
here, mostly compiling its train step, which the CI's budget does not hold for all fifteen.
"""

import importlib
import json
import os

import numpy as np
import pytest
from flax import traverse_util
from safetensors.numpy import load_file
from support.runs import load_checkpoint

from configs import export, extract_features, knn
from jssl import engines, methods, models
from jssl.checkpoints import source_model, weights

pytestmark = pytest.mark.e2e  # the end-to-end tier (JSSL_E2E_TESTS=1)

CI = ("moco", "ibot", "dinov2", "msn", "mae")


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=() if name in CI else pytest.mark.slow) for name in methods.METHODS
    ],
)
def trained(request, shared_dirs, tmp_path_factory):
    """(method name, its training config, its workdir): two steps of 16 examples, MoCo's
    as ``support.runs.tiny_trained_workdir``'s (its compiled programs are the session's)."""
    name = request.param
    config = importlib.import_module(f"configs.{name}").get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.checkpoint.async_save = False
    config.num_epochs, config.data.train_subset = 1, 32
    workdir = str(tmp_path_factory.mktemp(name))
    engines.run(config, workdir)
    return name, config, workdir


def _evaluation(module, trained, shared_dirs, tmp_path, engine_dir: str):
    """The ``:test`` preset of an evaluation config on the trained workdir, and its workdir."""
    config = module.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.init.checkpoint = trained[2]
    return config, str(tmp_path / engine_dir)


def test_features_are_extracted(trained, shared_dirs, tmp_path):
    name, train_config, _ = trained
    config, workdir = _evaluation(extract_features, trained, shared_dirs, tmp_path, "features")
    spatial = "block1" if models.is_vit(train_config.model) else "res5"
    has_head = methods.get(train_config).model.head is not None
    layers = (spatial, "avgpool", *(("head",) if has_head else ()))
    config.extract.layers = layers
    config.extract.splits = ("train[:16]", "test[:16]")
    summary = engines.run(config, workdir)
    width = models.trunk_feature_dim(train_config.model)
    for split in config.extract.splits:
        assert summary[split]["num_examples"] == 16
        for layer in layers:
            path = os.path.join(summary[split]["directory"], f"{layer}_features.npy")
            features = np.load(path)
            assert features.shape[0] == 16 and np.all(np.isfinite(features)), (name, layer)
        assert summary[split]["shapes"]["avgpool"] == (width,)


def test_knn_is_evaluated(trained, shared_dirs, tmp_path):
    config, workdir = _evaluation(knn, trained, shared_dirs, tmp_path, "knn")
    config.knn.train_split, config.knn.test_split = "train[:64]", "test[:32]"
    engines.run(config, workdir)
    with open(os.path.join(workdir, "results.json")) as f:
        results = json.load(f)
    assert results["num_train"] == 64 and results["num_test"] == 32
    for k in config.knn.ks:
        assert 0 <= results[f"k{k}"]["top1"] <= 100


def test_export_holds_the_checkpoints_trunk(trained, shared_dirs, tmp_path):
    """The export imported back equals the checkpoint's trunk, array for array; a DINOv2
    layout holds the trained mask token."""
    name, _, source = trained
    config, workdir = _evaluation(export, trained, shared_dirs, tmp_path, "export")
    summary = engines.run(config, workdir)
    state, _ = load_checkpoint(source)
    source_model.adopt(config, workdir)  # what engines.run evaluated with
    imported = weights.read_torch(summary["safetensors"], config)
    for collection, tree in imported.items():
        saved = traverse_util.flatten_dict(state[collection]["trunk"])
        got = traverse_util.flatten_dict(tree["trunk"])
        assert set(got) == set(saved) - {("mask_token",)}, name  # the trunk but its mask token
        for key, value in got.items():
            np.testing.assert_array_equal(value, saved[key], err_msg=f"{name} {key}")
    tensors = load_file(summary["safetensors"])
    mask_token = state["params"]["trunk"].get("mask_token")
    if "register_tokens" in tensors or any(".ls1." in k for k in tensors):  # DINOv2's layout
        assert mask_token is not None and np.any(mask_token != 0), name  # trained, not zeros
        np.testing.assert_array_equal(tensors["mask_token"], mask_token.reshape(1, -1))
    else:
        assert "mask_token" not in tensors
