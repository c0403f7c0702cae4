"""The RegNetY trunks (jssl/models/regnet.py): parameter counts against torchvision's, stage
widths against VISSL's SEER configs, taps, a tiny forward and backward, and the config wiring.

Shapes only (``jax.eval_shape``) for the real sizes; the forward and backward pass run on a
tiny four-stage design."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jssl.models import build_model, build_trunk, default_config, trunk_feature_dim, valid_trunks
from jssl.models.regnet import SIZES, Design, RegNet, stages


def _count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _abstract(model, size=224):
    """Shapes of the variables and taps of ``model`` on one ``size`` px image, nothing run."""
    x = jnp.zeros((1, size, size, 3))

    def init_and_apply():
        variables = model.init(jax.random.key(0, impl="rbg"), x, train=False)
        return variables, model.apply(variables, x, train=False)

    return jax.eval_shape(init_and_apply)


def _config(trunk: str):
    cfg = default_config()
    cfg.trunk = trunk
    return cfg


# num_params of torchvision's RegNet_Y_*_Weights (docs pages
# https://pytorch.org/vision/stable/models/generated/torchvision.models.regnet_y_{400mf,16gf,
# 32gf,128gf}.html), which include the 1000-class fc head: last width x 1000 + 1000.
@pytest.mark.parametrize(
    "design,torchvision_total,last_width",
    [
        (Design(16, 48, 27.89, 2.09, 8), 4_344_144, 440),  # regnet_y_400mf
        (SIZES["regnet_y_16gf"], 83_590_140, 3024),
        (SIZES["regnet_y_32gf"], 145_046_770, 3712),
        (SIZES["regnet_y_128gf"], 644_812_894, 7392),
    ],
)
def test_param_count_matches_torchvision(design, torchvision_total, last_width):
    variables, taps = _abstract(RegNet(**design._asdict()))
    assert taps["avgpool"].shape == (1, last_width)
    assert _count(variables["params"]) == torchvision_total - (last_width * 1000 + 1000)


def test_stage_widths_match_vissl_seer_configs():
    # The mlp head dims of VISSL's configs/config/benchmark/fulltune/*/models/regnet64Gf_3.yaml
    # ([4920, ...]) and regnet256Gf_1.yaml ([10444, ...]) are these trunks' feature widths.
    assert stages(SIZES["regnet_y_64gf"]) == [
        (328, 2, 328),
        (984, 5, 328),
        (1968, 12, 328),
        (4920, 1, 328),
    ]
    # Group width 373 makes widths that are not multiples of 8, as in VISSL.
    assert stages(SIZES["regnet_y_256gf"]) == [
        (746, 2, 373),
        (1492, 7, 373),
        (4103, 17, 373),
        (10444, 1, 373),
    ]
    assert trunk_feature_dim(_config("regnet_y_256gf")) == 10444
    assert trunk_feature_dim(_config("regnet_y_16gf")) == 3024


def test_taps_at_224px():
    trunk = build_trunk(_config("regnet_y_16gf"))
    _, taps = _abstract(trunk)
    shapes = {name: tap.shape for name, tap in taps.items()}
    assert shapes == {
        "conv1": (1, 112, 112, 32),
        "res2": (1, 56, 56, 224),  # stride 4
        "res3": (1, 28, 28, 448),  # 8
        "res4": (1, 14, 14, 1232),  # 16
        "res5": (1, 7, 7, 3024),  # 32
        "avgpool": (1, 3024),
    }


def test_tiny_regnet_forward_and_backward():
    design = Design(depth=5, w_0=8, w_a=12.0, w_m=2.0, group_width=8)
    # Four stages; stage 3 has a second block with an identity shortcut.
    assert stages(design) == [(8, 1, 8), (16, 1, 8), (32, 2, 8), (64, 1, 8)]
    model = RegNet(**design._asdict())
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 32, 32, 3)), jnp.float32)

    def loss(params, batch_stats):
        taps, updates = model.apply(
            {"params": params, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
        )
        return jnp.mean(taps["avgpool"] ** 2), (taps, updates)

    @jax.jit
    def init_and_step():
        # One compilation for the initialisation and the step: compiling dominates on CPU.
        variables = model.init(jax.random.key(0, impl="rbg"), x, train=False)
        step = jax.value_and_grad(loss, has_aux=True)
        return variables["params"], step(variables["params"], variables["batch_stats"])

    params, ((value, (taps, updates)), grads) = init_and_step()
    assert params["block2_0"]["b"]["kernel"].shape == (3, 3, 8, 16)  # 2 groups of 8
    # SE: from the 32 bottleneck channels down to 0.25 x the block's 16 input channels.
    assert params["block3_0"]["se_reduce"]["kernel"].shape == (1, 1, 32, 4)
    assert "proj" not in params["block3_1"] and "proj" in params["block3_0"]
    assert {k: v.shape[1:] for k, v in taps.items()} == {
        "conv1": (16, 16, 32),  # the 32-channel stem
        "res2": (8, 8, 8),
        "res3": (4, 4, 16),
        "res4": (2, 2, 32),
        "res5": (1, 1, 64),
        "avgpool": (64,),
    }
    assert np.isfinite(float(value))
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads["block1_0"]["se_expand"]["kernel"]).sum()) > 0
    assert "batch_stats" in updates


def test_config_wiring_and_errors():
    assert {f"regnet_y_{n}gf" for n in (16, 32, 64, 128, 256)} <= set(valid_trunks())
    cfg = _config("regnet_y_32gf")
    cfg.dtype, cfg.remat = "bfloat16", "full"
    trunk = build_trunk(cfg, bn_axis_name="data")
    assert isinstance(trunk, RegNet) and trunk.w_0 == 232 and trunk.group_width == 232
    assert trunk.dtype == jnp.bfloat16 and trunk.bn_axis_name == "data" and trunk.remat == "full"
    with pytest.raises(ValueError, match="no built-in classifier"):
        build_trunk(cfg, num_classes=10)
    cfg.head_dims = (3712, 3712, 128)
    assert build_model(cfg).head.dims == (3712, 3712, 128)
    cfg.width_multiplier = 2.0
    with pytest.raises(ValueError, match=r"model\.width_multiplier=2\.0"):
        build_trunk(cfg)
    with pytest.raises(ValueError, match="Invalid RegNet design"):
        stages(Design(4, 20, 10.0, 2.0, 8))  # w_0 not a multiple of 8
