"""The ViT trunk (jssl/models/vit.py) against a PyTorch ViT in timm's layout on the same weights,
the import of timm / DINO / MoCo v3 files, and the evaluation engines on an imported ViT.

timm itself is not a dependency (it pulls torchvision and a torch upgrade); the same comparison
against ``timm.models.vision_transformer.VisionTransformer(dynamic_img_size=True)``, run by hand
on 2026-11-22 with timm 1.0.31 and ViT-Tiny/16 weights, gave max differences of 2.7e-6 (224 px)
and 2.1e-6 (96 px) in the class token; on 2026-11-27, on random weights at 224 px, timm's
ViT-L/16, ViT-H/14 and ViT-g/14 gave 5.3e-6, 4.8e-6 and 4.9e-6, and its DINOv2 copies ViT-S/14,
ViT-S/14 with 4 registers and ViT-g/14 (SwiGLU) with 4 registers 2.1e-6, 2.7e-6 and 8.5e-6, each
with timm's parameter count."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.launch import prepare_shared_dirs

from configs import knn as knn_config
from configs import linear_eval as linear_eval_config
from jssl import models
from jssl.checkpoints import weights
from jssl.engines import knn as knn_engine
from jssl.engines import linear_eval
from jssl.models import vit, vit_import
from jssl.optim import transforms

torch = pytest.importorskip("torch")

from support.torch_vit import TorchViT  # noqa: E402


def _model_config(trunk="vit_tiny", patch=16, image_size=224):
    config = models.default_config()
    config.trunk, config.patch_size, config.image_size = trunk, patch, image_size
    config.head_dims = ()
    return config


def _timm_vit(image_size=224, patch=16, seed=0):
    torch.manual_seed(seed)
    return TorchViT(image_size, patch).eval()


def _numpy_state(net):
    return {k: v.detach().numpy() for k, v in net.state_dict().items()}


@pytest.fixture(scope="module")
def tiny224():
    net = _timm_vit()
    return net, vit_import.torch_vit_to_flax(_numpy_state(net), _model_config())


@pytest.mark.parametrize("size", [224, 96])
def test_forward_matches_torch(tiny224, size):
    """At the native 224 px and at 96 px (position embeddings resampled, as multi-crop's local
    crops need), every tap equals the PyTorch ViT's on the same weights."""
    net, variables = tiny224
    x = np.random.default_rng(size).normal(size=(2, size, size, 3)).astype(np.float32)
    with torch.no_grad():
        normed = net.get_class_tokens(torch.from_numpy(x).permute(0, 3, 1, 2))
        tokens = normed[-1].numpy()
    cls4 = np.concatenate([t[:, 0].numpy() for t in normed[-4:]], axis=-1)
    trunk = models.build_trunk(_model_config())
    taps = jax.jit(lambda v, x: trunk.apply(v, x, train=False))(variables, x)
    tol = dict(atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(taps["avgpool"], tokens[:, 0], **tol)
    np.testing.assert_allclose(taps["patch_avg"], tokens[:, 1:].mean(1), **tol)
    np.testing.assert_allclose(taps["concat_cls4"], cls4, **tol)
    np.testing.assert_allclose(taps["block9"], cls4[:, :192], **tol)
    assert taps["cls_patch_avg"].shape == (2, 384)


def _dinov2_config():
    config = _model_config("vit_tiny", 8, 32)
    config.vit_depth, config.num_registers, config.ffn, config.layerscale = 2, 4, "swiglu", 1e-5
    return config


def test_a_dinov2_layout_vit_imports_and_matches_torch():
    """DINOv2's layout (LayerScale ls1/ls2, register_tokens, SwiGLU mlp.w12/w3) and timm's copy
    of it (reg_token, packed mlp.fc1/fc2, the class token's position folded into the class
    token): both import to a trunk whose class token equals the PyTorch model's."""
    torch.manual_seed(1)
    net = TorchViT(32, 8, dim=192, depth=2, layerscale=1e-5, registers=4, swiglu=True).eval()
    x = np.random.default_rng(3).normal(size=(2, 32, 32, 3)).astype(np.float32)
    with torch.no_grad():
        expected = net.get_class_tokens(torch.from_numpy(x).permute(0, 3, 1, 2))[-1][:, 0]
    state = _numpy_state(net)
    timm_state = {
        k.replace("mlp.w12.", "mlp.fc1.").replace("mlp.w3.", "mlp.fc2."): v
        for k, v in state.items()
        if k not in ("register_tokens", "pos_embed", "cls_token")
    }
    timm_state["reg_token"] = state["register_tokens"]
    timm_state["cls_token"] = state["cls_token"] + state["pos_embed"][:, :1]
    timm_state["pos_embed"] = state["pos_embed"][:, 1:]  # 16 rows: timm's no_embed_class
    trunk = models.build_trunk(_dinov2_config())
    apply = jax.jit(lambda v, x: trunk.apply(v, x, train=False)["avgpool"])
    for layout in (state, timm_state):
        variables = vit_import.torch_vit_to_flax(layout, _dinov2_config())
        np.testing.assert_allclose(apply(variables, x), expected.numpy(), atol=1e-4, rtol=1e-4)


def test_parameter_counts_match_the_published_models():
    """Without the 1000-class head: ViT-S/16 21.7M and ViT-B/16 85.8M (DeiT Table 1; timm);
    ViT-L/16, ViT-H/14 and ViT-g/14 timm's 304,326,632, 632,045,800 and 1,012,611,432 less
    their heads (1024, 1280 and 1408 x 1000 weights and 1000 biases)."""

    def count(trunk, patch=16):
        model = models.build_trunk(_model_config(trunk, patch))
        shapes = jax.eval_shape(
            lambda: model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)), train=False)
        )
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))

    assert count("vit_small") == 21_665_664
    assert count("vit_base") == 85_798_656
    assert count("vit_large") == 304_326_632 - 1_025_000
    assert count("vit_huge", 14) == 632_045_800 - 1_281_000
    assert count("vit_giant", 14) == 1_012_611_432 - 1_409_000
    assert models.trunk_feature_dim(_model_config("vit_base")) == 768
    assert models.trunk_feature_dim(_model_config("vit_giant", 14)) == 1408


