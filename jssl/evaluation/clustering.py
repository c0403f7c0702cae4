"""k-means on the devices over frozen features, scored against the labels (NMI, ARI and
Hungarian-matched accuracy).

Lloyd's k-means as ``sklearn.cluster.KMeans`` runs it (k-means++ or random init, restarts
keeping the lowest inertia, its tolerance rule on the centroids' shift), with a final
assignment pass so that labels and inertia belong to the final centroids. The features are one
global array with rows sharded over the mesh's ``data`` axis; each device assigns its rows in
chunks and the cluster sums are ``psum``-ed (``jax.shard_map``), so nothing larger than
``(K, d)`` is replicated. Every draw is keyed by the seed, the restart and the global row
(Gumbel-max), so the initial centroids are the same on any number of devices. Unlike
scikit-learn: plain k-means++ D^2 sampling (Arthur & Vassilvitskii 2007) without its greedy
local trials, and an empty cluster keeps its centroid. More: docs/evaluation.md, "k-means
clustering".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jssl import parallel
from jssl.evaluation import knn
from jssl.parallel import DATA_AXIS

INITS = ("k-means++", "random")
_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass
class KMeansResult:
    centroids: np.ndarray  # (K, d) float32, in the space clustered (normalised if asked)
    assignments: np.ndarray  # (n,) int32
    inertia: float  # sum of squared distances to the assigned centroids
    iterations: int
    converged: bool
    restart: int  # the restart kept (lowest inertia, the first of equals)
    inertias: list[float]  # every restart's final inertia


@dataclasses.dataclass
class ShardedRows:
    """Rows padded to whole chunks on every device, sharded ``P("data")``."""

    x: jax.Array  # (N, d) float32
    valid: jax.Array  # (N,) bool; padding rows False
    num_rows: int  # the real rows, the first num_rows of x
    chunk: int  # rows per assignment chunk on one device


def shard_rows(
    features: np.ndarray, mesh: Mesh, *, normalize: bool, chunk_rows: int
) -> ShardedRows:
    """``features`` (n, ...) as a data-sharded global array; each process reads only the rows
    of its own devices (a memory-mapped file stays on disk otherwise)."""
    n = len(features)
    flat = features.reshape(n, -1)
    devices = mesh.devices.size
    chunk = max(1, min(chunk_rows, math.ceil(n / devices)))
    total = math.ceil(n / (devices * chunk)) * devices * chunk
    sharding = NamedSharding(mesh, P(DATA_AXIS))

    def rows(index):
        sl = index[0]
        start, stop = sl.start or 0, total if sl.stop is None else sl.stop
        out = np.zeros((stop - start, flat.shape[1]), np.float32)
        real = max(0, min(stop, n) - start)
        out[:real] = flat[start : start + real]
        return out

    x = jax.make_array_from_callback((total, flat.shape[1]), sharding, rows)
    valid = jax.make_array_from_callback(
        (total,), sharding, lambda index: np.arange(total)[index] < n
    )
    if normalize:
        x = jax.jit(knn.l2_normalize, out_shardings=sharding)(x)
    return ShardedRows(x, valid, n, chunk)


def _sq_dists(x: jax.Array, centroids: jax.Array) -> jax.Array:
    """Squared Euclidean distances (m, K), clipped at 0 against rounding."""
    cross = jnp.matmul(x, centroids.T, precision=_HIGHEST)
    d2 = jnp.sum(x * x, 1, keepdims=True) - 2.0 * cross + jnp.sum(centroids**2, 1)[None]
    return jnp.maximum(d2, 0.0)


@functools.lru_cache(maxsize=16)
def _assign_fn(mesh: Mesh, chunk: int, scatter: bool | None = None):
    """(x, valid, centroids) -> (sums (K, d), counts (K,), inertia, assignments (N,)).

    The cluster sums are a scatter-add on CPUs (O(n d); ``scatter`` None: by the mesh's
    platform) and a one-hot matmul (O(n K d)) on accelerators, where scatter-adds are atomic
    and their float order, hence the result, would vary from run to run."""
    if scatter is None:
        scatter = mesh.devices.flat[0].platform == "cpu"

    def per_device(x, valid, centroids):
        k = centroids.shape[0]
        xs = x.reshape(-1, chunk, x.shape[1])
        vs = valid.reshape(-1, chunk)

        def body(carry, inputs):
            sums, counts, inertia = carry
            xc, vc = inputs
            d2 = _sq_dists(xc, centroids)
            a = jnp.argmin(d2, axis=1).astype(jnp.int32)
            if scatter:
                sums = sums + jax.ops.segment_sum(xc * vc[:, None], a, num_segments=k)
                counts = counts + jax.ops.segment_sum(vc.astype(jnp.float32), a, num_segments=k)
            else:
                w = jax.nn.one_hot(a, k, dtype=jnp.float32) * vc[:, None]
                sums = sums + jnp.matmul(w.T, xc, precision=_HIGHEST)
                counts = counts + w.sum(0)
            inertia = inertia + jnp.sum(jnp.where(vc, jnp.min(d2, axis=1), 0.0))
            return (sums, counts, inertia), a

        zeros = (jnp.zeros_like(centroids), jnp.zeros((k,), jnp.float32), jnp.zeros(()))
        (sums, counts, inertia), a = jax.lax.scan(body, zeros, (xs, vs))
        total = jax.lax.psum((sums, counts, inertia), DATA_AXIS)
        return (*total, a.reshape(-1))

    return jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(DATA_AXIS), P(DATA_AXIS), P()),
            out_specs=(P(), P(), P(), P(DATA_AXIS)),
            check_vma=False,  # the psum-ed totals are the same on every device
        )
    )


def _row_gumbel(key: jax.Array, rows: jax.Array) -> jax.Array:
    """Gumbel noise of each global row index: the same draw on any number of devices."""
    return jax.vmap(lambda r: jax.random.gumbel(jax.random.fold_in(key, r)))(rows)


def _global_argmax(score: jax.Array, rows: jax.Array) -> jax.Array:
    """The global row of the largest ``score`` over all devices (the lowest row of ties)."""
    local = jnp.argmax(score)
    best = jax.lax.all_gather(score[local], DATA_AXIS)
    row = jax.lax.all_gather(rows[local], DATA_AXIS)
    top = jnp.max(best)
    return jnp.min(jnp.where(best == top, row, jnp.iinfo(jnp.int32).max))


@functools.lru_cache(maxsize=16)
def _init_fn(mesh: Mesh, k: int, init: str):
    """(x, valid, key) -> (K, d) initial centroids."""

    def per_device(x, valid, key):
        m = x.shape[0]
        rows = jax.lax.axis_index(DATA_AXIS) * m + jnp.arange(m, dtype=jnp.int32)

        def row_of(row):  # the row's features, from the device that holds it
            local = row - rows[0]
            mine = (local >= 0) & (local < m)
            value = jax.lax.dynamic_index_in_dim(x, jnp.clip(local, 0, m - 1), keepdims=False)
            return jax.lax.psum(jnp.where(mine, value, 0.0), DATA_AXIS)

        def uniform(i):  # a uniform draw among the valid rows
            noise = _row_gumbel(jax.random.fold_in(key, i), rows)
            return _global_argmax(jnp.where(valid, noise, -jnp.inf), rows)

        if init == "random":  # k distinct rows: one draw at a time, drawn rows excluded

            def draw(i, state):
                centroids, taken = state
                noise = _row_gumbel(jax.random.fold_in(key, i), rows)
                row = _global_argmax(jnp.where(valid & ~taken, noise, -jnp.inf), rows)
                return centroids.at[i].set(row_of(row)), taken | (rows == row)

            state = (jnp.zeros((k, x.shape[1]), x.dtype), jnp.zeros((m,), bool))
            return jax.lax.fori_loop(0, k, draw, state)[0]

        first = row_of(uniform(0))
        d2 = jnp.sum((x - first) ** 2, axis=1)

        def step(i, state):  # k-means++: the next centre with probability ~ D^2
            centroids, d2 = state
            logits = jnp.where(valid & (d2 > 0), jnp.log(jnp.where(d2 > 0, d2, 1.0)), -jnp.inf)
            noise = _row_gumbel(jax.random.fold_in(key, i), rows)
            any_left = jax.lax.pmax(jnp.any(jnp.isfinite(logits)).astype(jnp.int32), DATA_AXIS)
            # Fewer distinct points than clusters: the rest are drawn uniformly.
            score = jnp.where(any_left > 0, logits + noise, jnp.where(valid, noise, -jnp.inf))
            centre = row_of(_global_argmax(score, rows))
            return centroids.at[i].set(centre), jnp.minimum(d2, jnp.sum((x - centre) ** 2, 1))

        centroids = jnp.zeros((k, x.shape[1]), x.dtype).at[0].set(first)
        return jax.lax.fori_loop(1, k, step, (centroids, d2))[0]

    return jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(DATA_AXIS), P(DATA_AXIS), P()),
            out_specs=P(),
            check_vma=False,  # every device computes the same centroids
        )
    )


@jax.jit
def _mean_variance(x: jax.Array, valid: jax.Array) -> jax.Array:
    """The mean over dimensions of the per-dimension variance of the valid rows."""
    w = valid.astype(x.dtype)[:, None]
    count = jnp.sum(w)
    mean = jnp.sum(x * w, 0) / count
    return jnp.mean(jnp.sum(((x - mean) ** 2) * w, 0) / count)


def initial_centroids(
    data: ShardedRows, num_clusters: int, *, seed: int, restart: int = 0, init: str = "k-means++"
) -> jax.Array:
    """The (K, d) initial centroids of one restart, replicated, keyed by (seed, restart)."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed), restart)
    return _init_fn(data.x.sharding.mesh, num_clusters, init)(data.x, data.valid, key)


