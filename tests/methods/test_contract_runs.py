"""Each registered method trained end to end on its "test" preset (8 steps, a test phase on
test[:40] after epoch 2), the test phase's written outputs bounded per method. The contract
itself, step by step, is test_contract.py's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pytest
from support.launch import scalar_values
from test_contract import ROWS, _config

from jssl import methods
from jssl.engines import train


class Run(NamedTuple):
    """A run end to end (8 steps, a test phase on test[:40] after epoch 2).

    overrides: config fields set for the run. loss_range: (low, high) bounds of every
    per-example test loss, exclusive where ``strict``; None: a positive mean. loss_term: the
    written term equal to the per-example loss (one term at weight 1). check: ``(config,
    summary, outputs dir, workdir)`` for what only this method has.
    """

    overrides: dict[str, Any] = {}
    loss_range: tuple[float, float] | None = None
    strict: bool = True
    loss_term: str | None = None
    check: Any = None


def _simclr_run(config, summary, outputs, workdir):
    for leaf in np.asarray(summary["state"].params["head"]["fc1"]["kernel"]).ravel()[:5]:
        assert np.isfinite(leaf)


def _barlow_twins_run(config, summary, outputs, workdir):
    assert "bias" not in summary["state"].params["head"]["fc1"]  # VISSL's use_bias False
    for term in ("invariance", "redundancy_reduction"):
        assert np.all(np.isfinite(np.load(outputs / f"term_{term}.npy")))


def _vicreg_run(config, summary, outputs, workdir):
    # The test phase feeds the same centre crop as both views: no invariance cost.
    np.testing.assert_allclose(np.load(outputs / "term_invariance.npy"), 0.0, atol=1e-6)


def _swav_run(config, summary, outputs, workdir):
    per_example = np.load(outputs / "per_example_loss.npy")
    embeddings = np.load(outputs / "embeddings.npy")
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-4)
    # Each assignment crop's term per example, and their mean (the loss at default weights).
    crop0, crop1 = (np.load(outputs / f"term_swapped_prediction_crop{a}.npy") for a in (0, 1))
    np.testing.assert_allclose(0.5 * crop0 + 0.5 * crop1, per_example, rtol=1e-6)
    np.testing.assert_allclose(
        np.load(outputs / "term_swapped_prediction.npy"), per_example, rtol=1e-6
    )
    # The test phase feeds the centre crop as every crop: both crops' targets are the same.
    np.testing.assert_allclose(crop0, crop1, rtol=1e-4)
    logdir = workdir / "tensorboard"
    for tag in (
        "loss/swapped_prediction_crop0",
        "loss/swapped_prediction_crop1_weighted",
        "loss_weight/swapped_prediction_crop1",
        "loss/swapped_prediction",
        "test/loss/swapped_prediction_crop0",
    ):
        assert scalar_values(logdir, tag), tag
    assert set(scalar_values(logdir, "loss_weight/swapped_prediction_crop0").values()) == {0.5}


def _deepclusterv2_run(config, summary, outputs, workdir):
    memory = summary["state"].method_state
    # 64 examples in 4 batches: every row written in epoch 1, clustered at its start.
    np.testing.assert_array_equal(np.asarray(memory["bank_epoch"]), 1)
    assignments = np.asarray(memory["assignments"])
    assert assignments.shape == (2, 64) and assignments.min() >= 0
    assert np.all(assignments < np.array(config.method.num_clusters)[:, None])


def _dino_run(config, summary, outputs, workdir):
    assert np.load(outputs / "features.npy").shape[0] == 40


def _mae_run(config, summary, outputs, workdir):
    # The test phase's features: the class token of the whole (unmasked) crop.
    assert np.load(outputs / "features.npy").shape == (40, 192)


RUNS = {
    "simclr": Run(
        # Multi-crop: 2 crops at 16 px and 2 at 8 px (VISSL multicrop_simclr_info_nce_loss).
        overrides={
            "data.augment.num_crops": (2, 2),
            "data.augment.crop_sizes": (16, 8),
            "data.augment.crop_scale": ((0.2, 1.0), (0.05, 0.2)),
        },
        check=_simclr_run,
    ),
    # Identical centre-crop views in the test phase: 2 - 2 cos per direction, in [0, 8].
    "byol": Run(loss_range=(0, 8), strict=False, loss_term="regression"),
    # 2T * two cross-entropies over the 16 keys of a test batch, each at most about
    # 2 / T + log 16 for unit vectors.
    "mocov3": Run(loss_range=(0, 2 * 0.2 * 2 * (2 / 0.2 + np.log(16))), loss_term="info_nce"),
    "simsiam": Run(loss_range=(-1, 1), strict=False, loss_term="negative_cosine"),
    "barlow_twins": Run(check=_barlow_twins_run),
    "vicreg": Run(check=_vicreg_run),
    "swav": Run(overrides={"log_every_steps": 4}, check=_swav_run),
    # Per crop and head at most 2 / T + log K (unit vectors, T 0.1, K 8).
    "deepclusterv2": Run(
        loss_range=(0, 2 / 0.1 + np.log(8)),
        loss_term="cluster_prediction",
        check=_deepclusterv2_run,
    ),
    "dino": Run(loss_term="cross_entropy", check=_dino_run),
    "ibot": Run(),
    "dinov2": Run(),
    "msn": Run(),
    # The reconstruction of the masked patches (and the method's TensorBoard pictures).
    "mae": Run(loss_term="reconstruction", check=_mae_run),
}
# The methods whose run with a test phase is tested elsewhere.
RUN_ELSEWHERE = {
    "moco": "tests/training/test_train.py (test_phase_writes_validation_loss)",
    "supervised": "the ``pretrained`` fixture of tests/methods/test_supervised.py",
}


def test_every_method_has_a_run():
    assert not set(RUNS) & set(RUN_ELSEWHERE)
    assert set(RUNS) | set(RUN_ELSEWHERE) == set(methods.METHODS)


# Slow tier (JSSL_SLOW_TESTS=1): runs whose method adds nothing to the engine's path that the
# CI runs lack (MAE's pictures; MoCo and supervised elsewhere); their step is in
# test_contract.py and their loss ranges are checked here. For the CI's time, also the runs
# whose additions CI tests elsewhere: DINO's (a ViT run in test_dino.py), SwAV's multi-crop and
# queue (test_parallel.py's swav row, over several steps on 1 and 4 devices), DeepCluster v2's
# epoch-start k-means (test_deepclusterv2.py) and Barlow Twins' terms (test_barlow_twins.py).
SLOW_RUNS = (
    "simclr",
    "byol",
    "mocov3",
    "simsiam",
    "vicreg",
    "ibot",
    "dinov2",
    "msn",
    "dino",
    "swav",
    "deepclusterv2",
    "barlow_twins",
)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.slow) if name in SLOW_RUNS else name
        for name in methods.METHODS
        if name in RUNS
    ],
)
def test_trains_end_to_end(name, tmp_path, shared_dirs):
    row, expect = ROWS[name], RUNS[name]
    config = _config(name)
    config.update_from_flattened_dict(expect.overrides)
    config.data.data_dir = shared_dirs[0]
    config.checkpoint.async_save = False
    config.test_every_epochs = 2
    config.data.test_split = "test[:40]"
    summary = train.run(config, str(tmp_path))
    assert summary["step"] == 8
    state = summary["state"]
    if not row.teacher:
        assert state.ema_params == {}
    if not row.method_state:
        assert state.method_state == {}
    outputs = tmp_path / "eval" / "epoch_2"
    np.testing.assert_array_equal(np.load(outputs / "inds.npy"), np.arange(40))
    losses = np.load(outputs / "per_example_loss.npy")
    assert losses.shape == (40,) and np.all(np.isfinite(losses))
    if expect.loss_range is None:
        assert losses.mean() > 0
    elif expect.strict:
        assert np.all((losses > expect.loss_range[0]) & (losses < expect.loss_range[1]))
    else:
        assert np.all((losses >= expect.loss_range[0]) & (losses <= expect.loss_range[1]))
    specs = methods.loss_terms(config)
    for term in {t.name for t in specs} | {t.family for t in specs}:
        written = np.load(outputs / f"term_{term}.npy")
        assert written.shape == (40,) and np.all(np.isfinite(written)), term
    if expect.loss_term is not None:
        written = np.load(outputs / f"term_{expect.loss_term}.npy")
        np.testing.assert_allclose(written, losses, rtol=1e-6)
    if expect.check is not None:
        expect.check(config, summary, outputs, tmp_path)