@pytest.mark.parametrize("layout", ["dino_teacher", "mocov3", "plain"])
def test_published_layouts_load_through_init_checkpoint(tiny224, tmp_path, layout):
    net, expected = tiny224
    state = net.state_dict()
    if layout == "dino_teacher":  # DINO's training checkpoint: the teacher's backbone + head
        saved = {"teacher": {**{f"backbone.{k}": v for k, v in state.items()}}}
        saved["teacher"]["head.mlp.0.weight"] = torch.zeros(8, 192)
    elif layout == "mocov3":  # both encoders and the predictor under module.
        saved = {
            "epoch": 300,
            "state_dict": {
                **{f"module.base_encoder.{k}": v for k, v in state.items()},
                **{f"module.momentum_encoder.{k}": v + 1 for k, v in state.items()},
                "module.base_encoder.head.0.weight": torch.zeros(8, 192),
                "module.predictor.0.weight": torch.zeros(8, 8),
            },
        }
    else:
        saved = dict(state)
    path = tmp_path / "vit.pth"
    torch.save(saved, path)
    config = knn_config.get_config("test")
    config.model.update(_model_config())
    loaded = weights.read_torch(str(path), config)
    assert set(loaded) == {"params"}
    jax.tree.map(np.testing.assert_array_equal, loaded["params"]["trunk"], expected["params"])


