"""Non-finite numbers with a cause other than the learning rate: batch norm over one example
per device is refused at start-up, and a NaN in the inputs is named by its examples, after the
state from before that step is saved."""

import re

import jax
import numpy as np
import pytest
from support.runs import checkpoint_steps, load_checkpoint, make_config

import jssl
from jssl import data, engines
from jssl.training import finite


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


def _own_batches(config, steps: int) -> list[dict]:
    dataset = data.build_train_dataset(
        config.data, seed=config.seed, epoch=0, process_index=0, process_count=1
    )
    return [batch for batch, _ in zip(dataset.as_numpy_iterator(), range(steps), strict=False)]


@pytest.mark.e2e
def test_a_nan_pixel_names_its_example_and_keeps_the_steps_before(tmp_path, shared_dirs):
    config = make_config(shared_dirs, **{"knn.enabled": False, "num_epochs": 1})
    steps = data.steps_per_epoch(config.data)
    assert steps >= 4
    batches = _own_batches(config, steps)
    broken = [dict(b) for b in batches]
    crops = np.array(broken[2]["crops"][0])
    crops[1, 0, 3, 3, 0] = np.nan  # one pixel of the second example of batch 2
    broken[2]["crops"] = (crops, *broken[2]["crops"][1:])
    bad_index = int(broken[2]["index"][1])

    workdir = str(tmp_path)
    with pytest.raises(finite.NonFiniteInputError) as info:
        jssl.train(config, workdir, batches=broken)
    message = str(info.value)
    assert re.search(rf"step 2 .*index {bad_index} \(positions 1 of the global batch\)", message)
    assert "base_lr" not in message and "checkpoint of step 2" in message, message
    # The two steps before it are saved, finite and resumable at the bad batch.
    assert checkpoint_steps(workdir) == [2]
    state, position = load_checkpoint(workdir, 2)
    assert int(state["step"]) == 2 and int(state["nonfinite_step"]) == -1
    assert (position["epoch"], position["step_in_epoch"]) == (0, 2)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state["params"]))

    # With the batch fixed, the same command resumes there and finishes the epoch.
    config = make_config(shared_dirs, **{"knn.enabled": False, "num_epochs": 1})
    summary = jssl.train(config, workdir, batches=batches)
    assert summary["step"] == steps
