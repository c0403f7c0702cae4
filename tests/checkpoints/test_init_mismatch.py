"""A checkpoint whose trunk does not fit the configured model: the error names the first
mismatch, and the model flags recorded in the source workdir's config.json. States and
workdirs as in tests/test_init_weights.py."""

import os
import re
import shutil

import pytest
from test_init_weights import STEPS, make_config, make_sources, make_state

from jssl.checkpoints import run_config, warm_start, weights


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return make_sources(tmp_path_factory)


def test_first_trunk_mismatch_is_named(sources):
    config = make_config(width_multiplier=0.25, head_dims=(128, 32, 16))
    config.init.checkpoint = sources[0]
    fresh = make_state(config, seed=7)[0]
    expected = (
        r"(?s)does not fit the configured model.*width_multiplier=0.25.*first mismatch: "
        r"params/trunk/bn1/bias: checkpoint \(8,\), model \(16,\).*--config.model.*"
        r"--config.init.skip=\"\('trunk/bn1',\)\""
    )
    with pytest.raises(weights.WeightsError, match=expected) as error:
        warm_start.init_train_state(config, fresh)
    assert "config.json differs" not in str(error.value)  # the source workdir has none


def test_mismatch_names_the_flags_of_the_source_workdir(sources, tmp_path):
    """A workdir's config.json gives the exact flags that make the model fit, from the
    workdir itself or any checkpoint in it; fields that already match are not listed."""
    workdir = shutil.copytree(sources[0], tmp_path / "source")
    run_config.record_config(make_config(), str(workdir), resuming=True, force=False)
    config = make_config(width_multiplier=0.25, head_dims=(128, 32, 16))
    step_dir = os.path.join(workdir, "checkpoints", str(STEPS[-1]))
    flags = "--config.model.head_dims='(64, 32, 16)' --config.model.width_multiplier=0.125"
    for source in (str(workdir), step_dir):
        config.init.checkpoint = source
        # Only the trunk must fit a warm start: the trunk's fields alone.
        trunk_flag = "differs in: --config.model.width_multiplier=0.125\n"
        with pytest.raises(weights.WeightsError, match=re.escape(trunk_flag)):
            warm_start.init_train_state(config, make_state(config, seed=7)[0])
        with pytest.raises(weights.WeightsError, match=re.escape(f"differs in: {flags}")):
            weights.load_variables(source, config)


def test_a_deeper_trunk_does_not_pass_for_the_shallower_one(sources):
    """A deeper trunk has every array of the shallower one: the extra blocks must not pass."""
    config = make_config(trunk="resnet34")
    config.init.checkpoint = sources[0]
    with pytest.raises(weights.WeightsError, match=r"first mismatch: params/trunk/layer1_2/\S+ "):
        warm_start.init_train_state(config, make_state(config, seed=7)[0])
