r"""Images/s, compile time and peak memory of the train step, per method, model and dtype.

  python benchmarks/train_step.py                         # all ResNet cases on the present devices
  python benchmarks/train_step.py --cases=r18_32 --steps=5
  python benchmarks/train_step.py --methods=moco,simclr,swav --cases=r18_32 --dtypes=float32
  python benchmarks/train_step.py --compare_cpu_flags     # jssl's CPU XLA flags vs XLA's defaults
  python benchmarks/train_step.py --compare_torch         # jssl / PyTorch, MoCo v2
  python benchmarks/train_step.py --compare_on_device     # + colour, blur, ... inside the step
  python benchmarks/train_step.py --methods=moco,swav --cases=r18_32_b64 --compare_bare
                                                          # jssl's machinery (bare_step.py)
  python benchmarks/train_step.py --methods=dino,mocov3 --cases=vit_t_32 --dtypes=float32 \
      --reference=moco:r18_32_b64                         # ViT rows, img/s ratio to MoCo ResNet
  python benchmarks/train_step.py --methods=mae,ibot,dinov2,msn --cases=vit_t_32 \
      --dtypes=float32 --reference=dino:vit_t_32          # the masked ViT methods / DINO
  python benchmarks/report.py                             # results/*.json -> docs/benchmarks.md

Each run prints its table and writes it to benchmarks/results/train_step[-<mode>].json
(``--results``, ``--no_results``) with the command and the machine (benchmarks/results.py).

Cases (name = trunk, crop size, global batch): r18_32 = ResNet-18 (CIFAR stem) at 32 px, batch
256; r18_32_b64 the same at batch 64; r50_96 = ResNet-50 at 96 px, batch 32; r50_224 = ResNet-50
at 224 px, batch 32; vit_t_32 = ViT-Tiny, patch 4, 32 px, batch 64 (a CPU-sized ViT: 8x8
patches); vit_s16_224 = ViT-S/16 at 224 px, batch 32 (DINO's and MoCo v3's ViT). The GPU
cases take a GPU's per-device batch: r50_224_b256 (ResNet-50, 224 px, batch 256),
vit_s16_224_b128 and vit_b16_224_b64 (ViT-S/16 and ViT-B/16, DINO with its recipe's 2 + 10
crops: 224 px global, 96 px local). SwAV adds its
multi-crop: 2 crops at the case's size + 6 small ones (``small`` px), so its images/s count
images of 8 crops; DINO takes the same crops (2 global + 6 local) and its 65536-wide head (on a
ViT: its ViT-S recipe, drop path 0.1). Barlow Twins and VICReg keep their 8192-8192-8192
projectors; MoCo v3 on a ViT its 4096-4096-256 projector. On the ViT cases iBOT and DINOv2 take
DINO's crops with their own masks and heads (iBOT one 8192-wide head for [CLS] and patches;
DINOv2 separate 131072-wide [CLS] and patch heads, Sinkhorn-Knopp centring and KoLeo, on a
ViT with LayerScale and the GELU MLP); MSN the target, one random-masked anchor (15% of the
patches dropped) and 6 small focal crops, 1024 prototypes; MAE one view, 75% of its patches
masked, an 8-block decoder scaled to the trunk (ViT-Tiny: 128 wide). DeepCluster-v2 (ResNet
cases) takes 2 crops, three heads of 3000 clusters and a memory bank of 50,000 rows (CIFAR-10's
train split, ``step_cases.DEEPCLUSTER_BANK_ROWS``; its preset sizes the bank by the train
split, 1.28M rows on ImageNet); its once-an-epoch k-means is compiled in but not timed.
benchmarks/step_cases.py says what each case changes from a method's preset. A row's img/s
counts images (one example with all its crops). Synthetic inputs, so this measures
the step alone (benchmarks/input_pipeline.py measures the data). img/s = global batch / median
step time (one warm-up step after compiling, then ``--steps`` timed one by one). TFLOP/s is
XLA's count of one device's floating-point operations in the step (``mfu.step_flops``) over the
median step time, and MFU that over the device's peak: ``mfu.PEAK_BF16_TFLOPS`` for bfloat16 on
the GPUs and TPUs it names, else ``--peak_tflops`` (e.g. MoCo R50@224 bf16 on a GPU:
``--cases=r50_224 --dtypes=bfloat16``). Peak memory is the device's peak bytes in use, or the
process's peak resident memory on CPU. Each case runs in its own process
(benchmarks/step_child.py) so that compile caches and XLA flags do not leak between cases.

``--compare_torch`` times a plain PyTorch MoCo v2 step with the same shapes
(benchmarks/torch_reference.py) against jssl's MoCo step, queue 4096 on both sides: each case
runs jssl then PyTorch, one process at a time, for ``--rounds`` rounds, and reports pairs/s
(global batch / median step time), the jssl / PyTorch ratio of each round and that of the CPU
seconds a step takes (all threads; less distorted by other jobs on the machine), and the load
average when the case started. PyTorch runs with OMP_WAIT_POLICY=PASSIVE unless it is set (see
``spawn``) and with channels-last activations unless ``--torch_layout=nchw``. ``--with_plain``
adds a minimal JAX step of the same model (benchmarks/plain_step.py) and the ratios of the two
steps' compile times (``jit(...).lower(...).compile()``, tracing included), wall and process
CPU seconds, and of their processes' peak resident memory (both import the same modules).
Without ``--cases``/``--dtypes`` it runs ``step_cases.TORCH_CASES``.

``--compare_on_device`` times every row a second time with ``data.augment.on_device``: the step
is fed uint8 crops and their seeds and runs the method's colour jitter, grayscale, blur,
solarisation and normalisation itself (jssl/data/device_augment.py), as training with that
option does; the row adds that step's img/s, the difference of the two median step times, and
the median time of the augmentation alone (jitted by itself, same batch), which a noisy machine
moves less than it moves a difference of two steps.
"""

