"""Tests for jssl.models.regnet_import: PyTorch RegNetY weights reproduce PyTorch's features.

A tiny torchvision-layout RegNetY (tests/support/torch_regnet.py) with random weights and BN
statistics is saved as a torchvision state dict and as a VISSL / SEER checkpoint; either,
imported into jssl's RegNet of the same design, gives PyTorch's features. The real sizes are
checked on shapes alone (the torch model on the meta device, nothing allocated).
"""

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from support.torch_regnet import TorchRegNet  # noqa: E402

from jssl.checkpoints import weights  # noqa: E402
from jssl.models import default_config  # noqa: E402
from jssl.models.regnet import SIZES, Design, RegNet, stages  # noqa: E402
from jssl.models.regnet_import import (  # noqa: E402
    import_torch_regnet,
    load_regnet_state_dict,
    torch_regnet_to_flax,
)

# Four stages of widths 8 .. 64, groups of 8 (1 to 8 groups), stage 3 with an identity block.
TINY = Design(depth=5, w_0=8, w_a=12.0, w_m=2.0, group_width=8)
TOLERANCE = 1e-4


def _torch_regnet(design: Design = TINY, seed: int = 0):
    """A TorchRegNet with BNs far from identity, in eval mode, its taps on two 64 px images."""
    torch.manual_seed(seed)
    model = TorchRegNet(stages(design))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.2)
                module.momentum = 1.0  # running stats = one random batch's statistics
        model.train()
        model.taps(torch.randn(8, 3, 64, 64))
        model.eval()
        images = torch.randn(2, 3, 64, 64)
        taps = {k: v.numpy() for k, v in model.taps(images).items()}
    return model, images.numpy().transpose(0, 2, 3, 1), taps


def _vissl_names(state: dict) -> dict:
    """torchvision names -> VISSL's trunk names (ClassyVision's modules as _feature_blocks)."""
    renames = (
        (r"^stem\.", "conv1.stem."),
        (r"^trunk_output\.block(\d+)\.", lambda m: f"res{int(m[1]) + 1}."),
        (r"\.se\.fc1\.", ".se.excitation.0."),
        (r"\.se\.fc2\.", ".se.excitation.2."),
        (r"\.f\.c\.0\.", ".f.c."),
        (r"\.f\.c\.1\.", ".f.final_bn."),
        (r"\.proj\.0\.", ".proj."),
        (r"\.proj\.1\.", ".bn."),
    )
    renamed = {}
    for key, value in state.items():
        if key.startswith("fc."):
            continue
        for pattern, replacement in renames:
            key = re.sub(pattern, replacement, key)
        renamed["_feature_blocks." + key] = value
    return renamed


def _save(model, tmp_path) -> tuple[str, str]:
    """The model as torchvision's .pth and as a SEER checkpoint (vissl/utils/checkpoint.py)."""
    state = model.state_dict()
    pth, vissl = tmp_path / "regnet.pth", tmp_path / "seer.torch"
    torch.save(state, pth)
    heads = {"0.clf.0.weight": state["fc.weight"], "0.clf.0.bias": state["fc.bias"]}
    trunk = _vissl_names(state)
    checkpoint = {"phase_idx": 3, "iteration": 100}
    checkpoint["classy_state_dict"] = {"base_model": {"model": {"trunk": trunk, "heads": heads}}}
    torch.save(checkpoint, vissl)
    return str(pth), str(vissl)


def test_features_match_torch(tmp_path):
    model, images, torch_taps = _torch_regnet()
    pth, vissl = _save(model, tmp_path)
    layout, state = load_regnet_state_dict(pth)
    assert layout == "torchvision" and "fc.weight" in state
    trunk = RegNet(**TINY._asdict())
    variables = torch_regnet_to_flax(state, trunk, layout)
    assert variables["params"]["block2_0"]["b"]["kernel"].shape == (3, 3, 8, 16)  # 2 groups
    taps = jax.jit(lambda v, x: trunk.apply(v, x, train=False))(variables, jnp.asarray(images))
    for name in ("conv1", "res2", "res3", "res4", "res5", "avgpool"):
        expected = torch_taps[name]
        expected = expected.transpose(0, 2, 3, 1) if expected.ndim == 4 else expected
        scale = max(1.0, float(np.max(np.abs(expected))))
        diff = float(np.max(np.abs(np.asarray(taps[name]) - expected)))
        assert diff < TOLERANCE * scale, f"{name}: max |jax - torch| = {diff:.1e}"

    # The SEER checkpoint gives the same arrays, its heads dropped.
    layout, state = load_regnet_state_dict(vissl)
    assert layout == "vissl" and "conv1.stem.0.weight" in state
    jax.tree.map(
        np.testing.assert_array_equal, torch_regnet_to_flax(state, trunk, layout), variables
    )


