"""``jssl.train`` from Python: the train engine with the launcher's process set-up, on jssl's
pipeline or on the caller's own batches (which resume at their position in the epoch)."""

import jax
import numpy as np
import pytest
from support.runs import checkpoint_steps, load_checkpoint, make_config

import jssl
from jssl import data

pytestmark = pytest.mark.e2e  # the end-to-end tier (JSSL_E2E_TESTS=1)


def _pipeline_batches(config):
    """The batches jssl's own pipeline gives, as a caller's loader would: epoch -> batches."""

    def epoch_batches(epoch: int):
        dataset = data.build_train_dataset(
            config.data, seed=config.seed, epoch=epoch, process_index=0, process_count=1
        )
        return dataset.as_numpy_iterator()

    return epoch_batches


def _leaves(state):
    return jax.tree.leaves(jax.tree.map(np.asarray, state["params"]))


def test_own_batches_train_as_the_pipeline_does_and_resume(tmp_path, shared_dirs):
    overrides = {"knn.enabled": False, "num_epochs": 2, "checkpoint.every_steps": 2}
    config = make_config(shared_dirs, **overrides)
    steps = data.steps_per_epoch(config.data)
    reference = jssl.train(config, str(tmp_path / "pipeline"))
    assert reference["step"] == 2 * steps

    config = make_config(shared_dirs, **overrides)
    config.debug.max_steps = steps + 1  # stops mid-epoch 1; the rerun resumes there
    batches = _pipeline_batches(config)
    own = str(tmp_path / "own")
    jssl.train(config, own, batches=batches, steps_per_epoch=steps)
    assert checkpoint_steps(own)[-1] == steps + 1
    config = make_config(shared_dirs, **overrides)
    summary = jssl.train(config, own, batches=batches, steps_per_epoch=steps)
    assert summary["step"] == 2 * steps
    expected, _ = load_checkpoint(str(tmp_path / "pipeline"))
    actual, _ = load_checkpoint(own)
    for a, e in zip(_leaves(actual), _leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)


def test_own_batches_without_a_length_need_steps_per_epoch(tmp_path, shared_dirs):
    config = make_config(shared_dirs, **{"knn.enabled": False})
    with pytest.raises(ValueError, match="steps_per_epoch"):
        jssl.train(config, str(tmp_path / "run"), batches=lambda epoch: iter(()))