def test_mismatches_are_named(tiny224, tmp_path):
    net, _ = tiny224
    path = tmp_path / "tiny.pth"
    torch.save(net.state_dict(), path)
    config = knn_config.get_config("test")
    config.model.update(_model_config("vit_small"))
    with pytest.raises(
        weights.WeightsError, match=r"(?s)Shape mismatches.*width 192.*read as vit_small"
    ):
        weights.read_torch(str(path), config)
    config.model.update(_model_config("vit_tiny", patch=8))
    with pytest.raises(weights.WeightsError, match=r"patch 16.*patch 8"):
        weights.read_torch(str(path), config)
    resnet = {"conv1.weight": torch.zeros(64, 3, 7, 7)}
    torch.save(resnet, path)
    config.model.update(_model_config("vit_tiny"))
    with pytest.raises(weights.WeightsError, match=r"No ViT weights found.*conv1\.weight"):
        weights.read_torch(str(path), config)


def test_position_embeddings_are_resampled_on_import(tiny224):
    """224 px weights into a 32 px model: pos_embed's 14x14 grid becomes 4x4 (timm's
    resample on load); the class token's embedding is kept."""
    net, _ = tiny224
    state = _numpy_state(net)
    loaded = vit_import.torch_vit_to_flax(state, _model_config(patch=16, image_size=64))
    pos = loaded["params"]["pos_embed"]
    assert pos.shape == (1, 17, 192)
    np.testing.assert_array_equal(pos[:, 0], state["pos_embed"][:, 0])
    np.testing.assert_allclose(
        pos[:, 1:], vit.resample_pos_embed(jnp.asarray(state["pos_embed"][:, 1:]), (4, 4))
    )


def test_masked_and_kept_patches_registers_layerscale_swiglu():
    """The masked-image options: ``mask`` puts the mask token in place of masked patches before
    the position embeddings, ``keep`` sends only those patches through, registers are dropped
    from the outputs, LayerScale starts at its init value and SwiGLU has DINOv2's width."""
    trunk = vit.VisionTransformer(
        embed_dim=16, depth=2, num_heads=2, patch_size=4, image_size=16, mask_token=True
    )
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 16, 16, 3)), jnp.float32)
    variables = trunk.init(jax.random.key(0), x, train=False)
    params = variables["params"]
    assert params["mask_token"].shape == (1, 1, 16)
    out = trunk.apply(variables, x, train=False)
    assert out["patch_tokens"].shape == (2, 16, 16)
    # All masked with a zero token: both images give the same tokens (position embeddings only).
    full = jnp.ones((2, 16), bool)
    masked = trunk.apply(variables, x, train=False, mask=full)
    np.testing.assert_allclose(masked["patch_tokens"][0], masked["patch_tokens"][1], atol=1e-6)
    none = trunk.apply(variables, x, train=False, mask=jnp.zeros((2, 16), bool))
    np.testing.assert_array_equal(none["avgpool"], out["avgpool"])
    # keep: the same tokens as a trunk given only those patches' embeddings (a 1-block ViT
    # mixes tokens through attention, so compare against the gathered input path by hand).
    keep = jnp.asarray([[0, 5, 15], [3, 2, 1]], jnp.int32)
    kept = trunk.apply(variables, x, train=False, keep=keep)
    assert kept["patch_tokens"].shape == (2, 3, 16)
    perm = trunk.apply(variables, x, train=False, keep=keep[:, ::-1])
    # Attention without position-dependent masks is permutation-equivariant over the tokens.
    np.testing.assert_allclose(perm["patch_tokens"], kept["patch_tokens"][:, ::-1], atol=1e-5)
    np.testing.assert_allclose(perm["avgpool"], kept["avgpool"], atol=1e-5)
    with pytest.raises(ValueError, match="mask_token=True"):
        vit.VisionTransformer(embed_dim=16, depth=1, num_heads=2, patch_size=4).apply(
            {"params": {k: v for k, v in params.items() if k != "mask_token"}},
            x,
            train=False,
            mask=full,
        )

    big = vit.VisionTransformer(
        embed_dim=24,
        depth=1,
        num_heads=2,
        patch_size=4,
        image_size=16,
        num_registers=4,
        layerscale=1e-5,
        ffn="swiglu",
        mlp_dim=96,
    )
    variables = big.init(jax.random.key(0), x, train=False)
    p = variables["params"]
    assert p["register_tokens"].shape == (1, 4, 24)
    np.testing.assert_array_equal(p["blocks_0"]["ls1"]["gamma"], np.full(24, 1e-5, np.float32))
    assert p["blocks_0"]["w12"]["kernel"].shape == (24, 2 * 64)  # (int(96 * 2 / 3) + 7) // 8 * 8
    assert p["blocks_0"]["w3"]["kernel"].shape == (64, 24)
    assert vit.swiglu_hidden(6144) == 4096
    out = big.apply(variables, x, train=False)
    assert out["patch_tokens"].shape == (2, 16, 24)


