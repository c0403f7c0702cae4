r"""Images/s, compile time and peak memory of the train step, per method, model and dtype.

  python benchmarks/train_step.py                         # all cases on the present devices
  python benchmarks/train_step.py --cases=r18_32 --steps=5
  python benchmarks/train_step.py --methods=moco,simclr,swav --cases=r18_32 --dtypes=float32
  python benchmarks/train_step.py --compare_cpu_flags     # jssl's CPU XLA flags vs XLA's defaults

Cases: r18_32 = ResNet-18 (CIFAR stem) at 32 px, global batch 256; r50_224 = ResNet-50 at
224 px, global batch 32; each in float32 and bfloat16. SwAV adds its multi-crop: 2 crops at the
case's size + 6 small ones (16 px for r18_32, 96 px for r50_224), so its images/s count images
of 8 crops; DINO takes the same crops (2 global + 6 local) and its 65536-wide head. Barlow
Twins and VICReg keep their 8192-8192-8192 projectors. Synthetic inputs, so this measures the
step alone (benchmarks/input_pipeline.py measures the data). Each case runs in its own process
so that compile caches and XLA flags do not leak between cases.
"""

import argparse
import importlib
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {
    "r18_32": dict(trunk="resnet18", cifar_stem=True, image_size=32, small=16, batch=256, head=512),
    "r50_224": dict(
        trunk="resnet50", cifar_stem=False, image_size=224, small=96, batch=32, head=2048
    ),
}


def run_case(case: str, dtype: str, steps: int, method_name: str = "moco") -> dict:
    """Runs in a child process: builds the method's step and times it."""
    sys.path.insert(0, ROOT)
    import jax

    from jssl import data, methods, parallel
    from jssl.engines.train import init_state, make_optimizer
    from jssl.train_step import make_train_step, stop_flags

    spec = CASES[case]
    # MoCo v3's default preset is ViT-S/16; its ResNet recipe fits these cases.
    preset = "resnet50" if method_name == "mocov3" else ""
    config = importlib.import_module(f"configs.{method_name}").get_config(preset)
    config.model.trunk = spec["trunk"]
    config.model.cifar_stem = spec["cifar_stem"]
    config.model.head_dims = (spec["head"], 2048, 128)
    if method_name == "supervised":
        config.model.head_dims = (spec["head"], 1000)  # the linear classifier
    if method_name in ("barlow_twins", "vicreg"):  # their 8192-8192-8192 projector is the cost
        config.model.head_dims = (spec["head"], 8192, 8192, 8192)
    if method_name == "dino":  # its own DINO head (method.head_*), no projector MLP
        config.model.head_dims = ()
    config.model.dtype = dtype
    config.data.image_size = spec["image_size"]
    config.data.batch_size = spec["batch"]
    if method_name == "moco":
        config.method.queue_size = 16384
    if method_name == "swav":
        config.data.augment.crop_sizes = (spec["image_size"], spec["small"])
    if method_name in ("byol", "simsiam", "mocov3"):  # the predictor's ratio of each paper
        config.method.predictor_dims = (128, 32 if method_name == "simsiam" else 2048, 128)
    if method_name == "dino":  # 2 global + 6 local crops, as SwAV's
        config.data.augment.num_crops = (1, 1, 6)
        config.data.augment.crop_sizes = (spec["image_size"], spec["image_size"], spec["small"])
    mesh = parallel.make_mesh()
    method = methods.get(config, steps_per_epoch=1000)
    tx, schedule = make_optimizer(config, method, steps_per_epoch=1000)
    state = init_state(config, method, tx, mesh)
    step = make_train_step(method, tx, schedule, mesh)

    batch = spec["batch"]
    host = data.synthetic_batch(config.data, batch)
    batch_arrays = parallel.host_batch_to_global(host, mesh)
    stop = stop_flags(mesh, False)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch_arrays, stop).compile()
    compile_s = time.perf_counter() - t0
    state, metrics = compiled(state, batch_arrays, stop)  # warm-up
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch_arrays, stop)
    jax.block_until_ready(metrics)
    elapsed = time.perf_counter() - t0
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    if peak is None:  # CPU: the process's peak resident memory
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(
        case=case,
        dtype=dtype,
        devices=f"{jax.device_count()}x{device.platform}",
        images_per_s=steps * batch / elapsed,
        compile_s=compile_s,
        peak_gib=peak / 2**30,
        loss=float(metrics["loss"]),
    )


def spawn(case: str, dtype: str, steps: int, default_flags: bool, method: str = "moco") -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if default_flags:
        env["JSSL_XLA_DEFAULTS"] = "1"
    out = subprocess.run(
        [sys.executable, __file__, "--_child", case, dtype, str(steps), method],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        raise RuntimeError(f"case {method}/{case}/{dtype} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", default="r18_32,r50_224")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--methods", default="moco", help="comma-separated names of jssl.methods")
    p.add_argument("--compare_cpu_flags", action="store_true")
    p.add_argument("--_child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args._child:
        if not os.environ.get("JSSL_XLA_DEFAULTS"):
            sys.path.insert(0, ROOT)
            from jssl import parallel

            parallel.configure_cpu_defaults()
        case, dtype, steps, method = args._child
        print(json.dumps(run_case(case, dtype, int(steps), method)))
        return

    header = f"{'method':<12} {'case':<9} {'dtype':<9} {'devices':<8} {'img/s':>8}"
    header += f" {'compile s':>9} {'peak GiB':>8}"
    if args.compare_cpu_flags:
        header += f" {'img/s XLA defaults':>18} {'speed-up':>8}"
    print(header)
    for method in args.methods.split(","):
        for case in args.cases.split(","):
            for dtype in args.dtypes.split(","):
                r = spawn(case, dtype, args.steps, default_flags=False, method=method)
                line = (
                    f"{method:<12} {case:<9} {dtype:<9} {r['devices']:<8} "
                    f"{r['images_per_s']:8.1f} {r['compile_s']:9.1f} {r['peak_gib']:8.2f}"
                )
                if args.compare_cpu_flags:
                    d = spawn(case, dtype, args.steps, default_flags=True, method=method)
                    speedup = r["images_per_s"] / d["images_per_s"]
                    line += f" {d['images_per_s']:18.1f} {speedup:7.2f}x"
                print(line, flush=True)


if __name__ == "__main__":
    main()
