r"""The demos' kNN margins over seeds and device counts: each demo preset run as a user runs it
(``launch.py``), with ``--config.seed`` 0, 1, 2 on 1 and 2 (fake CPU) devices, the learned and
the random-init kNN top-1 it prints, and the smallest margin per demo.

  python benchmarks/demos.py --demos=simclr,dino:demo_vit           # 6 runs each
  python benchmarks/demos.py --demos=vicreg --seeds=0 --devices=2   # one run, merged in

A demo's figure depends on float rounding (another CPU, another device count), which recipes
with batch-norm projectors amplify into a different run; the README's methods table quotes the
min-max over these runs, and a demo holds its place when every run learns 10 points (MoCo v2:
15) over random init. Each finished run is written at once to benchmarks/results/demos.json
(``--results``, ``--no_results``) with the command and the machine, merged with the rows of
other demos, seeds and device counts already there, so that a sweep can be done a few demos at
a time. A run takes 2-6 minutes on 2 cores.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import results  # benchmarks/, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# config file[:preset] -> points over random init that every run must learn: 10, and 15 for
# the MoCo quick start (learned 78.0-92.9%, random init 48.9-57.6% over seeds 0-2, both BN
# modes and 1 and 2 devices: 20 points at least, so 15 is outside both spreads).
# tests/training/test_demo.py holds each demo's seed-0 run to it.
DEMOS = {
    "moco": 15.0,
    "simclr": 10.0,
    "swav": 10.0,
    "byol": 10.0,
    "simsiam": 10.0,
    "dino": 10.0,
    "dino:demo_vit": 10.0,
    "barlow_twins": 10.0,
    "vicreg": 10.0,
    "mocov3": 10.0,
    "mocov3:demo_vit": 10.0,
    "deepclusterv2": 10.0,
    "supervised": 10.0,
    "mae": 10.0,
    "ibot": 10.0,
    "dinov2": 10.0,
    "msn": 10.0,
}
# The line monitor.knn_comparison prints.
LINE = re.compile(
    r"kNN top-1 on (\S+) \(([^,]+), k=\d+\): learned ([\d.]+)% vs random init ([\d.]+)%"
)


def run_demo(demo: str, seed: int, devices: int, data_dir: str | None, timeout: int) -> dict:
    """One launch of the demo; its kNN line's figures and the wall time."""
    name, _, preset = demo.partition(":")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    ).strip()
    with tempfile.TemporaryDirectory() as workdir:
        command = [
            sys.executable,
            "launch.py",
            f"--config=configs/{name}.py:{preset or 'demo'}",
            f"--workdir={workdir}",
            f"--config.seed={seed}",
        ]
        if data_dir:
            command.append(f"--config.data.data_dir={data_dir}")
        start = time.perf_counter()
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        wall = time.perf_counter() - start
    log = done.stdout + done.stderr
    match = LINE.search(log)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"exit status {done.returncode}, no kNN line:\n{log[-3000:]}")
    learned, random_init = float(match.group(3)), float(match.group(4))
    return {
        "layer": match.group(2),
        "learned": learned,
        "random init": random_init,
        "margin": round(learned - random_init, 1),
        "wall s": round(wall, 1),
    }


def summarise(rows: list[dict]) -> list[str]:
    """Per demo: the learned and random-init ranges, the smallest margin against the goal."""
    lines = []
    for demo in dict.fromkeys(r["demo"] for r in rows):
        done = [r for r in rows if r["demo"] == demo and "learned" in r]
        if not done:
            continue
        learned = [r["learned"] for r in done]
        randoms = [r["random init"] for r in done]
        smallest = min(r["margin"] for r in done)
        goal = DEMOS.get(demo, 10.0)
        verdict = "holds" if smallest >= goal else "BELOW"
        lines.append(
            f"{demo}: {min(learned):.1f}-{max(learned):.1f}% vs {min(randoms):.1f}-"
            f"{max(randoms):.1f}% over {len(done)} runs; smallest margin {smallest:.1f} "
            f"({verdict} the {goal:g}-point goal)"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--demos", required=True, help=f"comma-separated, of {list(DEMOS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--devices", default="1,2", help="fake CPU device counts")
    p.add_argument("--data_dir", default=None, help="TFDS dir of the demo data (default: TFDS')")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    results.add_flags(p)
    args = p.parse_args()
    demos = args.demos.split(",")
    unknown = [d for d in demos if d not in DEMOS]
    if unknown:
        raise SystemExit(f"--demos: unknown {unknown}; choose from {list(DEMOS)}")
    path = args.results or os.path.join(results.RESULTS_DIR, "demos.json")
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = json.load(f)["rows"]
    for demo in demos:
        for devices in (int(d) for d in args.devices.split(",")):
            for seed in (int(s) for s in args.seeds.split(",")):
                row = {"demo": demo, "seed": seed, "devices": devices}
                try:
                    row.update(run_demo(demo, seed, devices, args.data_dir, args.timeout))
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    row["error"] = str(e)[-1500:]
                print(row, flush=True)
                same = (demo, seed, devices)
                rows = [r for r in rows if (r["demo"], r["seed"], r["devices"]) != same]
                rows.append(row)
                rows.sort(key=lambda r: (list(DEMOS).index(r["demo"]), r["devices"], r["seed"]))
                headline = summarise(rows)
                results.record(
                    "demos",
                    rows,
                    args=args,
                    measures=results.summary(__doc__),
                    headline=headline,
                    notes="Each row is one launch.py run of the demo preset with "
                    "--config.seed=<seed> on <devices> fake CPU devices; rows of earlier runs "
                    "of other demos, seeds or device counts are kept.",
                )
    print("\n".join(summarise(rows)))


if __name__ == "__main__":
    main()
