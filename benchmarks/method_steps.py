"""Every method's train step at its ImageNet recipe's shapes on one accelerator: images/s, MFU,
peak memory, compile time (first, and from the persistent compilation cache), the cost of
augmenting on the device, and the largest per-device batch that fits (MoCo v2 ResNet-50, DINO
ViT-B/16).

Compiling is the host's work and takes most of a short GPU session, so the steps are first
compiled all at once, one process each (``--parallel`` at a time), into a persistent
compilation cache (``JAX_COMPILATION_CACHE_DIR``); each step is then timed alone in its own
process (benchmarks/step_child.py), which loads its program from that cache: its 'cache s' is
what a second launch of the same run pays. 'first compile s' was measured with the other
compilations running beside it, so it overstates a lone first launch.

The largest batch: each candidate batch is compiled (not run) and XLA's plan of its device
memory (arguments + outputs - aliased + temporaries) compared with the device's allocator limit;
the largest candidate that fits by the plan is then run for a few steps, which shows it fits.

  python benchmarks/method_steps.py --count=flops.json     # XLA's counts, on a CPU first
  python benchmarks/method_steps.py --flops=flops.json       # every row (an accelerator)
  python benchmarks/method_steps.py --pairs=moco:r18_32_b64 --fits= --steps=3   # CPU smoke run

Rows are written to ``--partial`` as they finish, so that a run cut short keeps what it timed;
the results file is written at the end (benchmarks/results.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import mfu  # benchmarks/, beside this script
import results
import step_child
from step_cases import CASES
from train_step import _line

# (method, case): ResNet-50 methods at 224 px, batch 256 per GPU (SwAV and DINO with their
# small crops); the ViT methods on ViT-S/16 at batch 128 (2 + 10 crops where the recipe has
# local crops), MAE on ViT-B/16 at 64 (its recipe: 4096 over 64 GPUs).
PAIRS = (
    "moco:r50_224_b256,simclr:r50_224_b256,byol:r50_224_b256,swav:r50_224_b256,"
    "simsiam:r50_224_b256,barlow_twins:r50_224_b256,vicreg:r50_224_b256,"
    "supervised:r50_224_b256,deepclusterv2:r50_224_b256,mocov3:vit_s16_224_b128,"
    "dino:vit_s16_224_b128,ibot:vit_s16_224_b128,msn:vit_s16_224_b128,mae:vit_b16_224_b64,"
    "dinov2:vit_s16_224_b128,dino:vit_b16_224_b64"
)
FITS = "moco:r50_224_b256:2048/3072/4096,dino:vit_b16_224_b64:256/320/384"
QUEUE = 65536  # MoCo v2's ImageNet queue


def spawn(job: dict, cache_dir: str, parallel: bool = False, timeout: float = 600) -> dict:
    """Runs ``job`` in step_child.py with the compilation cache; a failure (or no result in
    ``timeout`` seconds) returns its error, and a rerun tries the job again."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", JAX_COMPILATION_CACHE_DIR=cache_dir)
    env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.update(JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    if parallel:  # processes sharing the device: none may take most of its memory up front
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    try:
        out = step_child.launch(job, env, timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no result in {timeout} s"}
    if out.returncode:
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        return {"error": (lines[-1] if lines else f"exit {out.returncode}")[:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _job(method: str, case: str, dtype: str, steps: int, **extra) -> dict:
    return dict(
        impl="jssl", case=case, dtype=dtype, steps=steps, method=method, queue=QUEUE, **extra
    )


def compile_all(jobs: dict[str, dict], cache_dir: str, parallel: int) -> dict[str, dict]:
    """Compiles every job (compile_only), ``parallel`` processes at a time, into the cache.
    What each gave is kept in ``cache_dir``/compiled.json: a rerun compiles only the rest."""
    path = os.path.join(cache_dir, "compiled.json")
    done = {}
    if os.path.exists(path):
        with open(path) as f:
            done = {k: v for k, v in json.load(f).items() if "error" not in v}
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        futures = {
            pool.submit(spawn, dict(job, compile_only=True), cache_dir, True): key
            # The longest first (the ViTs' and the large batches'), so that no long one is last.
            for key, job in sorted(
                jobs.items(), key=lambda kv: "vit" not in kv[0] and "@" not in kv[0]
            )
            if key not in done
        }
        for future in concurrent.futures.as_completed(futures):
            key = futures[future]
            done[key] = future.result()
            print(f"compiled {key}: {json.dumps(done[key])[:300]}", flush=True)
            with open(path, "w") as f:
                json.dump(done, f)
    return done


def _row(method: str, case: str, dtype: str, batch: int, r: dict, first: dict) -> dict:
    """One table row from a timed child's result ``r`` and its compile-only run ``first``."""
    row = {"method": method, "case": case, "dtype": dtype, "batch": batch}
    if "error" in r:
        return dict(row, error=r["error"])
    median = statistics.median(r["step_s"])
    flops = first.get("flops") or r.get("flops")
    peak = mfu.peak_tflops(r["device_kind"], dtype)
    row.update(
        {
            "img/s": batch / median,
            "step ms": 1000 * median,
            "TFLOP/s": flops / median / 1e12 if flops else None,
            "MFU": flops / median / 1e12 / peak if flops and peak else None,
            "peak GiB": r["peak_gib"],
            "planned GiB": first.get("planned_gib"),
            "first compile s": first.get("compile_s"),
            "cache s": r["compile_s"],
            "loss": r["loss"],
        }
    )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pairs", default=PAIRS, help="method:case,... timed in this order")
    p.add_argument("--fits", default=FITS, help="method:case:b1/b2/...: candidate batches")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--parallel", type=int, default=12, help="compilations at once")
    p.add_argument("--on_device", default="moco:r50_224_b256", help="pairs timed again so")
    p.add_argument(
        "--trace", default=None, help="folder for a jax.profiler trace of the first pair"
    )
    p.add_argument("--deadline_s", type=float, default=1e9, help="start no row after this")
    p.add_argument("--cache_dir", default=None, help="default: a new temporary folder")
    p.add_argument(
        "--partial", default=None, help="rows as JSON lines as they finish; a rerun skips them"
    )
    p.add_argument("--flops", default=None, help="JSON {method:case[:on_device]: count}")
    p.add_argument("--count", default=None, help="write --flops's file (on a CPU) and stop")
    results.add_flags(p)
    args = p.parse_args()
    start = time.time()
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="jssl-cache-")
    pairs = [tuple(x.split(":")) for x in args.pairs.split(",") if x]
    on_device = {tuple(x.split(":")) for x in args.on_device.split(",") if x}
    fits = {}
    for spec in filter(None, args.fits.split(",")):
        method, case, batches = spec.split(":")
        fits[(method, case)] = [int(b) for b in batches.split("/")]

    jobs = {f"{m}:{c}": _job(m, c, args.dtype, args.steps) for m, c in pairs}
    jobs.update({f"{m}:{c}:on_device": _job(m, c, args.dtype, args.steps, on_device=True)
                 for m, c in pairs if (m, c) in on_device})  # fmt: skip
    for (m, c), batches in fits.items():
        jobs.update({f"{m}:{c}@{b}": _job(m, c, args.dtype, 3, batch=b) for b in batches})
    if args.count:  # XLA's counts, lowered on the CPU: a GPU session need not spend time on it
        counts = {
            key: mfu.count_on_cpu(j["method"], j["case"], j["dtype"], QUEUE, "on_device" in j)
            for key, j in jobs.items()
            if "batch" not in j
        }
        with open(args.count, "w") as f:
            json.dump(counts, f, indent=1)
        return
    if args.flops:  # counted before (benchmarks/mfu.py on a CPU): the children need not
        with open(args.flops) as f:
            counts = json.load(f)
        for key, job in jobs.items():
            job["flops"] = counts.get(key)
    first = compile_all(jobs, cache_dir, args.parallel)
    print(f"compiled {len(jobs)} steps in {time.time() - start:.0f} s", flush=True)

    rows = []
    if args.partial and os.path.exists(args.partial):  # a rerun: keep what was timed
        with open(args.partial) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    timed = {(r["method"], r["case"], r["batch"]) for r in rows if "error" not in r}

    def add(row: dict) -> None:
        rows.append({k: results.rounded(v) for k, v in row.items()})
        print(_line(rows[-1], header=True), flush=True)
        if args.partial:
            with open(args.partial, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")

    def late() -> bool:
        return time.time() - start > args.deadline_s

    for method, case in pairs:
        if late():
            break
        if (method, case, CASES[case]["batch"]) in timed:
            continue
        key = f"{method}:{case}"
        flops = first[key].get("flops")
        r = spawn(_job(method, case, args.dtype, args.steps, flops=flops), cache_dir)
        row = _row(method, case, args.dtype, CASES[case]["batch"], r, first[key])
        if (method, case) in on_device and "error" not in r and not late():
            a = spawn(dict(jobs[key + ":on_device"], flops=flops), cache_dir)
            if "error" not in a:
                row["img/s aug. on device"] = CASES[case]["batch"] / statistics.median(a["step_s"])
                cost = statistics.median(a["step_s"]) - statistics.median(r["step_s"])
                row["aug. ms/step"] = 1000 * cost
                row["aug. alone ms"] = 1000 * statistics.median(a["augment_s"])
        add(row)
    for (method, case), batches in fits.items():
        planned = {b: first[f"{method}:{case}@{b}"] for b in batches}
        fitting = [
            b for b, f in planned.items() if f.get("planned_gib", 1e9) <= (f.get("limit_gib") or 0)
        ]
        if not fitting or late():
            continue
        batch = max(fitting)
        if (method, case, batch) in timed:
            continue
        r = spawn(jobs[f"{method}:{case}@{batch}"], cache_dir)
        row = _row(method, case, args.dtype, batch, r, planned[batch])
        row["largest batch of"] = "/".join(
            f"{b}: {planned[b].get('planned_gib', 0):.1f} of {planned[b].get('limit_gib') or 0:.1f}"
            for b in batches
        )
        add(row)
    if args.trace and pairs and not late():
        method, case = pairs[0]
        spawn(_job(method, case, args.dtype, 3, trace_dir=args.trace), cache_dir)
    # One row per (method, case, batch): a rerun's row replaces an earlier run's error row.
    rows = list({(r["method"], r["case"], r["batch"]): r for r in rows}.values())
    results.record(
        "method_steps",
        rows,
        args=args,
        measures=results.summary(__doc__),
        notes=f"bf16 unless the dtype says otherwise; MoCo's queue {QUEUE}. "
        "'largest batch of' lists each candidate's planned GiB of the allocator's limit.",
    )


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
