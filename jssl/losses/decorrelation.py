"""Decorrelation losses: Barlow Twins' cross-correlation and VICReg's variance/covariance
terms, every batch statistic over the global batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jssl.losses._util import (
    _num_replicas,
    _psum,
    _standardize,
)


def barlow_twins_terms(
    view1: jax.Array,
    view2: jax.Array,
    *,
    normalize_jointly: bool = True,
    eps: float = 1e-5,
    axis_name: str | None = None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Barlow Twins' two terms (Zbontar et al. 2021, Eq. 1; VISSL
    vissl/losses/barlow_twins_loss.py ``BarlowTwinsCriterion``), unweighted.

    The embeddings are standardised per feature over the GLOBAL batch (mean and biased
    variance, ``(z - mean) / sqrt(var + eps)``, VISSL's ``SyncNormalizeFunction``), and the
    cross-correlation of the two views is ``C = sum_b a_b b_b^T / N`` over the N images of the
    global batch (VISSL: each rank's ``a^T b / n`` averaged over ranks). The terms are

      invariance            sum_i (1 - C_ii)^2           (on-diagonal)
      redundancy_reduction  sum_{i != j} C_ij^2          (off-diagonal)

    and VISSL's loss is ``scale_loss * (invariance + lambda_ * redundancy_reduction)``.

    Every sum over the batch is a ``psum`` over ``axis_name``, in two passes (the mean first,
    then centred squares; VISSL uses E[z^2] - E[z]^2 in one), so the value and its gradient
    are those of the global batch on any number of devices.

    Args:
      view1, view2: (n, d) embeddings of this replica's n images, aligned.
      normalize_jointly: True (VISSL): one mean and variance over the 2N rows of both views,
        as VISSL normalises the concatenated batch of both copies; False (the paper's
        code, ``BatchNorm1d(affine=False)`` on each view): separate statistics per view.
      eps: added to the variance (VISSL's criterion and BatchNorm1d: 1e-5).
      axis_name: the mesh axis the batch is sharded on, or None on one device.

    Returns:
      ``terms``: {"invariance", "redundancy_reduction"}, each the batch-level value broadcast
      to the (n,) local rows; ``metrics``: the mean diagonal and the root-mean-square
      off-diagonal entry of C.
    """
    a = view1.astype(jnp.float32)
    b = view2.astype(jnp.float32)
    n, d = a.shape
    if b.shape != a.shape:
        raise ValueError(f"barlow_twins_terms: view shapes differ, {a.shape} vs {b.shape}.")
    if normalize_jointly:
        both = _standardize(jnp.concatenate([a, b]), eps, axis_name)
        a, b = both[:n], both[n:]
    else:
        a, b = _standardize(a, eps, axis_name), _standardize(b, eps, axis_name)
    total = n * _num_replicas(axis_name)
    corr = _psum(a.T @ b, axis_name) / total  # (d, d)
    diagonal = jnp.diagonal(corr)
    off_diagonal = jnp.where(jnp.eye(d, dtype=bool), 0.0, corr)
    invariance = jnp.sum(jnp.square(1.0 - diagonal))
    redundancy = jnp.sum(jnp.square(off_diagonal))
    terms = {
        "invariance": jnp.broadcast_to(invariance, (n,)),
        "redundancy_reduction": jnp.broadcast_to(redundancy, (n,)),
    }
    metrics = {
        "cross_corr_diagonal": jnp.mean(diagonal),
        "cross_corr_off_diagonal_rms": jnp.sqrt(redundancy / max(d * (d - 1), 1)),
    }
    return terms, metrics


def vicreg_terms(
    view1: jax.Array,
    view2: jax.Array,
    *,
    std_target: float = 1.0,
    std_eps: float = 1e-4,
    axis_name: str | None = None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """VICReg's three terms (Bardes et al. 2022, Sec. 3.1-3.2, Eqs. 1-6), unweighted, as the
    authors' code computes them (facebookresearch/vicreg, main_vicreg.py ``VICReg.forward``).

      invariance  per image: mean over features of (z - z')^2 (the MSE, Eq. 5, is its mean)
      variance    (v(Z) + v(Z')) / 2, v(Z) = mean_j max(0, gamma - sqrt(Var(z^j) + eps)),
                  the unbiased variance over the global batch (Eq. 1)
      covariance  c(Z) + c(Z'), c(Z) = sum_{i != j} Cov(Z)_ij^2 / d, the covariance over the
                  global batch with N - 1 (Eqs. 3-4)

    The variance term halves the sum of both views as the authors' code does (the paper's
    Eq. 6 adds them; its weights 25/25/1 go with the code). Means and covariances are sums
    over every replica (``psum`` over ``axis_name``; the code gathers the embeddings), so the
    value and gradient are those of the global batch on any number of devices.

    Args:
      view1, view2: (n, d) expander outputs of this replica's n images, aligned.
      std_target: gamma, the standard deviation the hinge asks for (1).
      std_eps: added to the variance under the square root (1e-4).
      axis_name: the mesh axis the batch is sharded on, or None on one device.

    Returns:
      ``terms``: {"invariance": (n,) per image, "variance" and "covariance": batch-level
      values broadcast to the (n,) rows}; ``metrics``: ``embedding_std``, the mean standard
      deviation of a feature (both views), which collapse drives to 0.
    """
    x = view1.astype(jnp.float32)
    y = view2.astype(jnp.float32)
    n, d = x.shape
    if y.shape != x.shape:
        raise ValueError(f"vicreg_terms: view shapes differ, {x.shape} vs {y.shape}.")
    total = n * _num_replicas(axis_name)

    def variance_and_covariance(z):
        centred = z - _psum(jnp.sum(z, axis=0), axis_name) / total
        cov = _psum(centred.T @ centred, axis_name) / (total - 1)  # (d, d)
        var = jnp.diagonal(cov)
        variance = jnp.mean(jax.nn.relu(std_target - jnp.sqrt(var + std_eps)))
        covariance = jnp.sum(jnp.square(jnp.where(jnp.eye(d, dtype=bool), 0.0, cov))) / d
        return variance, covariance, jnp.mean(jnp.sqrt(jax.lax.stop_gradient(var)))

    var_x, cov_x, std_x = variance_and_covariance(x)
    var_y, cov_y, std_y = variance_and_covariance(y)
    terms = {
        "invariance": jnp.mean(jnp.square(x - y), axis=1),
        "variance": jnp.broadcast_to((var_x + var_y) / 2.0, (n,)),
        "covariance": jnp.broadcast_to(cov_x + cov_y, (n,)),
    }
    return terms, {"embedding_std": (std_x + std_y) / 2.0}