def kmeans(
    data: ShardedRows,
    num_clusters: int,
    *,
    seed: int,
    restarts: int = 3,
    max_iters: int = 300,
    tol: float = 1e-4,
    init: str = "k-means++",
) -> KMeansResult:
    """Lloyd's k-means of ``data`` with ``restarts`` initialisations keyed by ``seed``."""
    if init not in INITS:
        raise ValueError(f"init={init!r} is not one of {INITS}.")
    if not 1 <= num_clusters <= data.num_rows:
        raise ValueError(f"{num_clusters} clusters of {data.num_rows} rows: need 1 <= K <= n.")
    mesh = data.x.sharding.mesh
    assign = _assign_fn(mesh, data.chunk)
    threshold = float(tol * _mean_variance(data.x, data.valid))
    best = None
    inertias = []
    for restart in range(restarts):
        centroids = initial_centroids(data, num_clusters, seed=seed, restart=restart, init=init)
        previous = None
        converged, iterations = False, 0
        while iterations < max_iters and not converged:
            iterations += 1
            sums, counts, _, labels = assign(data.x, data.valid, centroids)
            new = jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts, 1)[:, None], centroids)
            shift = float(jnp.sum((new - centroids) ** 2))
            same = previous is not None and bool(jnp.all(labels == previous))
            centroids, previous = new, labels
            converged = same or shift <= threshold
        _, _, inertia, labels = assign(data.x, data.valid, centroids)
        inertias.append(float(inertia))
        if best is None or inertias[-1] < best[0]:
            best = (inertias[-1], restart, centroids, labels, iterations, converged)
    inertia, restart, centroids, labels, iterations, converged = best
    return KMeansResult(
        centroids=np.asarray(parallel.global_to_host(centroids)),
        assignments=np.asarray(parallel.global_to_host(labels))[: data.num_rows],
        inertia=inertia,
        iterations=iterations,
        converged=converged,
        restart=restart,
        inertias=inertias,
    )