def test_bf16_compute_keeps_float32_parameters(tiny224):
    _, variables = tiny224
    config = _model_config()
    config.dtype = "bfloat16"
    trunk = models.build_trunk(config)
    x = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32)
    low = trunk.apply(variables, x, train=False)["avgpool"]
    high = models.build_trunk(_model_config()).apply(variables, x, train=False)["avgpool"]
    assert low.dtype == jnp.bfloat16
    rel = np.linalg.norm(np.float32(low) - high) / np.linalg.norm(high)
    assert rel < 3e-2
    fresh = trunk.init(jax.random.key(0), x, train=False)
    assert {np.dtype(leaf.dtype) for leaf in jax.tree.leaves(fresh)} == {np.dtype("float32")}


def test_layer_norms_follow_regularize_bn():
    """VISSL's regularize_bn covers every norm layer: ViT's LayerNorms too."""
    model = models.build_trunk(_model_config())
    params = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)
    )["params"]
    mask = transforms.weight_decay_mask(params, regularize_bn=False, regularize_bias=True)
    assert mask["norm"] == {"scale": False, "bias": False}
    assert mask["blocks_0"]["norm1"]["scale"] is False
    assert mask["blocks_0"]["attn"]["qkv"] == {"kernel": True, "bias": True}
    assert mask["pos_embed"] is True and mask["cls_token"] is True


def test_bad_sizes_are_clear():
    with pytest.raises(ValueError, match="model.image_size=100 must be a positive multiple"):
        models.build_trunk(_model_config(image_size=100))
    trunk = models.build_trunk(_model_config(patch=16, image_size=32))
    with pytest.raises(ValueError, match="24x24 px is not a multiple of the patch size 16"):
        trunk.init(jax.random.key(0), jnp.zeros((1, 24, 24, 3)), train=False)
    with pytest.raises(ValueError, match="Unknown trunk 'vit_enormous'.*vit_giant"):
        models.build_trunk(_model_config("vit_enormous"))


@pytest.fixture(scope="module")
def imported_file(tmp_path_factory):
    """A ViT-Tiny/8 for 32 px images, saved as DINO publishes its backbones (plain keys)."""
    net = _timm_vit(image_size=32, patch=8, seed=1)
    path = tmp_path_factory.mktemp("vit") / "dino_vit_tiny8.pth"
    torch.save(net.state_dict(), path)
    return str(path)


def _vit_eval_config(module, shared_dirs, path):
    config = module.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.data.image_size = 32
    config.model.update(_model_config("vit_tiny", patch=8, image_size=32))
    config.model.head_dims = (192, 64, 16)  # MoCo's head, randomly initialised
    config.init.checkpoint = path
    return config