import argparse
import json
import os
import statistics

import mfu  # benchmarks/, beside this script
import results
import step_child
from step_cases import CASES, TORCH_CASES, TORCH_QUEUE

# The modes that time each row a second time, their flag help and the notes of their results.
MODES = {
    "compare_bare": "jssl/bare: the same method's step without jssl's machinery around it "
    "(benchmarks/bare_step.py: same loss, collectives, optimizer and shard_map; no pmeans, "
    "non-finite guard, stop flag, metrics or probe), in the same run: img/s, first compile, "
    "peak memory, and the CPU seconds (all threads) of the compile and of a step, which other "
    "jobs on the machine move less than wall time.",
    "compare_on_device": "on device/host aug.: each row again with data.augment.on_device, the "
    "colour, blur and solarisation inside the step; aug. ms/step is the difference of the "
    "median step times, aug. alone the augmentation jitted by itself.",
    "compare_cpu_flags": "jssl flags/defaults: each row again with XLA's own CPU flags "
    "instead of jssl's (parallel.CPU_XLA_FLAGS).",
    "compare_torch": "jssl's MoCo v2 step against a plain PyTorch one of the same shapes "
    "(benchmarks/torch_reference.py), round by round.",
}
# Ratio columns whose range and geometric mean make a run's headline.
HEADLINES = (
    ("jssl/bare img/s", "jssl / bare step, img/s"),
    ("jssl/bare compile", "jssl / bare step, compile time"),
    ("jssl/bare compile CPU", "jssl / bare step, compile CPU seconds"),
    ("jssl/bare peak", "jssl / bare step, peak memory"),
    ("jssl/bare CPU s/step", "jssl / bare step, CPU seconds per step"),
    ("on device/host aug. img/s", "step with the augmentation on device / without, img/s"),
    ("jssl flags/defaults img/s", "jssl's CPU flags / XLA's defaults, img/s"),
)


