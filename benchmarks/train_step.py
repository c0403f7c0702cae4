r"""Images/s, compile time and peak memory of the train step, per method, model and dtype.

  python benchmarks/train_step.py                         # all ResNet cases on the present devices
  python benchmarks/train_step.py --cases=r18_32 --steps=5
  python benchmarks/train_step.py --methods=moco,simclr,swav --cases=r18_32 --dtypes=float32
  python benchmarks/train_step.py --compare_cpu_flags     # jssl's CPU XLA flags vs XLA's defaults
  python benchmarks/train_step.py --compare_torch         # jssl / PyTorch, MoCo v2 (issue 11)
  python benchmarks/train_step.py --compare_on_device     # + colour, blur, ... inside the step
  python benchmarks/train_step.py --methods=moco,swav --cases=r18_32_b64 --compare_bare
                                                          # jssl's machinery (bare_step.py)
  python benchmarks/train_step.py --methods=dino,mocov3 --cases=vit_t_32 --dtypes=float32 \
      --reference=moco:r18_32_b64                         # ViT rows, img/s ratio to MoCo ResNet

Cases (name = trunk, crop size, global batch): r18_32 = ResNet-18 (CIFAR stem) at 32 px, batch
256; r18_32_b64 the same at batch 64; r50_96 = ResNet-50 at 96 px, batch 32; r50_224 = ResNet-50
at 224 px, batch 32; vit_t_32 = ViT-Tiny, patch 4, 32 px, batch 64 (a CPU-sized ViT: 8x8
patches); vit_s16_224 = ViT-S/16 at 224 px, batch 32 (DINO's and MoCo v3's ViT). SwAV adds its
multi-crop: 2 crops at the case's size + 6 small ones (``small`` px), so its images/s count
images of 8 crops; DINO takes the same crops (2 global + 6 local) and its 65536-wide head (on a
ViT: its ViT-S recipe, drop path 0.1). Barlow Twins and VICReg keep their 8192-8192-8192
projectors; MoCo v3 on a ViT its 4096-4096-256 projector. Synthetic inputs, so this measures
the step alone (benchmarks/input_pipeline.py measures the data). img/s = global batch / median
step time (one warm-up step after compiling, then ``--steps`` timed one by one). TFLOP/s is
XLA's count of one device's floating-point operations in the step (``mfu.step_flops``) over the
median step time, and MFU that over the device's peak: ``mfu.PEAK_BF16_TFLOPS`` for bfloat16 on
the GPUs and TPUs it names, else ``--peak_tflops`` (e.g. MoCo R50@224 bf16 on a GPU:
``--cases=r50_224 --dtypes=bfloat16``). Each case runs in its own process so that compile
caches and XLA flags do not leak between cases.

``--compare_torch`` times a plain PyTorch MoCo v2 step with the same shapes
(benchmarks/torch_reference.py) against jssl's MoCo step, queue 4096 on both sides: each case
runs jssl then PyTorch, one process at a time, for ``--rounds`` rounds, and prints pairs/s
(global batch / median step time), the jssl / PyTorch ratio of each round and that of the CPU
seconds a step takes (all threads; less distorted by other jobs on the machine), and the load
average when the case started (PyTorch runs with OMP_WAIT_POLICY=PASSIVE unless it is set, see
``spawn``, and with channels-last activations unless ``--torch_layout=nchw``); ``--with_plain``
adds a minimal JAX step of the same model (benchmarks/plain_step.py) and the ratios of the two
steps' compile times (``jit(...).lower(...).compile()``, tracing included), wall and process
CPU seconds (the CPU ratio moves less when other jobs share the machine), and of their
processes' peak resident memory (both import the same modules). Without
``--cases``/``--dtypes`` it runs issue 11's five cases: r18_32_b64, r18_32 and r50_96 in
float32, r18_32_b64 and r50_96 in bfloat16.

``--compare_on_device`` times every row a second time with ``data.augment.on_device``: the step
is fed uint8 crops and their seeds and runs the method's colour jitter, grayscale, blur,
solarisation and normalisation itself (jssl/data/device_augment.py), as training with that
option does; the row adds that step's img/s, the difference of the two median step times, and
the median time of the augmentation alone (jitted by itself, same batch), which a noisy machine
moves less than it moves a difference of two steps.
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import mfu  # benchmarks/mfu.py, beside this script
from step_cases import CASES, TORCH_CASES, TORCH_QUEUE, case_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _host_peak_bytes() -> int:
    """The process's peak resident memory (RSS)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_bytes(device=None) -> int:
    peak = (device.memory_stats() or {}).get("peak_bytes_in_use") if device else None
    return _host_peak_bytes() if peak is None else peak  # CPU: the process's peak RSS


