"""A workdir trained on grain is evaluated on grain: feature extraction and a linear head over
the frozen trunk read the demo data through grain's worker-free threads, each split once."""

import numpy as np
import pytest

from configs import extract_features, linear_eval, moco
from jssl import engines


@pytest.mark.e2e
def test_train_extract_and_linear_eval_on_grain(tmp_path):
    config = moco.get_config("test")
    config.data.update(dict(loader="grain", workers=0, train_subset=32))
    config.num_epochs, config.checkpoint.async_save = 1, False
    workdir = str(tmp_path / "train")
    summary = engines.run(config, workdir)
    assert summary["step"] >= 1 and np.isfinite(summary["loss"])

    extract = extract_features.get_config("test")
    extract.data.update(dict(loader="grain", workers=0))
    extract.init.checkpoint = workdir
    extract.extract.layers = ("avgpool",)
    extract.extract.splits = ("train[:24]", "test[:20]")
    out = engines.run(extract, str(tmp_path / "features"))
    for split, count in (("train[:24]", 24), ("test[:20]", 20)):
        assert out[split]["num_examples"] == count
        inds = np.load(f"{out[split]['directory']}/avgpool_inds.npy")
        assert sorted(inds.tolist()) == list(range(count))

    linear = linear_eval.get_config("test")
    linear.data.update(dict(loader="grain", workers=0))
    linear.init.checkpoint = workdir
    results = engines.run(linear, str(tmp_path / "linear"))
    assert results, results
