"""Non-finite numbers with a cause other than the learning rate: batch norm over one example
per device is refused at start-up."""

import pytest
from support.runs import make_config

from jssl import engines


def _bn_head_vit(**overrides):
    """MoCo's test preset on a ViT (no batch norm in the trunk) with a batch-norm head."""
    config = make_config(("",), **{"model.trunk": "vit_tiny", "model.head_bn": True})
    config.model.head_last_bn = False
    config.model.vit_depth, config.model.head_dims = 1, (192, 32, 16)
    for key, value in overrides.items():
        section, field = key.split(".")
        config[section][field] = value
    return config


def test_batch_norm_over_one_example_per_device_is_refused():
    config = _bn_head_vit(**{"data.batch_size": 1})
    with pytest.raises(ValueError) as info:
        engines.validate(config)
    message = str(info.value)
    assert "data.batch_size=1" in message and "model.head_bn=True" in message
    assert "--config.data.batch_size=2" in message and "--config.model.head_bn=False" in message
    # With accumulation the micro-batch counts: 4 examples in 4 micro-batches.
    config = _bn_head_vit(**{"data.batch_size": 4, "optim.accumulation_steps": 4})
    with pytest.raises(ValueError, match=r"4 micro-batches .*batch_size=8 or more"):
        engines.validate(config)


def test_one_example_without_batch_norm_and_two_with_it_pass():
    engines.validate(_bn_head_vit(**{"data.batch_size": 1, "model.head_bn": False}))
    engines.validate(_bn_head_vit(**{"data.batch_size": 2}))