def run_case(
    case: str,
    dtype: str,
    steps: int,
    method_name: str,
    queue_size: int,
    on_device: bool = False,
    bare: bool = False,
) -> dict:
    """Runs in a child process: builds the method's step, compiles it and times each step."""
    sys.path.insert(0, ROOT)
    import bare_step  # benchmarks/, on the path in the child
    import jax

    from jssl import data, methods, parallel
    from jssl.data import device_augment
    from jssl.engines.train import init_state, make_optimizer
    from jssl.train_step import make_train_step, stop_flags

    spec = CASES[case]
    config = case_config(method_name, spec, dtype, queue_size, on_device)
    mesh = parallel.make_mesh()
    method = methods.get(config, steps_per_epoch=1000)
    tx, schedule = make_optimizer(config, method, steps_per_epoch=1000)
    state = init_state(config, method, tx, mesh)
    augment = device_augment.make_batch_augment(config.data)
    step = make_train_step(method, tx, schedule, mesh, augment=augment)
    if bare:  # the same method without jssl's machinery around it (bare_step.py)
        step = bare_step.make_bare_step(method, tx, mesh)

    host = data.synthetic_batch(config.data, spec["batch"])
    batch_arrays = parallel.host_batch_to_global(host, mesh)
    stop = stop_flags(mesh, False)
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = step.lower(state, batch_arrays, stop)
    compiled = lowered.compile()
    compile_s, compile_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    flops = mfu.step_flops(lowered)
    state, metrics = compiled(state, batch_arrays, stop)  # warm-up
    jax.block_until_ready((state, metrics))
    times, cpu_times = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        state, metrics = compiled(state, batch_arrays, stop)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    augment_s = []
    if augment is not None:  # the same augmentation alone, one jitted call per batch
        augment_alone = jax.jit(augment)
        jax.block_until_ready(augment_alone(batch_arrays))
        for _ in range(steps):
            t0 = time.perf_counter()
            jax.block_until_ready(augment_alone(batch_arrays))
            augment_s.append(time.perf_counter() - t0)
    device = jax.devices()[0]
    return dict(
        augment_s=augment_s,
        devices=f"{jax.device_count()}x{device.platform}",
        step_s=times,
        cpu_s=cpu_times,
        compile_s=compile_s,
        compile_cpu_s=compile_cpu_s,
        peak_gib=_peak_bytes(device) / 2**30,
        host_peak_gib=_host_peak_bytes() / 2**30,
        loss=float(metrics["loss"]),
        flops=flops,
        device_kind=device.device_kind,
    )


