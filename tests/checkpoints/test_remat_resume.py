"""``model.remat`` changes memory only, so a run saved with ``remat=full`` resumes with
``remat=none``: the change is recorded in config_changes.json, not refused, and the resumed
state is the saved one. The CI tier holds the config rule; the whole resume (a remat step
compiled, a minute of CPU) is in the slow tier, and tests/models/test_remat.py holds that
remat gives the same parameters, gradients and outputs."""

import json
import os

import jax
import numpy as np
import pytest
from support.runs import checkpoint_steps, load_checkpoint, make_config

from jssl import engines
from jssl.checkpoints import run_config


def _config(shared_dirs, remat: str, max_steps: int):
    overrides = {"knn.enabled": False, "model.remat": remat, "debug.max_steps": max_steps}
    return make_config(shared_dirs, **overrides)


def test_a_change_of_remat_on_resume_is_recorded_not_refused(tmp_path):
    workdir = str(tmp_path)
    run_config.record_config(_config(("",), "full", 1), workdir, resuming=False, force=False)
    changed = _config(("",), "none", 1)
    lines = run_config.record_config(changed, workdir, resuming=True, force=False)
    assert lines == ['model.remat: "full" -> "none"']
    with open(os.path.join(workdir, "config_changes.json")) as f:
        (entry,) = json.load(f)
    assert entry["changes"] == {"model.remat": {"old": "full", "new": "none"}}
    assert entry["resuming"] and not entry["forced"]


@pytest.mark.slow  # the rule: the test above; remat's same parameters: tests/models/test_remat.py
def test_a_remat_full_checkpoint_resumes_with_remat_none(tmp_path, shared_dirs):
    workdir = str(tmp_path)
    engines.run(_config(shared_dirs, "full", 1), workdir)
    saved, _ = load_checkpoint(workdir, 1)

    # Resumed at its own step: nothing trains (no second compilation), and the state restored
    # into remat=none's model is the one saved.
    summary = engines.run(_config(shared_dirs, "none", 1), workdir)
    assert summary["step"] == 1
    restored = jax.device_get(summary["state"])
    for name in ("params", "batch_stats", "opt_state", "ema_params"):
        actual, expected = getattr(restored, name), saved[name]
        for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(a, e, err_msg=name)
    with open(os.path.join(workdir, "config_changes.json")) as f:
        (entry,) = json.load(f)
    assert entry["changes"] == {"model.remat": {"old": "full", "new": "none"}}
    assert not entry["forced"] and checkpoint_steps(workdir) == [1]
