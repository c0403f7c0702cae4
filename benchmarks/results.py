"""Results files of the benchmarks: each run's figures with its command and its machine.

Every benchmark script calls ``record`` once at the end, which writes
``benchmarks/results/<name>.json``; ``benchmarks/report.py`` turns those files into
docs/benchmarks.md, so that every figure in the docs comes with the command that measured it
and a description of the machine it ran on. Importing this module imports neither jax nor
TensorFlow; ``record`` imports jax to describe the devices.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from importlib import metadata
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
# Environment variables that change what a benchmark measures, recorded with the command.
ENV_PREFIXES = ("XLA_", "JAX_", "JSSL_", "CUDA_VISIBLE_DEVICES", "OMP_")
PACKAGES = (
    "jax",
    "jaxlib",
    "jax-cuda12-plugin",
    "jax-cuda13-plugin",
    "orbax-checkpoint",
    "flax",
    "optax",
    "numpy",
    "tensorflow-cpu",
    "torch",
)

_START_TIME = time.time()
_START_LOAD = os.getloadavg()[0]
_START_ENV = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """``--results=PATH`` and ``--no_results``, read by ``record``."""
    parser.add_argument(
        "--results", default=None, help="results file (default: benchmarks/results/<name>.json)"
    )
    parser.add_argument("--no_results", action="store_true", help="print only, write no file")


def command() -> str:
    """This process's command line, shell-quoted, as run from the repository root."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    return shlex.join(["python", script, *sys.argv[1:]])


def environment() -> dict[str, str]:
    """The set environment variables among ``ENV_PREFIXES`` (as this module's import found
    them, before a benchmark adds its own flags, e.g. ``parallel.configure_cpu_defaults``)."""
    return dict(_START_ENV)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)  # kB
    except OSError:
        pass
    return None


def _gpus() -> list[str]:
    """The GPUs nvidia-smi lists, whether or not JAX uses them."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def _versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def machine() -> dict[str, Any]:
    """CPU, cores, memory, OS, Python, package versions, JAX's backend and devices, GPUs."""
    import jax

    devices = jax.devices()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": _memory_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": _versions(),
        "jax_backend": jax.default_backend(),
        "devices": f"{len(devices)} x {devices[0].device_kind}",
        "process_count": jax.process_count(),
        "gpus": _gpus(),
    }


def accelerator_suffix() -> str:
    """``-<chip>`` for a run on GPUs or TPUs (``-h100``, ``-tpu-v5-lite``), '' on CPUs: a run on
    an accelerator writes its own results file beside the CPU one instead of replacing it."""
    import jax

    if jax.default_backend() == "cpu":
        return ""
    words = jax.devices()[0].device_kind.lower().replace("-", " ").split()
    kept = [w for w in words if w != "nvidia" and "gb" not in w and not w.startswith("hbm")]
    return "-" + "-".join(kept)


def record(
    name: str,
    rows: list[dict[str, Any]],
    *,
    args: argparse.Namespace | None = None,
    measures: str = "",
    headline: list[str] | None = None,
    notes: str | None = None,
) -> str | None:
    """Writes the run's results file and returns its path (None under ``--no_results``).

    ``name`` names the file (``benchmarks/results/<name>.json`` unless ``--results`` is given;
    on an accelerator ``<name>-<chip>``, ``accelerator_suffix``);
    ``rows`` are the figures, one dict per table row, the keys its column headers;
    ``measures`` says in a sentence or two what the figures are; ``headline`` lists the ratios
    a comparing run measured (e.g. jssl / bare step), each one line; ``notes`` adds anything a
    reader needs to read the table.
    """
    if args is not None and args.no_results:
        return None
    name += accelerator_suffix()
    path = getattr(args, "results", None) or os.path.join(RESULTS_DIR, f"{name}.json")
    result = {
        "name": name,
        "script": os.path.relpath(os.path.abspath(sys.argv[0]), ROOT),
        "measures": measures,
        "command": command(),
        "environment": environment(),
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),  # the end
        "wall_s": round(time.time() - _START_TIME, 1),
        "load_average_at_start": round(_START_LOAD, 2),
        "machine": machine(),
        "headline": headline or [],
        "notes": notes,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    inside = os.path.abspath(path).startswith(ROOT + os.sep)
    print(f"results: {os.path.relpath(path, ROOT) if inside else path}")
    return path


def rounded(value: Any, digits: int = 4) -> Any:
    """``value`` to ``digits`` significant digits (floats only), to keep the files readable."""
    if isinstance(value, float) and value == value and value not in (float("inf"), -float("inf")):
        return float(f"{value:.{digits}g}")
    return value


def summary(doc: str | None) -> str:
    """The first paragraph of a docstring, on one line: what a benchmark measures."""
    paragraph = (doc or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines())