def assign(data: ShardedRows, centroids: np.ndarray) -> tuple[np.ndarray, float]:
    """(nearest centroid of each row, inertia): held-out rows assigned to fitted centroids."""
    mesh = data.x.sharding.mesh
    replicated = jax.device_put(np.asarray(centroids, np.float32), NamedSharding(mesh, P()))
    _, _, inertia, labels = _assign_fn(mesh, data.chunk)(data.x, data.valid, replicated)
    return np.asarray(parallel.global_to_host(labels))[: data.num_rows], float(inertia)


def hungarian_accuracy(labels: np.ndarray, clusters: np.ndarray) -> float:
    """Accuracy (%) of the one-to-one matching of clusters to classes that agrees with the most
    examples (``linear_sum_assignment`` on the cluster x class contingency table)."""
    from scipy.optimize import linear_sum_assignment

    labels, clusters = np.asarray(labels), np.asarray(clusters)
    table = np.zeros((clusters.max() + 1, labels.max() + 1), np.int64)
    np.add.at(table, (clusters, labels), 1)
    rows, cols = linear_sum_assignment(table, maximize=True)
    return 100.0 * float(table[rows, cols].sum()) / len(labels)


def cluster_scores(labels: np.ndarray, clusters: np.ndarray) -> dict[str, Any]:
    """NMI (scikit-learn's arithmetic normalisation), ARI and Hungarian accuracy (%) of
    ``clusters`` against ``labels``."""
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    return {
        "nmi": 100.0 * float(normalized_mutual_info_score(labels, clusters)),
        "ari": 100.0 * float(adjusted_rand_score(labels, clusters)),
        "accuracy": hungarian_accuracy(labels, clusters),
        "num_examples": int(len(labels)),
    }
