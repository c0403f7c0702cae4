"""Throughput of the linear grid, SVM, low-shot and k-means evaluators on random features.

    python benchmarks/evaluators.py            # all three, sizes for 2 CPU cores (minutes)
    python benchmarks/evaluators.py --only=kmeans --kmeans_rows=1281167 --kmeans_clusters=1000
    python benchmarks/evaluators.py --only=svm --svm_classes=20 --svm_dim=8192   # VOC07 res5
    python benchmarks/evaluators.py --only=kmeans --sklearn   # and sklearn's Lloyd iteration
    python benchmarks/evaluators.py --only=linear --linear_grids=1x1,5x1,5x2

What runs is the evaluators' own code on clustered Gaussian features of ImageNet-like width
(2048 dims, ResNet-50's avgpool):

- ``svm``: ``jssl.evaluation.svm.train_and_test`` (VISSL's protocol: per class, every cost
  cross-validated 3-fold, the chosen one refit, then the test AP) on a VOC07-sized split
  (5,011 train, 4,952 test by default). Figure: train features per second of the whole
  protocol, and the mean time of one LinearSVC fit (costs x (folds + 1) fits per class).
- ``low_shot``: ``jssl.evaluation.low_shot.evaluate`` on the same split, one sample per k.
  Figure: sampled train features per second (k x classes rows per sample).
- ``kmeans``: ``jssl.evaluation.clustering`` with the features sharded over the devices.
  Figures: features per second of one Lloyd iteration (``clustering.assign``: distances,
  assignments, cluster sums and counts, the labels to the host; the best of ``--repeats``
  calls after a compiling one) and the seconds of the k-means++ initialisation;
  ``--sklearn`` times ``sklearn.cluster.KMeans`` from the same centroids with
  ``max_iter=1`` (one Lloyd iteration and its final labelling pass) on the host too.

- ``linear``: ``jssl.evaluation.linear``'s train step (the identity as the trunk) for grids of
  learning rates x weight decays, one layer of ``--linear_dim`` features and
  ``--linear_classes`` classes. Figure: training features per second after a compiling step
  (the best of ``--repeats`` passes), and against one head (the grid shares the trunk forward
  and the data pass; its heads cost what they cost).

Each run prints its figures and writes benchmarks/results/evaluators.json (``--results``,
``--no_results``) with the command and the machine (benchmarks/results.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import results  # benchmarks/, beside this script

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from configs import linear_eval as linear_eval_config  # noqa: E402
from jssl import parallel  # noqa: E402
from jssl.evaluation import clustering, linear, linear_grid, low_shot, svm  # noqa: E402


def _features(n: int, dim: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Class-clustered Gaussian features (so SVMs and k-means have structure to find): the
    class centres are the same for every ``seed``, the noise is the seed's."""
    centres = np.random.default_rng(0).standard_normal((classes, dim), dtype=np.float32)
    rng = np.random.default_rng(seed + 1)
    labels = np.arange(n) % classes
    x = np.empty((n, dim), np.float32)
    for start in range(0, n, 65536):  # in blocks: ImageNet-sized arrays without a 2x peak
        rows = slice(start, min(n, start + 65536))
        x[rows] = centres[labels[rows]] * 0.04  # classes overlap, as real features do
        x[rows] += rng.standard_normal((len(labels[rows]), dim), dtype=np.float32)
    return x, labels


def _import_sklearn() -> None:
    """Imported before the clocks start: the evaluators import scikit-learn on first use."""
    import sklearn.model_selection  # noqa: F401
    import sklearn.svm  # noqa: F401


def _svm_row(args) -> dict:
    x, y = _features(args.svm_train, args.svm_dim, args.svm_classes, 0)
    xt, yt = _features(args.svm_test, args.svm_dim, args.svm_classes, 1)
    settings = svm.Settings(costs=tuple(args.costs), workers=args.workers)
    start = time.perf_counter()
    out = svm.train_and_test(
        svm.SplitFeatures(x, y, np.arange(len(y))),
        svm.SplitFeatures(xt, yt, np.arange(len(yt))),
        settings,
        args.svm_classes,
    )
    seconds = time.perf_counter() - start
    fits = args.svm_classes * len(settings.costs) * (settings.cross_val_folds + 1)
    print(
        f"svm: {args.svm_train} train / {args.svm_test} test x {args.svm_dim} dims, "
        f"{args.svm_classes} classes, {len(settings.costs)} costs: {seconds:.1f} s, "
        f"{args.svm_train / seconds:,.0f} train features/s, {seconds / fits * 1e3:.0f} ms per "
        f"fit, top-1 {svm.top1(out['scores'], yt):.1f}%"
    )
    return {
        "evaluator": "svm",
        "shape": f"{args.svm_train}+{args.svm_test} x {args.svm_dim}, {args.svm_classes} classes",
        "settings": f"{len(settings.costs)} costs x 3 folds, {args.workers} worker(s)",
        "seconds": results.rounded(seconds),
        "features/s": results.rounded(args.svm_train / seconds),
        "ms per fit": results.rounded(seconds / fits * 1e3),
    }