def _stage(match) -> str:
    return f"trunk_output.block{int(match[1]) - 1}."


@pytest.mark.parametrize(
    "wrap",
    [
        # ClassyVision's own model: VISSL's names without the res-N / conv1 wrapping.
        lambda s: {
            re.sub(r"^conv1\.stem\.", "stem.stem.", re.sub(r"^res(\d+)\.", _stage, k[16:])): v
            for k, v in _vissl_names(s).items()
        },
        # VISSL's FSDP trunk groups blocks as block{s}-part{g}; a DDP "module." prefix.
        lambda s: {
            "model": {
                re.sub(r"\.res(\d)\.(block\d)", r".res\1.\2-part0.\2", "module." + k): v
                for k, v in _vissl_names(s).items()
            }
        },
        lambda s: {"model_state_dict": {"module." + k: v for k, v in s.items()}},
    ],
    ids=["classy", "vissl_fsdp_groups", "torchvision_ddp"],
)
def test_other_layouts(tmp_path, wrap):
    model = TorchRegNet(stages(TINY))
    path = tmp_path / "regnet.torch"
    torch.save(wrap(model.state_dict()), path)
    layout, state = load_regnet_state_dict(str(path))
    trunk = RegNet(**TINY._asdict())
    state_dict = {k: v.numpy() for k, v in model.state_dict().items()}
    expected = torch_regnet_to_flax(state_dict, trunk)
    jax.tree.map(
        np.testing.assert_array_equal, torch_regnet_to_flax(state, trunk, layout), expected
    )


def _shapes_only(size: str) -> dict:
    """torchvision's state dict of a real size as zero-filled views: shapes, no memory."""
    with torch.device("meta"):
        model = TorchRegNet(stages(SIZES[size]), num_classes=1000)
    zero = np.zeros((), np.float32)
    return {k: np.broadcast_to(zero, v.shape) for k, v in model.state_dict().items()}


def test_real_sizes_map_and_mismatches_are_named():
    # The torch model is torchvision's: its parameter count is the published num_params
    # (jssl's own trunks are counted in test_regnet.py).
    published = {"regnet_y_16gf": 83_590_140, "regnet_y_32gf": 145_046_770}
    for size, count in published.items():
        with torch.device("meta"):
            model = TorchRegNet(stages(SIZES[size]), num_classes=1000)
        assert sum(p.numel() for p in model.parameters()) == count
    state = _shapes_only("regnet_y_16gf")
    variables = torch_regnet_to_flax(state, RegNet(**SIZES["regnet_y_16gf"]._asdict()))
    assert variables["params"]["block4_0"]["b"]["kernel"].shape == (3, 3, 112, 3024)
    with pytest.raises(
        ValueError,
        match=r"(?s)do not fit jssl's regnet_y_32gf: .*the first trunk_output\.block1\.block1-0"
        r"\.proj\.0\.weight: checkpoint \(224, 32, 1, 1\), model \(232, 32, 1, 1\).*looks like "
        r"regnet_y_16gf.*--config\.model\.trunk=regnet_y_16gf",
    ):
        torch_regnet_to_flax(state, RegNet(**SIZES["regnet_y_32gf"]._asdict()))
    del state["trunk_output.block3.block3-4.f.se.fc2.bias"]
    with pytest.raises(ValueError, match=r"the first trunk_output\.block3\.block3-4\.f\.se\.fc2"):
        torch_regnet_to_flax(state, RegNet(**SIZES["regnet_y_16gf"]._asdict()))


def test_init_checkpoint_dispatch(tmp_path, monkeypatch):
    model, _, _ = _torch_regnet(seed=1)
    _, vissl = _save(model, tmp_path)
    config = ml_collections.ConfigDict({"model": default_config()})
    config.model.trunk = "regnet_y_16gf"
    with pytest.raises(
        weights.WeightsError,
        match=r"(?s)seer\.torch: .*vissl layout.*none of jssl's RegNet sizes.*model\.trunk",
    ):
        weights.read_torch(vissl, config)
    monkeypatch.setitem(SIZES, "regnet_y_tiny", TINY)  # a size the config can name
    config.model.trunk = "regnet_y_tiny"
    imported = weights.read_torch(vissl, config)
    expected = import_torch_regnet(vissl, config.model)
    jax.tree.map(np.testing.assert_array_equal, imported, expected)
    assert set(imported) == {"params", "batch_stats"} and "trunk" in imported["batch_stats"]

    torch.save({"state_dict": {"encoder.weight": torch.zeros(2)}}, tmp_path / "other.pth")
    with pytest.raises(weights.WeightsError, match=r"No RegNet weights found.*encoder\.weight"):
        weights.read_torch(str(tmp_path / "other.pth"), config)
