"""Where a profiled step's time goes: a summary of a jax.profiler trace (Chrome/Perfetto JSON).

For each process of the trace (on a GPU: ``/device:GPU:0`` and the host), the events' span,
the time some event of it was running (the union of their intervals), and the operations or
kernels that took the most time, summed by name. Python frames (``$file:line``) are left out.
benchmarks/method_steps.py ``--trace`` writes such a trace of the MoCo v2 step:

  python benchmarks/trace_summary.py TRACE_DIR_OR_FILE [--top 15]
"""

import argparse
import collections
import glob
import gzip
import json
import os


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of the (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarize(path: str, top: int = 15) -> str:
    """The summary of the trace file ``path`` (``*.trace.json.gz``, ``perfetto_trace.json.gz``)."""
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    by_pid = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and not str(e.get("name", "")).startswith("$"):
            by_pid[e["pid"]].append(e)
    lines = [f"trace: {path}"]
    for pid, evs in sorted(by_pid.items(), key=lambda kv: -len(kv[1])):
        spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in evs]
        span = max(e for _, e in spans) - min(s for s, _ in spans)
        busy = _union_us(spans)
        lines.append(
            f"{names.get(pid, pid)}: {len(evs)} events over {span / 1e3:.1f} ms, "
            f"busy {busy / 1e3:.1f} ms ({100 * busy / max(span, 1e-9):.0f}%)"
        )
        total = collections.Counter()
        count = collections.Counter()
        for e in evs:
            total[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
        for name, us in total.most_common(top):
            lines.append(f"  {us / 1e3:9.2f} ms {count[name]:6d}x  {name[:110]}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("path", help="a trace file, or a folder jax.profiler.trace wrote")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    path = args.path
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True))
        if not found:
            raise SystemExit(f"no *.trace.json.gz under {path}: was jax.profiler.trace run there?")
        path = found[-1]
    print(summarize(path, args.top))


if __name__ == "__main__":
    main()