def _low_shot_row(args) -> dict:
    x, y = _features(args.svm_train, args.svm_dim, args.svm_classes, 0)
    xt, yt = _features(args.svm_test, args.svm_dim, args.svm_classes, 1)
    settings = svm.Settings(costs=tuple(args.costs), workers=args.workers)
    start = time.perf_counter()
    low_shot.evaluate(
        svm.SplitFeatures(x, y, np.arange(len(y))),
        svm.SplitFeatures(xt, yt, np.arange(len(yt))),
        settings,
        ks=tuple(args.ks),
        num_samples=1,
    )
    seconds = time.perf_counter() - start
    sampled = sum(args.ks) * args.svm_classes
    print(
        f"low-shot: k in {tuple(args.ks)}, 1 sample, {args.svm_classes} classes: "
        f"{seconds:.1f} s, {sampled / seconds:,.0f} sampled train features/s"
    )
    return {
        "evaluator": "low_shot",
        "shape": f"k in {tuple(args.ks)} x {args.svm_classes} classes x {args.svm_dim} dims, "
        f"{args.svm_test} test",
        "settings": f"{len(settings.costs)} costs, 1 sample, cross-validated",
        "seconds": results.rounded(seconds),
        "features/s": results.rounded(sampled / seconds),
    }


def _kmeans_rows(args) -> list[dict]:
    n, k = args.kmeans_rows, args.kmeans_clusters
    x, _ = _features(n, args.kmeans_dim, k, 2)
    mesh = parallel.make_mesh()
    data = clustering.shard_rows(x, mesh, normalize=True, chunk_rows=args.chunk_rows)
    jax.block_until_ready(data.x)

    def best(fn, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - start)
        return min(times)

    def init():
        return clustering.initial_centroids(data, k, seed=0)

    centroids = init()  # compiles
    init_s = best(init, 1)
    clustering.assign(data, centroids)  # compiles
    per_iter = best(lambda: clustering.assign(data, centroids), args.repeats)
    devices = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    print(
        f"k-means: {n} x {args.kmeans_dim}, {k} clusters on {devices}: "
        f"{per_iter:.3f} s per Lloyd iteration ({n / per_iter:,.0f} features/s), "
        f"k-means++ initialisation {init_s:.2f} s"
    )
    rows = [
        {
            "evaluator": "kmeans (jssl, sharded)",
            "shape": f"{n} x {args.kmeans_dim}, {k} clusters",
            "devices": devices,
            "s per iteration": results.rounded(per_iter),
            "features/s": results.rounded(n / per_iter),
            "k-means++ init s": results.rounded(init_s),
        }
    ]
    if args.sklearn:
        from sklearn.cluster import KMeans

        normed = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        start_centroids = np.asarray(centroids)

        def sk_iteration():  # one Lloyd iteration from the same centroids, then its labels
            KMeans(k, init=start_centroids, n_init=1, max_iter=1, tol=0.0).fit(normed)

        sk_iteration()  # thread pools and BLAS warm up
        sk_iter = best(sk_iteration, args.repeats)
        print(f"sklearn KMeans: {sk_iter:.3f} s per iteration ({n / sk_iter:,.0f} features/s)")
        rows.append(
            {
                "evaluator": "kmeans (sklearn, host)",
                "shape": f"{n} x {args.kmeans_dim}, {k} clusters",
                "devices": f"{os.cpu_count()} CPU cores",
                "s per iteration": results.rounded(sk_iter),
                "features/s": results.rounded(n / sk_iter),
                "k-means++ init s": None,
            }
        )
    return rows