def run_torch_case(
    case: str, dtype: str, steps: int, queue_size: int, channels_last: bool = True
) -> dict:
    """Runs in a child process: the PyTorch reference step of the same shapes."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import torch_reference  # imports torch, a development dependency

    result = torch_reference.run_case(CASES[case], dtype, steps, queue_size, channels_last)
    return dict(result, peak_gib=_peak_bytes() / 2**30)


def spawn(job: dict) -> dict:
    """Runs ``job`` (keys: impl, case, dtype, steps, method, queue, default_flags) in a fresh
    process and returns its result with ``per_s`` = global batch / median step time."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if job.get("default_flags"):
        env["JSSL_XLA_DEFAULTS"] = "1"
    if job["impl"] == "torch":
        # PyTorch's OpenMP threads spin while they wait by default: on a machine shared with
        # other jobs that made its r18_32_b64 step take 5.1-7.1 CPU s instead of 2.7 (one run
        # each, load 11-13), which would flatter jssl. Set OMP_WAIT_POLICY to override.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    out = subprocess.run(
        [sys.executable, __file__, "--_child", json.dumps(job)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        raise RuntimeError(f"case {job} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["per_s"] = CASES[job["case"]]["batch"] / statistics.median(result["step_s"])
    return result


def _child(job: dict) -> None:
    if job["impl"] == "torch":
        channels_last = job.get("layout", "channels_last") == "channels_last"
        result = run_torch_case(
            job["case"], job["dtype"], job["steps"], job["queue"], channels_last
        )
        print(json.dumps(result))
        return
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    if not os.environ.get("JSSL_XLA_DEFAULTS"):
        from jssl import parallel

        parallel.configure_cpu_defaults()
    # Both JAX steps' processes import the same modules (jssl's train engine brings
    # TensorFlow), so that their peak RSS differs only by what building and running the step
    # holds: --with_plain compares the two.
    import plain_step

    from jssl.engines import train  # noqa: F401

    # As launch.py does after its imports, for both JAX steps (the minimal step's trace did
    # not change with it; jssl's lost the 0.2 s that full collections spent rescanning them).
    gc.freeze()
    if job["impl"] == "plain":
        config = case_config("moco", CASES[job["case"]], job["dtype"], job["queue"])
        result = plain_step.run_case(config, job["steps"])
        print(json.dumps(dict(result, host_peak_gib=_host_peak_bytes() / 2**30)))
        return
    args = job["case"], job["dtype"], job["steps"], job["method"], job["queue"]
    result = run_case(*args, job.get("on_device", False), job.get("bare", False))
    print(json.dumps(result))


def compare_torch(
    pairs: list[tuple[str, str]], steps: int, rounds: int, plain: bool, torch_layout: str
) -> None:
    """jssl's MoCo step, then PyTorch's (then the plain JAX step's), case by case, ``rounds``
    times; then the ratios. The CPU ratio compares the median process CPU seconds per step
    (all threads), which a machine shared with other jobs distorts less than wall time."""
    header = (
        f"{'round':>5} {'case':<11} {'dtype':<9} {'jssl pairs/s':>12} {'torch pairs/s':>13}"
        f" {'jssl/torch':>10} {'CPU s/step jssl':>15} {'torch':>6} {'CPU jssl/torch':>14}"
        f" {'jssl compile s':>14} {'torch 1st step s':>16} {'jssl loss':>9} {'torch loss':>10}"
        f" {'load':>5}"
    )
    if plain:
        header += f" {'plain pairs/s':>13} {'plain compile s':>15} {'jssl/plain':>10}"
        header += f" {'compile jssl/plain':>18} {'CPU':>5}"
        header += f" {'RSS GiB jssl':>12} {'plain':>6} {'RSS jssl/plain':>14}"
    print(f"PyTorch layout: {torch_layout}")
    print(header)
    ratios: dict[tuple[str, str], list[tuple[float, float]]] = {}
    plain_ratios: dict[tuple[str, str], list[tuple[float, ...]]] = {}
    for r in range(rounds):
        for case, dtype in pairs:
            job = dict(case=case, dtype=dtype, steps=steps, method="moco", queue=TORCH_QUEUE)
            load = os.getloadavg()[0]
            ours = spawn(dict(job, impl="jssl"))
            ref = spawn(dict(job, impl="torch", layout=torch_layout))
            ratio = ours["per_s"] / ref["per_s"]
            cpu_ours, cpu_ref = statistics.median(ours["cpu_s"]), statistics.median(ref["cpu_s"])
            ratios.setdefault((case, dtype), []).append((ratio, cpu_ref / cpu_ours))
            line = (
                f"{r + 1:>5} {case:<11} {dtype:<9} {ours['per_s']:12.1f} {ref['per_s']:13.1f}"
                f" {ratio:10.2f} {cpu_ours:15.2f} {cpu_ref:6.2f} {cpu_ref / cpu_ours:14.2f}"
                f" {ours['compile_s']:14.1f} {ref['first_s']:16.1f} {ours['loss']:9.3f}"
                f" {ref['loss']:10.3f} {load:5.1f}"
            )
            if plain:
                p = spawn(dict(job, impl="plain"))
                versus = (
                    ours["per_s"] / p["per_s"],
                    ours["compile_s"] / p["compile_s"],
                    ours["compile_cpu_s"] / p["compile_cpu_s"],
                    ours["host_peak_gib"] / p["host_peak_gib"],
                )
                plain_ratios.setdefault((case, dtype), []).append(versus)
                line += (
                    f" {p['per_s']:13.1f} {p['compile_s']:15.1f} {versus[0]:10.2f}"
                    f" {versus[1]:18.2f} {versus[2]:5.2f} {ours['host_peak_gib']:12.2f}"
                    f" {p['host_peak_gib']:6.2f} {versus[3]:14.2f}"
                )
            print(line, flush=True)
    print("\njssl / PyTorch per round (pairs/s; CPU s per step), and their geometric means:")
    for (case, dtype), rs in ratios.items():
        wall = statistics.geometric_mean(x for x, _ in rs)
        cpu = statistics.geometric_mean(c for _, c in rs)
        per_round = "  ".join(f"{x:.2f}; {c:.2f}" for x, c in rs)
        print(f"  {case:<11} {dtype:<9} {per_round}  -> {wall:.2f}; {cpu:.2f}")
    if plain_ratios:
        print("\njssl / plain JAX step, geometric means of the rounds (pairs/s; compile wall;")
        print("compile CPU; peak RSS):")
        for (case, dtype), rs in plain_ratios.items():
            means = [statistics.geometric_mean(r[i] for r in rs) for i in range(4)]
            print(f"  {case:<11} {dtype:<9} " + "; ".join(f"{m:.2f}" for m in means))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", default=None, help="default r18_32,r50_224")
    p.add_argument("--dtypes", default=None, help="default float32,bfloat16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--methods", default="moco", help="comma-separated names of jssl.methods")
    p.add_argument("--queue_size", type=int, default=16384, help="MoCo's queue")
    p.add_argument("--compare_cpu_flags", action="store_true")
    p.add_argument("--compare_torch", action="store_true")
    p.add_argument(
        "--compare_bare",
        action="store_true",
        help="time each row's method again without jssl's machinery around it (bare_step.py)",
    )
    p.add_argument(
        "--compare_on_device",
        action="store_true",
        help="time each row again with data.augment.on_device (augmentation inside the step)",
    )
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
        help="--compare_torch: PyTorch's activation layout (channels_last ran 1.00-1.10x the "
        "pairs/s of NCHW here, so it is the default)",
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
    p.add_argument("--_child", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args._child:
        _child(json.loads(args._child))
        return
    if args.compare_torch:
        if args.cases is None and args.dtypes is None:
            pairs = list(TORCH_CASES)
        else:
            cases = (args.cases or "r18_32_b64,r18_32,r50_96").split(",")
            pairs = [(c, d) for c in cases for d in (args.dtypes or "float32").split(",")]
        compare_torch(pairs, args.steps, args.rounds, args.with_plain, args.torch_layout)
        return

    cases = (args.cases or "r18_32,r50_224").split(",")
    dtypes = (args.dtypes or "float32,bfloat16").split(",")
    header = f"{'method':<12} {'case':<11} {'dtype':<9} {'devices':<8} {'img/s':>8}"
    header += f" {'compile s':>9} {'peak GiB':>8} {'TFLOP/s':>8} {'MFU':>6}"
    if args.compare_cpu_flags:
        header += f" {'img/s XLA defaults':>18} {'speed-up':>8}"
    if args.compare_on_device:
        header += f" {'img/s aug. on device':>20} {'aug. ms/step':>12} {'aug. alone ms':>13}"
    if args.compare_bare:
        header += f" {'bare img/s':>10} {'jssl/bare img/s':>15} {'compile':>7} {'peak':>5}"
    if args.reference:
        header += f" {'ratio':>6}"
    print(header)
    rows = [(m, c, d) for m in args.methods.split(",") for c in cases for d in dtypes]
    reference = None
    if args.reference:
        ref_method, ref_case = args.reference.split(":")
        rows.insert(0, (ref_method, ref_case, dtypes[0]))
    for method, case, dtype in rows:
        job = dict(
            impl="jssl", case=case, dtype=dtype, steps=args.steps, method=method,
            queue=args.queue_size,
        )  # fmt: skip
        r = spawn(job)
        reference = reference or r["per_s"]
        line = (
            f"{method:<12} {case:<11} {dtype:<9} {r['devices']:<8} "
            f"{r['per_s']:8.1f} {r['compile_s']:9.1f} {r['peak_gib']:8.2f}"
        )
        # Per device: XLA's count of the step's operations over the median step time.
        tflops = r["flops"] / statistics.median(r["step_s"]) / 1e12 if r["flops"] else None
        peak = mfu.peak_tflops(r["device_kind"], dtype, args.peak_tflops)
        line += f" {tflops:8.2f}" if tflops else f" {'-':>8}"
        line += f" {tflops / peak:6.1%}" if tflops and peak else f" {'-':>6}"
        if args.compare_cpu_flags:
            d = spawn(dict(job, default_flags=True))
            line += f" {d['per_s']:18.1f} {r['per_s'] / d['per_s']:7.2f}x"
        if args.compare_on_device:
            a = spawn(dict(job, on_device=True))
            cost = statistics.median(a["step_s"]) - statistics.median(r["step_s"])
            alone = statistics.median(a["augment_s"])
            line += f" {a['per_s']:20.1f} {1000 * cost:12.1f} {1000 * alone:13.1f}"
        if args.compare_bare:
            b = spawn(dict(job, bare=True))
            line += f" {b['per_s']:10.1f} {r['per_s'] / b['per_s']:15.2f}"
            line += f" {r['compile_s'] / b['compile_s']:7.2f} {r['peak_gib'] / b['peak_gib']:5.2f}"
        if args.reference:
            line += f" {r['per_s'] / reference:6.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
