r"""Every method's ``test`` preset trained on the present device, stopped half-way and resumed:
wall time of each half, the loss, and whether it is finite.

  python benchmarks/presets.py                                 # every method, bfloat16
  python benchmarks/presets.py --methods=moco,dino --dtype=float32

The check a new device gets first (a GPU, a TPU): each method's whole train engine (data,
step, checkpoint, resume) on its tiny ``test`` preset in one process. The first half stops at
``debug.max_steps`` with a checkpoint; the second launch resumes from it and finishes the
run. The resumed half reads the first half's compiled steps from the persistent compilation
cache, so ``resumed s`` against ``first s`` is the cost of a launch with a warm cache. Each
run prints its table and writes it to benchmarks/results/presets.json (``--results``,
``--no_results``) with the command and the machine (benchmarks/results.py).
"""

import argparse
import importlib
import math
import os
import sys
import tempfile
import time

import results  # benchmarks/, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# (name, config module, preset): every method's test preset, the ViT variants of DINO and MoCo
# v3 beside their ResNet ones.
PRESETS = (
    ("moco", "moco", "test"),
    ("mocov3", "mocov3", "test"),
    ("simclr", "simclr", "test"),
    ("swav", "swav", "test"),
    ("byol", "byol", "test"),
    ("simsiam", "simsiam", "test"),
    ("dino", "dino", "test"),
    ("dino_vit", "dino", "test_vit"),
    ("barlow_twins", "barlow_twins", "test"),
    ("vicreg", "vicreg", "test"),
    ("supervised", "supervised", "test"),
    ("mae", "mae", "test"),
    ("ibot", "ibot", "test"),
    ("dinov2", "dinov2", "test"),
    ("msn", "msn", "test"),
    ("deepclusterv2", "deepclusterv2", "test"),
)


def run_one(module: str, preset: str, dtype: str, workdir: str, cache_dir: str) -> dict:
    """Trains half the preset's steps, then resumes to the end; returns the row."""
    import jssl

    def config(max_steps: int):
        c = importlib.import_module(f"configs.{module}").get_config(preset)
        c.model.dtype = dtype
        c.compilation_cache_dir = cache_dir
        c.debug.max_steps = max_steps
        return c

    t0 = time.perf_counter()
    # Steps of the whole run: the train split's subset over the global batch, per epoch.
    c = config(0)
    total = c.num_epochs * (c.data.train_subset // c.data.batch_size)
    first = jssl.train(config(total // 2), workdir)
    t1 = time.perf_counter()
    second = jssl.train(config(0), workdir)
    t2 = time.perf_counter()
    loss = float(second["loss"])
    return {
        "first steps": int(first["step"]),
        "resumed to": int(second["step"]),
        "steps": total,
        "first s": t1 - t0,
        "resumed s": t2 - t1,
        "loss": loss,
        "finite": math.isfinite(loss) and math.isfinite(float(first["loss"])),
        # SIGTERM (a session's ``timeout``) stops a run at a step with a checkpoint and
        # returns: the row is cut short, not failed.
        "stopped": bool(first.get("preempted") or second.get("preempted")),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--methods", default=None, help="comma-separated names (default: all)")
    p.add_argument("--dtype", default="bfloat16")
    results.add_flags(p)
    args = p.parse_args()
    wanted = args.methods.split(",") if args.methods else [name for name, *_ in PRESETS]
    unknown = sorted(set(wanted) - {name for name, *_ in PRESETS})
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {[n for n, *_ in PRESETS]}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, module, preset in PRESETS:
            if name not in wanted:
                continue
            row = {"method": name, "preset": preset, "dtype": args.dtype}
            try:
                row.update(
                    run_one(module, preset, args.dtype, os.path.join(tmp, name), f"{tmp}/cache")
                )
            except Exception as e:  # noqa: BLE001 - one method's failure is this table's row
                row["error"] = f"{type(e).__name__}: {e}"[:500]
            ok = row.get("finite") and row.get("resumed to") == row.get("steps")
            row["ok"] = bool(ok)
            rows.append({k: results.rounded(v) for k, v in row.items()})
            print(rows[-1], flush=True)
    stopped = [r["method"] for r in rows if r.get("stopped")]
    failed = [r["method"] for r in rows if not r["ok"] and not r.get("stopped")]
    ok = len(rows) - len(failed) - len(stopped)
    headline = [f"{ok} of {len(rows)} presets trained, resumed and finite"]
    if stopped:
        headline.append(
            f"stopped by SIGTERM before the end, checkpoint saved: {', '.join(stopped)}"
        )
    if failed:
        headline.append(f"failed: {', '.join(failed)}")
    print("\n".join(headline))
    results.record(
        "presets",
        rows,
        args=args,
        measures=results.summary(__doc__),
        headline=headline,
    )
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