def _linear_throughput(args, lrs: int, wds: int) -> float:
    config = linear_eval_config.get_config("")
    config.linear.layers, config.linear.num_classes = ("x",), args.linear_classes
    config.linear.lrs = tuple(0.001 * 3**i for i in range(lrs))
    config.linear.weight_decays = tuple(5e-4 * i for i in range(wds))
    config.data.batch_size = batch = args.linear_batch
    heads = linear.LinearHeads(("x",), args.linear_classes, bn_axis_name=parallel.DATA_AXIS)
    shapes = {"x": (args.linear_dim,)}
    sample = linear.sample_features(shapes)
    params = jax.eval_shape(lambda: heads.init(jax.random.PRNGKey(0), sample, train=False))
    grid = linear_grid.Grid.from_config(config)
    grid_opt = linear_grid.GridOptimizer(config, grid, params["params"], args.linear_rows // batch)
    mesh = parallel.make_mesh()
    state = jax.jit(
        lambda: linear.init_state(heads, grid_opt, shapes, jax.random.PRNGKey(0)),
        out_shardings=parallel.replicated(mesh),
    )()
    step = linear.make_train_step(heads, grid_opt, mesh, lambda trunk, x: x)
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((args.linear_rows, args.linear_dim), dtype=np.float32)
    labels = rng.integers(0, args.linear_classes, args.linear_rows).astype(np.int32)
    batches = [
        parallel.host_batch_to_global(
            {"inputs": {"x": feats[i : i + batch]}, "label": labels[i : i + batch]}, mesh
        )
        for i in range(0, args.linear_rows - batch + 1, batch)
    ]
    state, metrics = step(state, {}, batches[0])  # compiles
    jax.block_until_ready(metrics)
    best = 0.0
    for _ in range(args.repeats):
        start = time.perf_counter()
        for b in batches:
            state, metrics = step(state, {}, b)
        jax.block_until_ready((state.params, metrics))
        best = max(best, len(batches) * batch / (time.perf_counter() - start))
    return best


def _linear_rows(args) -> list[dict]:
    rows, one = [], None
    for spec in args.linear_grids.split(","):
        lrs, wds = (int(v) for v in spec.split("x"))
        fps = _linear_throughput(args, lrs, wds)
        one = one or fps
        print(
            f"linear grid {lrs}x{wds} ({lrs * wds} heads) on {args.linear_rows} x "
            f"{args.linear_dim}, {args.linear_classes} classes, batch {args.linear_batch}: "
            f"{fps:,.0f} features/s ({fps / one:.2f}x the first grid's)"
        )
        rows.append(
            {
                "evaluator": "linear",
                "shape": f"{args.linear_rows} x {args.linear_dim}, {args.linear_classes} classes",
                "settings": f"grid {lrs} lrs x {wds} weight decays, batch {args.linear_batch}",
                "features/s": results.rounded(fps),
                "vs first grid": results.rounded(fps / one),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only", default="linear,svm,low_shot,kmeans", help="comma-separated subset"
    )
    parser.add_argument("--svm_train", type=int, default=5011, help="VOC07 trainval's size")
    parser.add_argument("--svm_test", type=int, default=4952, help="VOC07 test's size")
    parser.add_argument("--svm_dim", type=int, default=2048)
    parser.add_argument("--svm_classes", type=int, default=5, help="VOC07 has 20")
    parser.add_argument("--costs", type=float, nargs="+", default=[0.1, 1.0, 10.0])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--workers", type=int, default=1, help="SVM worker processes")
    parser.add_argument("--kmeans_rows", type=int, default=20_000)
    parser.add_argument("--kmeans_dim", type=int, default=2048)
    parser.add_argument("--kmeans_clusters", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls; the best counts")
    parser.add_argument("--chunk_rows", type=int, default=4096)
    parser.add_argument("--sklearn", action="store_true", help="also time sklearn's KMeans")
    parser.add_argument("--linear_rows", type=int, default=4096)
    parser.add_argument("--linear_dim", type=int, default=2048)
    parser.add_argument("--linear_classes", type=int, default=1000)
    parser.add_argument("--linear_batch", type=int, default=256)
    parser.add_argument("--linear_grids", default="1x1,5x1,5x2", help="lrs x weight decays")
    results.add_flags(parser)
    args = parser.parse_args()
    only = {name.strip() for name in args.only.split(",")}
    unknown = only - {"linear", "svm", "low_shot", "kmeans"}
    if unknown:
        parser.error(f"--only: unknown {sorted(unknown)}; use linear, svm, low_shot, kmeans")

    _import_sklearn()
    rows = []
    if "linear" in only:
        rows.extend(_linear_rows(args))
    if "svm" in only:
        rows.append(_svm_row(args))
    if "low_shot" in only:
        rows.append(_low_shot_row(args))
    if "kmeans" in only:
        rows.extend(_kmeans_rows(args))
    results.record("evaluators", rows, args=args, measures=results.summary(__doc__))


if __name__ == "__main__":
    main()
