"""SimCLR's presets and start-up checks. Its loss (global negatives, gradients through the
gather) is tested in test_losses*.py, its step on 1 vs 4 devices in test_parallel.py, the
contract in test_contract.py and a multi-crop run end to end in test_contract_runs.py."""

import pytest

from configs import simclr
from jssl import methods


def test_presets_follow_vissl():
    config = simclr.get_config()
    assert config.optim.name == "larc" and config.data.batch_size == 4096
    assert config.model.head_dims == (2048, 2048, 128) and not config.model.head_bn


def test_bad_settings_name_the_field():
    config = simclr.get_config("test")
    config.method.temperature = 0.0
    with pytest.raises(ValueError, match="method.temperature=0.0"):
        methods.check_config(config)
    config = simclr.get_config("test")
    config.data.augment.num_crops = (1,)
    with pytest.raises(ValueError, match=r"num_crops=\(1,\)"):
        methods.check_config(config)
