"""Weight decay of a norm layer's bias: VISSL decays it only when ``regularize_bn`` and
``regularize_bias`` are both on (``_get_norm_optimizer_params`` in
``vissl/optimizers/param_groups/default.py``), its scale with ``regularize_bn`` alone."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from jssl import optim


def _params():
    return {
        "conv": {"kernel": jnp.ones(2), "bias": jnp.ones(2)},
        "bn1": {"scale": jnp.ones(2), "bias": jnp.ones(2)},
        "blocks_0": {"norm1": {"scale": jnp.ones(2), "bias": jnp.ones(2)}},
    }


@pytest.mark.parametrize("bn, bias", list(itertools.product([False, True], repeat=2)))
def test_norm_bias_needs_both_flags(bn, bias):
    mask = optim.weight_decay_mask(_params(), regularize_bn=bn, regularize_bias=bias)
    for norm in (mask["bn1"], mask["blocks_0"]["norm1"]):
        assert norm == {"scale": bn, "bias": bn and bias}
    assert mask["conv"] == {"kernel": True, "bias": bias}


def test_sgd_leaves_a_norm_bias_undecayed_without_regularize_bias():
    # Zero gradients, p = 1, lr 0.1, weight decay 0.5: a decayed leaf moves by -0.05.
    c = base.get_base_config().optim
    c.name, c.momentum, c.weight_decay = "sgd", 0.0, 0.5
    c.regularize_bn, c.regularize_bias = True, False
    params = _params()
    tx = optim.build_optimizer(c, params, lambda step: 0.1)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates = jax.tree.map(np.asarray, tx.update(zeros, tx.init(params), params)[0])
    np.testing.assert_allclose(updates["bn1"]["scale"], -0.05, rtol=1e-6)
    np.testing.assert_allclose(updates["bn1"]["bias"], 0.0)
    np.testing.assert_allclose(updates["conv"]["bias"], 0.0)
    np.testing.assert_allclose(updates["conv"]["kernel"], -0.05, rtol=1e-6)