# Slow tier: the kNN and linear engines on ViT taps run in CI in tests/evaluation (a DINO ViT
# workdir), and the import itself is checked against PyTorch in test_torch_import.py.
@pytest.mark.slow
def test_knn_and_linear_eval_on_an_imported_vit(imported_file, tmp_path_factory, tmp_path):
    shared_dirs = prepare_shared_dirs(tmp_path_factory)
    config = _vit_eval_config(knn_config, shared_dirs, imported_file)
    config.knn.layer = "concat_cls4"
    summary = knn_engine.run(config, str(tmp_path / "knn"))
    k = config.knn.ks[0]
    assert 0.0 <= summary[f"k{k}"]["top1"] <= summary[f"k{k}"]["top5"] <= 100.0

    config = _vit_eval_config(linear_eval_config, shared_dirs, imported_file)
    config.linear.layers = ("concat_cls4", "avgpool")
    config.linear.pool = ""
    summary = linear_eval.run(config, str(tmp_path / "linear"))
    with open(os.path.join(tmp_path / "linear", "results.json")) as f:
        results = json.load(f)
    assert set(results["layers"]) == {"concat_cls4", "avgpool"}
    # The frozen trunk is the file's, bit for bit, after the heads trained.
    expected = weights.read_torch(imported_file, config)["params"]["trunk"]
    trunk = jax.device_get(summary["trunk_variables"])["params"]["trunk"]
    jax.tree.map(np.testing.assert_array_equal, trunk, expected)


def test_sincos_position_embeddings_are_moco_v3s():
    """vits.py build_2d_sincos_position_embedding: zero for the class token; for the patch at
    (row i, column j) sin/cos of i * omega_k, then of j * omega_k, omega_k = 10000**(-k/(D/4))."""
    grid, dim = 3, 8
    pos = np.asarray(vit.sincos_pos_embed(grid, dim))
    assert pos.shape == (1, 1 + grid * grid, dim)
    np.testing.assert_array_equal(pos[0, 0], 0.0)
    omega = 1.0 / 10000.0 ** (np.arange(2) / 2)
    for i, j in [(0, 1), (2, 1), (1, 2)]:
        expected = np.concatenate(
            [np.sin(i * omega), np.cos(i * omega), np.sin(j * omega), np.cos(j * omega)]
        )
        np.testing.assert_allclose(pos[0, 1 + i * grid + j], expected, rtol=1e-6, atol=1e-6)

    from configs import mocov3
    from jssl import methods

    config = mocov3.get_config("")
    assert config.model.pos_embed_init == "sincos"
    method = methods.get(config, steps_per_epoch=10)
    assert ("trunk/pos_embed", 2**31 - 1) in method.frozen_params
    model = models.build_trunk(_model_config("vit_tiny", 16, 48))
    fixed = model.clone(pos_embed_init="sincos").init(
        jax.random.key(0), jnp.zeros((1, 48, 48, 3)), train=False
    )
    np.testing.assert_allclose(fixed["params"]["pos_embed"], vit.sincos_pos_embed(3, 192))


@pytest.mark.parametrize(
    "name", ["moco", "simclr", "swav", "byol", "barlow_twins", "vicreg", "supervised"]
)
def test_every_method_starts_on_a_vit_without_batch_norm(name):
    """A ViT trunk under a BN-free head has no batch_stats at all; every method's state must
    start from that (MoCo v2 on a ViT failed with KeyError 'batch_stats')."""
    import importlib

    from jssl import methods

    config = importlib.import_module(f"configs.{name}").get_config("test")
    m = config.model
    m.trunk, m.vit_depth, m.patch_size = "vit_tiny", 1, 8
    m.image_size = config.data.image_size
    m.head_bn = m.head_last_bn = False
    if m.head_dims:
        m.head_dims = (192, *tuple(m.head_dims)[1:])
    method = methods.get(config, steps_per_epoch=4)
    size = config.data.image_size
    fields = jax.eval_shape(
        method.init, jax.random.key(0), jnp.zeros((1, size, size, 3), jnp.float32)
    )
    assert fields["params"]["trunk"]["cls_token"].shape == (1, 1, 192)
    assert "trunk" not in fields.get("batch_stats", {})  # BYOL's predictor may keep its BN