def spawn(job: dict) -> dict:
    """Runs ``job`` (keys: impl, case, dtype, steps, method, queue, default_flags) in a fresh
    process and returns its result with ``per_s`` = global batch / median step time."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if job.get("default_flags"):
        env["JSSL_XLA_DEFAULTS"] = "1"
    if job["impl"] == "torch":
        # PyTorch's OpenMP threads spin while they wait by default, which on a machine shared
        # with other jobs inflates its CPU seconds per step and would flatter jssl's CPU ratio.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    out = step_child.launch(job, env)
    if out.returncode:
        raise RuntimeError(f"case {job} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["per_s"] = CASES[job["case"]]["batch"] / statistics.median(result["step_s"])
    return result


def _span(label: str, values: list[float]) -> str:
    """One headline line: the range and geometric mean of ratios measured in one run."""
    lo, hi = min(values), max(values)
    mean = statistics.geometric_mean(values)
    if len(values) == 1:
        return f"{label}: {lo:.2f}"
    return f"{label}: {lo:.2f}-{hi:.2f}, geometric mean {mean:.2f} over {len(values)} rows"


def compare_torch(
    pairs: list[tuple[str, str]],
    steps: int,
    rounds: int,
    plain: bool,
    torch_layout: str,
    torch_compile: bool = False,
) -> tuple[list[dict], list[str]]:
    """jssl's MoCo step, then PyTorch's (then the plain JAX step's), case by case, ``rounds``
    times; returns the rows and the headline (the ratios' geometric means over the rounds).
    The CPU ratio compares the median process CPU seconds per step (all threads), which a
    machine shared with other jobs distorts less than wall time."""
    print(f"PyTorch layout: {torch_layout}")
    rows = []
    for r in range(rounds):
        for case, dtype in pairs:
            job = dict(case=case, dtype=dtype, steps=steps, method="moco", queue=TORCH_QUEUE)
            load = os.getloadavg()[0]
            ours = spawn(dict(job, impl="jssl"))
            ref = spawn(dict(job, impl="torch", layout=torch_layout, compile=torch_compile))
            cpu_ours, cpu_ref = statistics.median(ours["cpu_s"]), statistics.median(ref["cpu_s"])
            row = {
                "round": r + 1,
                "case": case,
                "dtype": dtype,
                "jssl pairs/s": ours["per_s"],
                "torch pairs/s": ref["per_s"],
                "jssl/torch pairs/s": ours["per_s"] / ref["per_s"],
                "CPU s/step jssl": cpu_ours,
                "CPU s/step torch": cpu_ref,
                "CPU torch/jssl": cpu_ref / cpu_ours,
                "jssl compile s": ours["compile_s"],
                "torch first step s": ref["first_s"],
                "jssl peak GiB": ours["peak_gib"],
                "torch peak GiB": ref["peak_gib"],
                "jssl MFU": _mfu(ours, dtype),
                "jssl loss": ours["loss"],
                "torch loss": ref["loss"],
                "load": load,
            }
            if plain:
                p = spawn(dict(job, impl="plain"))
                row.update(
                    {
                        "plain pairs/s": p["per_s"],
                        "plain compile s": p["compile_s"],
                        "jssl/plain pairs/s": ours["per_s"] / p["per_s"],
                        "jssl/plain compile": ours["compile_s"] / p["compile_s"],
                        "jssl/plain compile CPU": ours["compile_cpu_s"] / p["compile_cpu_s"],
                        "RSS GiB jssl": ours["host_peak_gib"],
                        "RSS GiB plain": p["host_peak_gib"],
                        "jssl/plain RSS": ours["host_peak_gib"] / p["host_peak_gib"],
                    }
                )
            rows.append({k: results.rounded(v) for k, v in row.items()})
            print(_line(rows[-1], header=len(rows) == 1), flush=True)
    headline = []
    for case, dtype in pairs:
        mine = [row for row in rows if (row["case"], row["dtype"]) == (case, dtype)]
        what = ["jssl/torch pairs/s", "CPU torch/jssl"]
        what += ["jssl/plain pairs/s", "jssl/plain compile", "jssl/plain RSS"] if plain else []
        means = [statistics.geometric_mean(row[k] for row in mine) for k in what]
        headline.append(
            f"{case} {dtype}, geometric mean of {len(mine)} rounds: "
            + "; ".join(f"{k} {m:.2f}" for k, m in zip(what, means, strict=True))
        )
    print("\n".join(headline))
    return rows, headline


def _mfu(result: dict, dtype: str, override: float | None = None) -> float | None:
    """One device's XLA-counted TFLOP/s of the step over its peak (None where unknown)."""
    peak = mfu.peak_tflops(result["device_kind"], dtype, override)
    if not (result["flops"] and peak):
        return None
    return result["flops"] / statistics.median(result["step_s"]) / 1e12 / peak


def _line(row: dict, header: bool = False) -> str:
    """``row`` as one printed table line, under its header line if ``header``: numbers right-
    aligned, names left-aligned, each column as wide as its header (names at least 12)."""
    names, cells = [], []
    for key, value in row.items():
        if isinstance(value, str) or value is None:
            width = max(len(key), 12)
            names.append(f"{key:<{width}}")
            cells.append(f"{'-' if value is None else value:<{width}}")
        else:
            width = max(len(key), 8)
            names.append(f"{key:>{width}}")
            text = f"{value:.2f}" if isinstance(value, float) and abs(value) < 100 else value
            cells.append(f"{text:>{width}.1f}" if isinstance(text, float) else f"{text:>{width}}")
    return (" ".join(names) + "\n" if header else "") + " ".join(cells)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", default=None, help="default r18_32,r50_224")
    p.add_argument("--dtypes", default=None, help="default float32,bfloat16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--methods", default="moco", help="comma-separated names of jssl.methods")
    p.add_argument("--queue_size", type=int, default=16384, help="MoCo's queue")
    for mode, help_text in MODES.items():
        p.add_argument(f"--{mode}", action="store_true", help=help_text)
    p.add_argument("--rounds", type=int, default=2, help="--compare_torch: rounds of all cases")
    p.add_argument(
        "--with_plain",
        action="store_true",
        help="--compare_torch: also time a minimal JAX step of the same model (plain_step.py)",
    )
    p.add_argument(
        "--torch_layout",
        choices=("channels_last", "nchw"),
        default="channels_last",
        help="--compare_torch: PyTorch's activation layout",
    )
    p.add_argument(
        "--torch_compile",
        action="store_true",
        help="--compare_torch: wrap PyTorch's encoders in torch.compile",
    )
    p.add_argument(
        "--reference",
        default=None,
        help="method:case timed first (first dtype); every row adds its img/s ratio to it",
    )
    p.add_argument(
        "--peak_tflops",
        type=float,
        default=None,
        help="one device's peak TFLOP/s for the MFU column (default: PEAK_BF16_TFLOPS, bf16)",
    )
    results.add_flags(p)
    args = p.parse_args()
    if args.compare_torch:
        if args.cases is None and args.dtypes is None:
            pairs = list(TORCH_CASES)
        else:
            cases = (args.cases or "r18_32_b64,r18_32,r50_96").split(",")
            pairs = [(c, d) for c in cases for d in (args.dtypes or "float32").split(",")]
        rows, headline = compare_torch(
            pairs, args.steps, args.rounds, args.with_plain, args.torch_layout, args.torch_compile
        )
        name = "train_step-compare_torch" + ("-with_plain" if args.with_plain else "")
        notes = MODES["compare_torch"] + f" PyTorch layout: {args.torch_layout}."
        if args.torch_compile:
            name += "-torch_compile"
            notes += " PyTorch's encoders under torch.compile."
        measures = results.summary(__doc__)
        results.record(name, rows, args=args, measures=measures, headline=headline, notes=notes)
        return

    rows, headline = time_rows(args)
    modes = [m for m in MODES if getattr(args, m)] + (["reference"] if args.reference else [])
    notes = " ".join(MODES.get(m, "") for m in modes) or None
    if args.reference:
        notes = f"{notes or ''} ratio: img/s over that of {args.reference} (first row).".strip()
    results.record(
        "-".join(["train_step", *modes]),
        rows,
        args=args,
        measures=results.summary(__doc__),
        headline=headline,
        notes=notes,
    )


def time_rows(args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """Times every (method, case, dtype), each mode's second step beside it; returns the rows
    and the headline ratios of the compared modes."""
    cases = (args.cases or "r18_32,r50_224").split(",")
    dtypes = (args.dtypes or "float32,bfloat16").split(",")
    jobs = [(m, c, d) for m in args.methods.split(",") for c in cases for d in dtypes]
    reference = None
    if args.reference:
        ref_method, ref_case = args.reference.split(":")
        jobs.insert(0, (ref_method, ref_case, dtypes[0]))
    rows = []
    for method, case, dtype in jobs:
        job = dict(
            impl="jssl", case=case, dtype=dtype, steps=args.steps, method=method,
            queue=args.queue_size,
        )  # fmt: skip
        r = spawn(job)
        reference = reference or r["per_s"]
        # Per device: XLA's count of the step's operations over the median step time.
        tflops = r["flops"] / statistics.median(r["step_s"]) / 1e12 if r["flops"] else None
        row = {
            "method": method,
            "case": case,
            "dtype": dtype,
            "devices": r["devices"],
            "img/s": r["per_s"],
            "compile s": r["compile_s"],
            "peak GiB": r["peak_gib"],
            "TFLOP/s": tflops,
            "MFU": _mfu(r, dtype, args.peak_tflops),
        }
        if args.compare_cpu_flags:
            d = spawn(dict(job, default_flags=True))
            row["img/s XLA defaults"] = d["per_s"]
            row["jssl flags/defaults img/s"] = r["per_s"] / d["per_s"]
        if args.compare_on_device:
            a = spawn(dict(job, on_device=True))
            row["img/s aug. on device"] = a["per_s"]
            cost = statistics.median(a["step_s"]) - statistics.median(r["step_s"])
            row["aug. ms/step"] = 1000 * cost
            row["aug. alone ms"] = 1000 * statistics.median(a["augment_s"])
            row["on device/host aug. img/s"] = a["per_s"] / r["per_s"]
        if args.compare_bare:
            b = spawn(dict(job, bare=True))
            row["bare img/s"] = b["per_s"]
            row["jssl/bare img/s"] = r["per_s"] / b["per_s"]
            row["jssl/bare compile"] = r["compile_s"] / b["compile_s"]
            row["jssl/bare compile CPU"] = r["compile_cpu_s"] / b["compile_cpu_s"]
            row["jssl/bare peak"] = r["peak_gib"] / b["peak_gib"]
            # CPU seconds per step (all threads) move less than wall time when other jobs run.
            row["jssl/bare CPU s/step"] = statistics.median(r["cpu_s"]) / statistics.median(
                b["cpu_s"]
            )
        if args.reference:
            row["ratio"] = r["per_s"] / reference
        rows.append({k: results.rounded(v) for k, v in row.items()})
        print(_line(rows[-1], header=len(rows) == 1), flush=True)
    headline = []
    for key, label in HEADLINES:
        values = [row[key] for row in rows if row.get(key) is not None]
        if values:
            headline.append(_span(label, values))
    print("\n".join(headline))
    return rows, headline


if __name__ == "__main__":
    main()
