"""KoLeo as DINO's, iBOT's and MSN's optional term (jssl.methods.koleo): off in the papers'
presets, on in the ViT demos, ``koleo_crop<t>`` of each teacher crop's trunk output (DINO),
masked student class tokens (iBOT) or random-masked anchor's class token (MSN) when
``loss.weights.koleo`` is set, and its settings checked only then. DINOv2's always-on term:
tests/methods/test_dinov2.py."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import dino, ibot, msn
from jssl import data, losses, methods
from jssl.engines import train
from jssl.parallel import DATA_AXIS

KOLEO = ["koleo_crop0", "koleo_crop1"]


class _State(NamedTuple):
    """The fields of the TrainState a forward and an objective read."""

    step: jax.Array
    params: Any
    ema_params: Any
    method_state: Any
    batch_stats: Any
    ema_batch_stats: Any


def _names(config) -> list[str]:
    return [t.name for t in methods.loss_terms(config)]


@pytest.mark.parametrize(
    "module, preset, on",
    [
        (dino, "", False),
        (dino, "vit_small", False),
        (dino, "demo", False),
        (dino, "demo_vit", True),
        (ibot, "", False),
        (ibot, "demo", True),
        (msn, "", False),
        (msn, "demo", True),
    ],
)
def test_off_in_the_papers_presets_and_on_in_the_vit_demos(module, preset, on):
    config = module.get_config(preset)
    assert (config.loss.weights.koleo is not None) == on
    assert (_names(config)[-1].startswith("koleo_crop")) == on
    train.validate(config)


def _forward_and_objective(config, batch_size: int = 16):
    """The method's forward and objective on a synthetic batch, compiled with the data axis of
    one replica (vmap names it); the state as ``init`` makes it, at step 10."""
    method = methods.get(config, steps_per_epoch=4)
    batch = data.synthetic_batch(config.data, batch_size, seed=0)
    batch = jax.tree.map(jnp.asarray, {k: batch[k] for k in ("crops", "index")})
    size = int(config.data.augment.crop_sizes[0])
    v = jax.jit(method.init)(jax.random.key(0), jnp.zeros((1, size, size, 3)))
    state = _State(
        jnp.int32(10),
        v["params"],
        v["ema_params"],
        v["method_state"],
        v["batch_stats"],
        v["ema_batch_stats"],
    )

    def run(batch):
        out = method.forward(state.params, state, batch, jax.random.key(5), True)
        return out, method.objective(out.embeddings, state, batch, True)

    one = jax.tree.map(lambda x: x[None], batch)
    out = jax.jit(jax.vmap(run, axis_name=DATA_AXIS))(one)
    return jax.tree.map(lambda x: x[0], out)


def test_dino_koleo_of_the_trunk_output_of_each_teacher_crop():
    config = dino.get_config("test")
    config.loss.weights.koleo = 0.1
    config.method.koleo_group_size = 8
    train.validate(config)
    assert _names(config) == ["cross_entropy_crop0", "cross_entropy_crop1", *KOLEO]
    forward, objective = _forward_and_objective(config)
    tokens = forward.embeddings["tokens"]
    assert tokens.shape == (2, 16, forward.features.shape[-1])
    np.testing.assert_allclose(tokens[0], forward.features, rtol=1e-6)  # crop 0's pooled trunk
    for t in range(2):
        want = losses.koleo_losses(tokens[t], 8)
        np.testing.assert_allclose(objective.terms[f"koleo_crop{t}"], want, rtol=1e-5)
        assert float(want.std()) > 0
    weights = methods.get(config, steps_per_epoch=4).weights_at(jnp.int32(0))
    assert float(weights["koleo_crop1"]) == pytest.approx(0.1)  # share 1: DINOv2 sums crops
    assert float(weights["cross_entropy_crop0"]) == pytest.approx(0.5)


def test_ibot_koleo_of_the_masked_students_class_tokens():
    config = ibot.get_config("test")
    config.loss.weights.koleo = 0.1
    config.method.koleo_group_size = 0  # the whole batch
    config.model.drop_path_rate = 0.0
    train.validate(config)
    assert _names(config)[-2:] == KOLEO
    forward, objective = _forward_and_objective(config)
    tokens = forward.embeddings["cls_tokens"]
    assert tokens.shape == (2, 16, forward.features.shape[-1])
    for t in range(2):
        want = losses.koleo_losses(tokens[t], 0)
        np.testing.assert_allclose(objective.terms[f"koleo_crop{t}"], want, rtol=1e-5)
    # Off: no term and no class tokens carried.
    config.loss.weights.koleo = None
    forward, objective = _forward_and_objective(config)
    assert "cls_tokens" not in forward.embeddings
    assert not set(KOLEO) & set(objective.terms)


def test_msn_koleo_of_each_random_masked_anchors_class_token():
    config = msn.get_config("test")
    config.data.augment.num_crops = (3, 2)  # the target and two random-masked anchors
    config.loss.weights.koleo = 0.1
    config.method.koleo_group_size = 8
    train.validate(config)
    assert _names(config)[-2:] == ["koleo_crop1", "koleo_crop2"]
    forward, objective = _forward_and_objective(config)
    tokens = forward.embeddings["tokens"]
    assert tokens.shape == (2, 16, forward.features.shape[-1])
    assert float(jnp.abs(tokens[0] - tokens[1]).max()) > 0  # two anchors, two masks
    for c in (1, 2):
        want = losses.koleo_losses(tokens[c - 1], 8)
        np.testing.assert_allclose(objective.terms[f"koleo_crop{c}"], want, rtol=1e-5)
    # Focal anchors only (no crop of the target's size but the target): refused by name.
    config.data.augment.num_crops = (1, 2)
    with pytest.raises(ValueError, match="loss.weights.koleo=0.1: KoLeo spreads"):
        train.validate(config)


@pytest.mark.parametrize("module", [dino, ibot, msn])
def test_the_group_size_is_checked_only_with_the_term_on(module):
    config = module.get_config("test")
    config.method.koleo_group_size = 3  # does not divide the batch of 16
    train.validate(config)
    config.loss.weights.koleo = 0.1
    with pytest.raises(ValueError, match="koleo_group_size=3.*must divide data.batch_size=16"):
        train.validate(config)
