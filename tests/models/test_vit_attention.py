"""model.attention (jssl/models/vit.py): the token padding that cuDNN's flash attention needs
(a multiple of 8, the padded keys masked in every block, the padding sliced off before the
taps) changes nothing, run here on XLA's implementation on CPU: the same taps and parameter
gradients as the unpadded trunk, for odd token counts with registers, ``keep``, ``mask``,
stochastic depth and remat; "auto" is XLA on CPU and a bad value names the field."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jssl import models
from jssl.models import vit

# 24 px images in 8 px patches: 9 patches + the class token = 10 tokens (197 at 224 px / 16).
IMAGES = jax.random.normal(jax.random.PRNGKey(1), (3, 24, 24, 3))


def _trunk(pad: int, **options) -> vit.VisionTransformer:
    return vit.VisionTransformer(
        embed_dim=32,
        depth=3,
        num_heads=2,
        patch_size=8,
        image_size=24,
        attention="xla",
        pad_tokens_to=pad,
        **options,
    )


def _taps_and_grads(trunk: vit.VisionTransformer, variables, **call):
    """The trunk's taps in training and the gradient of a loss that reads every tap."""

    def loss(params):
        taps = trunk.apply({"params": params}, IMAGES, train=True, **call)
        return sum(jnp.sum(jnp.sin(tap)) for tap in taps.values()), taps

    (_, taps), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])
    return taps, grads


@pytest.mark.parametrize(
    ("options", "call", "tokens"),
    [
        ({}, {}, 10),
        ({"num_registers": 3, "drop_path_rate": 0.5, "remat": "full"}, {"row_keys": True}, 13),
        ({"mask_token": True}, {"mask": True}, 10),
        ({}, {"keep": True}, 5),
    ],
    ids=["plain", "registers_droppath_remat", "mask", "keep"],
)
def test_padded_tokens_give_the_unpadded_taps_and_gradients(options, call, tokens):
    call = dict(call)
    if "row_keys" in call:
        call["row_keys"] = jax.random.split(jax.random.PRNGKey(2), len(IMAGES))
    if "mask" in call:
        call["mask"] = jax.random.bernoulli(jax.random.PRNGKey(3), 0.5, (len(IMAGES), 9))
    if "keep" in call:
        call["keep"] = jnp.asarray([[0, 4, 8, 2], [1, 2, 3, 5], [8, 7, 6, 0]], jnp.int32)
    plain, padded = _trunk(1, **options), _trunk(8, **options)
    variables = plain.init(jax.random.PRNGKey(0), IMAGES[:1], train=False)
    # The padded trunk's attention does see a sequence padded to the next multiple of 8.
    shapes = {k: v for k, v in call.items() if k != "row_keys"}
    _, seen = padded.apply(
        variables, IMAGES, False, capture_intermediates=True, mutable=["intermediates"], **shapes
    )
    width = seen["intermediates"]["blocks_0"]["attn"]["__call__"][0].shape[1]
    assert width == -(-tokens // 8) * 8
    want_taps, want_grads = _taps_and_grads(plain, variables, **call)
    taps, grads = _taps_and_grads(padded, variables, **call)
    assert taps.keys() == want_taps.keys()
    for name in want_taps:
        assert taps[name].shape == want_taps[name].shape, name
        np.testing.assert_allclose(taps[name], want_taps[name], rtol=1e-5, atol=1e-5, err_msg=name)
    # Float rounding of sums over the leaf's entries: relative to the leaf's largest entry.
    jax.tree.map(
        lambda got, want: np.testing.assert_allclose(
            got, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max())
        ),
        grads,
        want_grads,
    )


def test_unmasked_padding_would_change_the_outputs():
    """The mask is what keeps the padding out: the same padded keys let through change a
    block's real tokens (so the test above would catch a lost ``key_value_seq_lengths``)."""
    tokens = jax.random.normal(jax.random.PRNGKey(5), (3, 10, 32))  # a block's input
    padded, lengths = vit.pad_tokens(tokens, 8)
    assert padded.shape[1] == 16 and lengths.tolist() == [10] * len(IMAGES)
    block = vit.Block(num_heads=2)
    block_vars = block.init(jax.random.PRNGKey(4), tokens, False)
    want = block.apply(block_vars, tokens, False)
    masked = block.apply(block_vars, padded, False, None, lengths)[:, :10]
    unmasked = block.apply(block_vars, padded, False)[:, :10]
    np.testing.assert_allclose(masked, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(unmasked, want, rtol=1e-3, atol=1e-3)
    same, none = vit.pad_tokens(padded, 8)  # already a multiple: left as it is
    assert same is padded and none is None


def test_auto_is_xla_on_cpu_and_bad_values_name_the_field():
    config = models.default_config()
    config.trunk, config.vit_depth, config.patch_size, config.image_size = "vit_tiny", 1, 8, 24
    assert config.attention == "auto"
    assert jax.default_backend() == "cpu"
    assert models.build_vit(config).attention == "xla"
    config.dtype = "bfloat16"
    assert models.build_vit(config).attention == "xla"  # no GPU here, whatever the dtype
    config.attention = "cudnn"
    assert models.build_vit(config).attention == "cudnn"
    config.dtype = "float32"
    with pytest.raises(ValueError, match=r"model\.attention='cudnn'.*model\.dtype=bfloat16"):
        models.build_vit(config)
    config.attention = "flash"
    with pytest.raises(ValueError, match=r"model\.attention='flash'.*'auto'.*'xla'.*'cudnn'"):
        models.build_vit(config)
    with pytest.raises(ValueError, match="attention='auto'"):
        vit.VisionTransformer(attention="auto").init(jax.random.PRNGKey(0), IMAGES[:1])
