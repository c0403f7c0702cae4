"""VICReg (Bardes et al. 2022, "VICReg: Variance-Invariance-Covariance Regularization for
Self-Supervised Learning"), as the paper and its authors' code train it
(facebookresearch/vicreg, main_vicreg.py and augmentations.py). VISSL has no VICReg.

Per step: each view goes through the online network (trunk, then the bias-free expander) in
its own forward pass, as the authors' code does, so train-mode batch norm normalises each view
on its own. Three terms (``jssl.losses.vicreg_terms``): ``invariance``, the mean squared
distance of an image's two embeddings; ``variance``, a hinge keeping each feature's standard
deviation over the global batch at 1; ``covariance``, the squared off-diagonal covariances
over the global batch; weighted by ``loss.weights`` (the paper's 25, 25, 1). No teacher, no
queue, nothing to update after the step.

Recipe and deliberate differences: docs/methods.md#vicreg.
"""

from __future__ import annotations

import ml_collections

from jssl import losses
from jssl.methods import Method, Objective, single_network
from jssl.methods.barlow_twins import check_two_views_and_weights
from jssl.parallel import DATA_AXIS

TERMS = ("invariance", "variance", "covariance")


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    mcfg = config.method

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        terms, metrics = losses.vicreg_terms(
            embeddings[0],
            embeddings[1],
            std_target=mcfg.std_target,
            std_eps=mcfg.std_eps,
            axis_name=DATA_AXIS,
        )
        return Objective(terms=terms, metrics=metrics)

    # Each view in its own forward pass, as the authors' code.
    return single_network.method(config, objective, per_view=True)


def check_config(config: ml_collections.ConfigDict) -> None:
    """Start-up checks that would otherwise fail deep inside the step (or silently)."""
    check_two_views_and_weights(config, "VICReg", "25, 25 and 1")
    mcfg = config.method
    if mcfg.std_target <= 0:
        raise ValueError(
            f"method.std_target={mcfg.std_target} must be positive: it is the standard "
            "deviation the variance term asks of each feature (the paper's gamma: 1.0)."
        )
    if mcfg.std_eps <= 0:
        raise ValueError(
            f"method.std_eps={mcfg.std_eps} must be positive: it keeps the square root of a "
            "zero variance differentiable (the paper: 1e-4)."
        )
