"""Layer-wise learning-rate decay (``optim.layer_decay``, BEiT / MAE ``util/lr_decay.py``): the
layer ids and rate scales of a small ViT against a table written by hand and against MAE's
``get_layer_id_for_vit``, the rates and weight decay the real optimizer applies (MAE's no-decay
set: biases, norms, position embeddings, class token), composed with parameter groups, and the
errors for a trunk without ViT blocks and a decay out of range."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from configs import base
from configs import supervised as supervised_config
from jssl import methods, optim
from jssl.optim import groups


def _vit_params():
    """The parameter shapes of a supervised 2-block ViT-Tiny (4 px patches, 16 px)."""
    config = supervised_config.get_config("test")
    config.model.update(
        dict(trunk="vit_tiny", vit_depth=2, patch_size=4, image_size=16, head_dims=(192, 10))
    )
    method = methods.get(config)
    shapes = jax.eval_shape(method.init, jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3)))
    return shapes["params"]


def _flat(tree):
    return {"/".join(k): v for k, v in traverse_util.flatten_dict(tree).items()}


# Depth 2: the embeddings layer 0, block i layer i + 1, the rest (final norm, head) layer 3.
HAND_TABLE = {
    "trunk/patch_embed": 0,
    "trunk/cls_token": 0,
    "trunk/pos_embed": 0,
    "trunk/blocks_0": 1,
    "trunk/blocks_1": 2,
    "trunk/norm": 3,
    "head": 3,
}


def _hand_layer(name):
    return max((len(p), layer) for p, layer in HAND_TABLE.items() if name.startswith(p))[1]


def _mae_layer(name, num_layers):
    """MAE's get_layer_id_for_vit on the PyTorch name of a jssl path."""
    name = re.sub(r"blocks_(\d+)", r"blocks.\1", name.removeprefix("trunk/")).replace("/", ".")
    if name in ("cls_token", "pos_embed") or name.startswith("patch_embed"):
        return 0
    if name.startswith("blocks"):
        return int(name.split(".")[1]) + 1
    return num_layers


def test_layer_ids_and_scales_of_a_small_vit():
    params = _vit_params()
    ids, depth = groups.vit_layer_ids(params)
    assert depth == 2
    ids = _flat(ids)
    assert {name.split("/")[1] for name in ids if name.startswith("trunk")} >= {
        "patch_embed",
        "cls_token",
        "pos_embed",
        "blocks_0",
        "blocks_1",
        "norm",
    }
    scales = _flat(groups.layer_scales(params, 0.5))
    for name, layer in ids.items():
        assert layer == _hand_layer(name) == _mae_layer(name, depth + 1), name
        # MAE: layer_scales[i] = decay ** (num_layers - i), num_layers = depth + 1.
        assert scales[name] == 0.5 ** (depth + 1 - layer), name
    assert scales["trunk/pos_embed"] == 0.125 and scales["trunk/blocks_1/attn/qkv/kernel"] == 0.5
    assert scales["head/fc0/kernel"] == 1.0
    assert set(_flat(groups.layer_scales(params, 1.0)).values()) == {1.0}


def test_dinov2_tokens_are_layer_zero():
    # DINOv2's get_vit_lr_decay_rate: the mask token and the register tokens with the
    # embeddings; any other top-level part (a predictor) with the head.
    params = {
        "trunk": {
            "mask_token": 0,
            "register_tokens": 0,
            "blocks_0": {"ls1": {"gamma": 0}},
            "blocks_2": {"fc1": {"kernel": 0}},
        },
        "predictor": {"fc0": {"kernel": 0}},
    }
    ids, depth = groups.vit_layer_ids(params)
    assert depth == 3
    assert _flat(ids) == {
        "trunk/mask_token": 0,
        "trunk/register_tokens": 0,
        "trunk/blocks_0/ls1/gamma": 1,
        "trunk/blocks_2/fc1/kernel": 3,
        "predictor/fc0/kernel": 4,
    }


def _optim_config(**overrides):
    c = base.get_base_config().optim
    c.update(overrides)
    return c


def _one_update(optim_config, params, gradient):
    """One update of ``optim_config``'s optimizer at a constant rate 0.1, parameters all 1."""
    tx = optim.build_grouped_optimizer(optim_config, params, lambda step: 0.1, 256)
    ones = jax.tree.map(lambda s: jnp.ones(s.shape, jnp.float32), params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, gradient), ones)
    updates, _ = jax.jit(tx.update)(grads, tx.init(ones), ones)
    return _flat(jax.device_get(updates))


def test_each_layer_steps_at_its_scale_times_its_groups_rate():
    # SGD without momentum or decay: each update is -0.1 x scale x the group's multiplier.
    params = _vit_params()
    config = _optim_config(
        name="sgd",
        momentum=0.0,
        weight_decay=0.0,
        layer_decay=0.5,
        param_groups=(("trunk/pos_embed", 2.0), ("head", 10.0)),
    )
    scales = _flat(groups.layer_scales(params, 0.5))
    multiplier = {"trunk/pos_embed": 2.0, "head/fc0/kernel": 10.0, "head/fc0/bias": 10.0}
    for name, update in _one_update(config, params, 1.0).items():
        want = -0.1 * scales[name] * multiplier.get(name, 1.0)
        np.testing.assert_allclose(update, want, rtol=1e-6, err_msg=name)


def test_finetune_vit_decays_weights_only_and_at_each_layers_rate():
    # The finetune_vit preset's AdamW with no gradient: the update is the decoupled decay
    # -lr x scale x 0.05 x p, on MAE's decay set (not 1-D, not pos_embed / cls_token), else 0.
    params = _vit_params()
    config = supervised_config.get_config("finetune_vit").optim
    scales = _flat(groups.layer_scales(params, config.layer_decay))
    shapes = _flat(params)
    decayed = set()
    for name, update in _one_update(config, params, 0.0).items():
        if np.any(update != 0):
            decayed.add(name)
            want = -0.1 * scales[name] * 0.05
            np.testing.assert_allclose(update, want, rtol=1e-5, err_msg=name)
    mae = {
        n
        for n, s in shapes.items()
        if len(s.shape) > 1 and n.split("/")[-1] not in ("pos_embed", "cls_token")
    }
    assert decayed == mae
    assert "trunk/blocks_0/attn/qkv/kernel" in decayed and "trunk/norm/scale" not in decayed
    assert "trunk/blocks_1/fc2/bias" not in decayed and "trunk/pos_embed" not in decayed


def test_layer_decay_refuses_a_resnet_and_values_out_of_range():
    resnet = {"trunk": {"conv1": {"kernel": jnp.ones(2)}, "layer1_0": {}}, "head": {}}
    with pytest.raises(ValueError, match=r"optim.layer_decay < 1.*ViT trunks.*layer_decay=1.0"):
        optim.build_grouped_optimizer(_optim_config(layer_decay=0.75), resnet, lambda s: 0.1, 256)
    # Off (1.0) it builds, as any optimizer does.
    optim.build_grouped_optimizer(_optim_config(layer_decay=1.0), resnet, lambda s: 0.1, 256)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="optim.layer_decay=.* must lie in"):
            groups.layer_decay(_optim_config(layer_decay=bad))
