"""Throughput of jssl's kNN: weighted-kNN queries per second against a random bank.

    python benchmarks/knn.py                                    # 50k x 512 bank, 10k queries, k=200
    python benchmarks/knn.py --bank=1281167 --dim=2048 --queries=50000   # ImageNet-sized
    python benchmarks/knn.py --sharded      # the device-sharded bank of the monitor and run_knn

Default: ``evaluation.knn.knn_scores``, the host-side path of cached features (the bank streamed to
the device in chunks). ``--sharded``: ``evaluation.knn_sharded``, the bank built batch by batch on
the devices and each query batch reduced across them, as the kNN monitor and the on-the-fly
knn engine run it; the figure covers the top-k search and the vote, not building the bank.

The first call compiles; the figure is the best of ``--repeats`` timed calls after it,
measured end to end (host -> device transfer of the bank chunks, the scores back on host).
Each run prints its figure and writes it to benchmarks/results/knn[-sharded].json (``--results``,
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

from jssl import parallel  # noqa: E402
from jssl.evaluation import knn, knn_sharded  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bank", type=int, default=50_000, help="bank (train) rows")
    parser.add_argument("--dim", type=int, default=512, help="feature dimension")
    parser.add_argument("--queries", type=int, default=10_000, help="test rows")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--k", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--query-chunk", type=int, default=1024)
    parser.add_argument("--bank-chunk", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sharded", action="store_true", help="the device-sharded bank")
    parser.add_argument("--batch", type=int, default=256, help="--sharded: eval batch size")
    results.add_flags(parser)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    bank = rng.standard_normal((args.bank, args.dim), dtype=np.float32)
    labels = rng.integers(0, args.classes, args.bank)
    queries = rng.standard_normal((args.queries, args.dim), dtype=np.float32)

    if args.sharded:
        run = _sharded_run(args, bank, labels, queries)
    else:

        def run() -> np.ndarray:
            return knn.knn_scores(
                bank,
                labels,
                queries,
                num_classes=args.classes,
                k=args.k,
                temperature=args.temperature,
                query_chunk=args.query_chunk,
                bank_chunk=args.bank_chunk,
            )

    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run()  # returns numpy, so the device work is finished when it does
        times.append(time.perf_counter() - start)
    best = min(times)
    print(
        f"device={jax.devices()[0].device_kind} bank={args.bank}x{args.dim} "
        f"queries={args.queries} k={args.k} "
        + ("sharded bank: " if args.sharded else f"chunks={args.query_chunk}/{args.bank_chunk}: ")
        + f"first call {first:.2f}s (with compile), best {best:.3f}s, "
        f"{args.queries / best:,.0f} queries/s"
    )
    row = {
        "path": "sharded bank" if args.sharded else "host bank, chunked",
        "bank": f"{args.bank} x {args.dim}",
        "queries": args.queries,
        "k": args.k,
        "classes": args.classes,
        "first call s": results.rounded(first),
        "best s": results.rounded(best),
        "queries/s": results.rounded(args.queries / best),
    }
    if not args.sharded:
        row["chunks (query/bank)"] = f"{args.query_chunk}/{args.bank_chunk}"
    name = "knn-sharded" if args.sharded else "knn"
    results.record(name, [row], args=args, measures=results.summary(__doc__))


def _sharded_run(args, bank, labels, queries):
    """The sharded bank built once; the returned function answers every query batch."""
    mesh = parallel.make_mesh()
    batch = args.batch

    def batches(features, targets):
        for start in range(0, len(features) - batch + 1, batch):
            rows = slice(start, start + batch)
            yield parallel.host_batch_to_global(
                {"x": features[rows], "y": targets[rows], "m": np.ones(batch, bool)}, mesh
            )

    builder = knn_sharded.BankBuilder(mesh)
    for b in batches(bank, labels):
        builder.add(b["x"], b["y"], b["m"])
    sharded_bank = builder.finish()
    query_batches = list(batches(queries, np.zeros(len(queries), np.int64)))

    def run() -> None:
        for b in query_batches:
            sims, neighbours = knn_sharded.sharded_top_k(sharded_bank, b["x"], args.k)
            knn.vote_accuracy(
                sims,
                neighbours,
                np.zeros(len(sims), np.int64),
                num_classes=args.classes,
                k=args.k,
                temperature=args.temperature,
            )

    return run


if __name__ == "__main__":
    main()
