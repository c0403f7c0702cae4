"""The mask token, a trunk leaf only training uses (``weights.TRAINING_ONLY``), between an iBOT
trunk and trunks built without it, and the advice a trunk mismatch gives when the model
already is its workdir's. Sources are random states of the "test" presets saved with their
config.json (no compiled init or step), as in tests/checkpoints/test_init_weights.py."""

import logging

import numpy as np
import pytest
from test_init_weights import _messages, make_state, save_workdir

from configs import extract_features, ibot, supervised
from jssl.checkpoints import run_config, source_model, warm_start, weights


def _saved(tmp_path_factory, config) -> tuple[str, dict]:
    """A workdir of ``config`` holding one random state, and that state's params."""
    config.optim.weight_decay_schedule = "constant"  # make_state's optimizer has no run length
    state = make_state(config, seed=3)[0]
    workdir = save_workdir(tmp_path_factory.mktemp(config.method.name), {2: state})
    run_config.record_config(config, workdir, resuming=True, force=False)
    return workdir, state.params


@pytest.fixture(scope="module")
def ibot_source(tmp_path_factory):
    return _saved(tmp_path_factory, ibot.get_config("test"))


def _finetune(source: str, **explicit):
    """configs/supervised.py:test fine-tuning the trunk of ``source``, as its finetune
    presets do (``init.trunk_from_checkpoint``), with ``explicit`` model fields."""
    config = supervised.get_config("test")
    config.init.checkpoint, config.init.trunk_from_checkpoint = source, True
    config.model.update(explicit)
    source_model.adopt(config, "", explicit=[f"model.{name}" for name in explicit])
    return config


def test_an_evaluation_reads_an_ibot_trunk_without_its_mask_token(ibot_source, caplog):
    caplog.set_level(logging.INFO)
    source, saved = ibot_source
    config = extract_features.get_config("test")
    config.init.checkpoint = source
    source_model.adopt(config, "")
    trunk = weights.load_variables(source, config, trunk_only=True)["params"]["trunk"]
    assert "mask_token" not in trunk
    np.testing.assert_array_equal(np.asarray(trunk["cls_token"]), saved["trunk"]["cls_token"])
    assert "Not reading params/trunk/mask_token" in _messages(caplog)


def test_a_fine_tune_loads_an_ibot_trunk_without_its_mask_token(ibot_source, caplog):
    caplog.set_level(logging.INFO)
    source, saved = ibot_source
    config = _finetune(source)
    state = warm_start.init_train_state(config, make_state(config, seed=7)[0])
    trunk = np.asarray(state.params["trunk"]["blocks_1"]["fc1"]["kernel"])
    np.testing.assert_array_equal(trunk, saved["trunk"]["blocks_1"]["fc1"]["kernel"])
    assert "mask_token" not in state.params["trunk"]
    assert "params/trunk/mask_token" in _messages(caplog, logging.WARNING)  # named as unused


def test_ibot_starts_from_a_trunk_without_a_mask_token(tmp_path_factory, ibot_source):
    """iBOT warm-started from a ViT trained without masking (a supervised ViT here): the
    trunk loads and the mask token keeps its fresh init."""
    vit = _finetune(ibot_source[0])
    vit.init.checkpoint, vit.init.trunk_from_checkpoint = "", False
    source, saved = _saved(tmp_path_factory, vit)
    config = ibot.get_config("test")
    config.init.checkpoint = source
    config.optim.weight_decay_schedule = "constant"
    fresh = make_state(config, seed=7)[0]
    state = warm_start.init_train_state(config, fresh)
    np.testing.assert_array_equal(
        np.asarray(state.params["trunk"]["cls_token"]), saved["trunk"]["cls_token"]
    )
    np.testing.assert_array_equal(
        np.asarray(state.params["trunk"]["mask_token"]), fresh.params["trunk"]["mask_token"]
    )


def test_a_trunk_mismatch_names_trunk_flags_and_no_impossible_skip(ibot_source):
    """A fine-tune whose explicit vit_depth misfits: the hint gives the trunk's flag alone
    (not the fine-tune's own head_dims or drop_path_rate), and no init.skip of a block the
    configured model does not have (init.skip would refuse it)."""
    config = _finetune(ibot_source[0], vit_depth=1)
    with pytest.raises(weights.WeightsError) as error:
        warm_start.init_train_state(config, make_state(config, seed=7)[0])
    message = str(error.value)
    assert "first mismatch: params/trunk/blocks_1/" in message
    assert "differs in: --config.model.vit_depth=2" in message
    assert "head_dims" not in message.split("differs in")[1], message
    assert "drop_path_rate" not in message, message
    assert "init.skip" not in message, message


def test_no_flag_is_advised_when_the_model_already_is_the_workdirs(tmp_path_factory):
    """A checkpoint whose trunk is not what its config.json records (here: saved with 3
    blocks, recorded with 2): the engines already use the recorded fields, so the error says
    no model flag helps instead of advising the config.json's model, which is in effect."""
    deeper = ibot.get_config("test")
    deeper.model.vit_depth = 3
    deeper.optim.weight_decay_schedule = "constant"
    state = make_state(deeper, seed=3)[0]
    workdir = save_workdir(tmp_path_factory.mktemp("relabelled"), {2: state})
    run_config.record_config(ibot.get_config("test"), workdir, resuming=True, force=False)
    config = extract_features.get_config("test")
    config.init.checkpoint = workdir
    source_model.adopt(config, "")
    with pytest.raises(weights.WeightsError) as error:
        weights.load_variables(workdir, config, trunk_only=True)
    message = str(error.value)
    assert "params/trunk/blocks_2/" in message and "mask_token" not in message
    assert "already holds the trunk fields of its workdir's config.json" in message
    assert "trained with" not in message and "differs in" not in message
