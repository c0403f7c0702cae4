"""Throughput of the SSL training input pipeline, two views or multi-crop, on this host.

    python benchmarks/input_pipeline.py --source=demo --image_size=32 --batch_size=256
    python benchmarks/input_pipeline.py --source=folder --image_size=224 --batch_size=128
    python benchmarks/input_pipeline.py --source=folder --num_crops=2,6 --crop_sizes=224,96 \
        --crop_scales=0.14,1,0.05,0.14        # SwAV's multi-crop

--source=demo reads the built-in demo set (generated into --data_dir on first use); --source=folder
writes a synthetic ImageNet-like folder of random JPEGs (--image_shape, default 375x500) to a
temporary directory, or reads --data_dir if given. Prints examples/s and crops/s of this host.

    python benchmarks/input_pipeline.py --source=folder --image_size=224 --batch_size=64 \
        --compare_on_device

--compare_on_device times tf.data's two host paths in one run, the full augmentation on the
host and the crop + flip only of data.augment.on_device=True (its host cost), prints their
ratio, then times the jitted on-device augmentation alone (jssl.data.device_augment) on a batch
of uint8 crops of the same shapes on this process's first JAX device: what it adds to the step.

    python benchmarks/input_pipeline.py --source=folder --image_size=224 --batch_size=64 \
        --compare_loaders                     # MoCo's and DINO's views, tf.data and grain

--compare_loaders times, for each method's views in --views (its config's data.augment:
configs/moco.py's two 224 px crops, configs/dino.py:vit_small's 2 x 224 + 10 x 96 px), tf.data
with the whole view on the host, tf.data with data.augment.on_device=True, and grain (always
crop + flip only) with 1 and 2 worker processes (data.workers), and prints the ratios grain /
tf.data on_device per CPU second and 2 / 1 workers in images/s. --loader and --workers choose
the pipeline of a single-path run.

Every path is read as the train engine reads it (jssl.training.batches.pipeline_batches: grain
from one iterator, so its workers start once). Images per CPU second count the user + system
time of this process (all of tf.data's threads) and of its child processes (grain's workers),
read with psutil while they run; the first batch's time (grain: the workers' start) and
--warmup batches are left out of the rates and the first batch's time is reported on its own.

Each run prints its figures and writes them with the command and the machine to
benchmarks/results/input_pipeline-<source>-<size>px[-<mode>].json (``--results``,
``--no_results``); benchmarks/report.py makes docs/benchmarks.md from those files.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402  (orbax-checkpoint's dependency)
import results  # noqa: E402  benchmarks/, beside this script
from PIL import Image  # noqa: E402

import jssl.data as data  # noqa: E402


def write_synthetic_folder(root: str, num_images: int, shape: tuple[int, int]) -> None:
    """num_images random-noise JPEGs in 10 classes under root/train/<class>/."""
    rng = np.random.default_rng(0)
    height, width = shape
    # Smooth noise compresses like photographs do; white noise would make huge, slow JPEGs.
    for i in range(num_images):
        class_dir = os.path.join(root, "train", f"class_{i % 10}")
        os.makedirs(class_dir, exist_ok=True)
        small = rng.integers(0, 255, (height // 8, width // 8, 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((width, height), Image.BILINEAR)
        image.save(os.path.join(class_dir, f"{i:06d}.jpg"), quality=90)


def cpu_seconds() -> np.ndarray:
    """User + system CPU seconds of this process (every thread: tf.data's) and of its live
    child processes (grain's workers), read while they run, so that the difference over a window
    counts the work done in it and not the workers' start-up."""
    me = psutil.Process()
    children = 0.0
    for child in me.children(recursive=True):
        try:
            children += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:  # exited since listed
            pass
    return np.array([sum(me.cpu_times()[:2]), children])


@dataclasses.dataclass(frozen=True)
class Rate:
    """A pipeline's throughput over the timed batches."""

    wall: float  # images per wall second
    per_cpu: float  # images per CPU second (this process and its children)
    first_batch_s: float  # wall seconds to the first batch: building, grain's workers' start
    cores: float  # CPU seconds per wall second: the cores the pipeline kept busy
    in_children: float  # the fraction of the CPU time spent in child processes


def training_batches(config) -> Iterator[dict]:
    """The host batches of a long run, as the train engine reads them (one grain iterator for
    the whole run, tf.data's built per epoch)."""
    from jssl.checkpoints.manager import DataPosition
    from jssl.training import batches, progress

    steps = data.steps_per_epoch(config)
    plan = progress.Plan(steps_per_epoch=steps, num_epochs=1000, max_steps=0, log_every_steps=1)
    run = ml_collections.ConfigDict({"data": config, "seed": 0})
    positioned = batches.pipeline_batches(run, DataPosition(0, 0), plan)
    try:
        for _, _, batch in positioned:
            yield batch
    finally:
        positioned.close()  # stops grain's workers


def images_per_second(config, steps: int, warmup: int) -> Rate:
    """Throughput of this process's training pipeline over ``steps`` batches after ``warmup``
    (at least 1: the first batch's time is reported on its own)."""
    warmup = max(warmup, 1)
    begin = time.perf_counter()
    batches = training_batches(config)
    try:
        for b, _ in enumerate(batches, 1):
            if b == 1:
                first_batch_s = time.perf_counter() - begin
            if b == warmup:
                start, cpu = time.perf_counter(), cpu_seconds()
            if b == warmup + steps:
                wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
                break
    finally:
        batches.close()
    examples, total = steps * config.batch_size, cpu.sum()
    return Rate(examples / wall, examples / total, first_batch_s, total / wall, cpu[1] / total)


def device_augment_cost(config, batch_size: int, steps: int) -> dict:
    """Time of the jitted on-device augmentation alone on a host-shaped batch of uint8 crops."""
    import jax

    from jssl.data import device_augment

    config.augment.on_device = True
    augment = jax.jit(device_augment.make_batch_augment(config))
    rng = np.random.default_rng(0)
    batch = {"crops": [], "aug_seeds": []}
    for group in data.crop_groups(config):
        shape = (batch_size, group.num_crops, group.size, group.size, 3)
        batch["crops"].append(rng.integers(0, 256, shape, dtype=np.uint8))
        seeds = rng.integers(0, 2**32, (batch_size, group.num_crops, 3, 2), dtype=np.uint32)
        batch["aug_seeds"].append(seeds)
    batch = jax.device_put({k: tuple(v) for k, v in batch.items()})
    cpu = time.process_time()
    jax.block_until_ready(augment(batch))  # compile
    compile_cpu = time.process_time() - cpu
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        out = augment(batch)
    jax.block_until_ready(out)
    wall = (time.perf_counter() - start) / steps
    cpu = (time.process_time() - cpu) / steps
    print(
        f"on-device augmentation alone on {jax.devices()[0].platform} "
        f"({jax.devices()[0].device_kind}), batch {batch_size}: {wall * 1e3:.1f} ms/batch wall, "
        f"{cpu * 1e3:.1f} ms CPU time/batch, {batch_size / wall:.0f} images/s "
        f"(compile {compile_cpu:.1f} s CPU)"
    )
    return {
        "path": f"on-device augmentation alone ({jax.devices()[0].device_kind})",
        "images/s": results.rounded(batch_size / wall),
        "ms/batch": results.rounded(wall * 1e3),
        "CPU ms/batch": results.rounded(cpu * 1e3),
        "compile CPU s": results.rounded(compile_cpu),
    }


# The paths --compare_loaders times: (name, data config fields).
LOADER_PATHS = (
    ("tf.data, whole view on the host", {"loader": "tf", "augment.on_device": False}),
    ("tf.data, crop + flip (on_device=True)", {"loader": "tf", "augment.on_device": True}),
    ("grain, 1 worker (crop + flip)", {"loader": "grain", "workers": 1}),
    ("grain, 2 workers (crop + flip)", {"loader": "grain", "workers": 2}),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=["demo", "folder"], default="demo")
    parser.add_argument("--data_dir", default=None, help="TFDS data_dir or image folder root")
    parser.add_argument("--image_size", type=int, default=32, help="output crop side S")
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--num_crops", default="2", help="crops per group, e.g. 2 or 2,6")
    parser.add_argument("--crop_sizes", default="", help="side per group; default image_size")
    parser.add_argument("--crop_scales", default="", help="min,max per group, flattened")
    parser.add_argument("--steps", type=int, default=20, help="timed batches (after warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches, at least 1")
    parser.add_argument("--num_images", type=int, default=1024, help="synthetic folder size")
    parser.add_argument("--image_shape", type=int, nargs=2, default=(375, 500), help="H W")
    parser.add_argument("--cache", action="store_true", help="data.cache=True (demo)")
    parser.add_argument("--loader", default="auto", help="data.loader: auto, tf, grain, numpy")
    parser.add_argument("--workers", type=int, default=-1, help="data.workers (grain)")
    parser.add_argument(
        "--on_device", action="store_true", help="data.augment.on_device=True: crop + flip only"
    )
    parser.add_argument(
        "--compare_on_device",
        action="store_true",
        help="both host paths in one run, their ratio, and the on-device augmentation's time",
    )
    parser.add_argument("--device_steps", type=int, default=5, help="timed augmentation calls")
    parser.add_argument(
        "--compare_loaders",
        action="store_true",
        help="tf.data (host, on_device) and grain (1, 2 workers) for each of --views",
    )
    parser.add_argument(
        "--views",
        default="moco,dino:vit_small",
        help="--compare_loaders: configs/<name>.py[:<preset>] whose data.augment to use",
    )
    results.add_flags(parser)
    return parser.parse_args()


def data_config(args: argparse.Namespace) -> ml_collections.ConfigDict:
    """jssl's data config of the flags (the folder's data_dir is set by the caller)."""
    config = data.default_config()
    config.update(
        dict(
            source=args.source,
            image_size=args.image_size,
            batch_size=args.batch_size,
            cache=args.cache,
            loader=args.loader,
            workers=args.workers,
        )
    )
    config.augment.num_crops = tuple(int(k) for k in args.num_crops.split(","))
    if args.crop_sizes:
        config.augment.crop_sizes = tuple(int(k) for k in args.crop_sizes.split(","))
    if args.crop_scales:
        flat = [float(x) for x in args.crop_scales.split(",")]
        config.augment.crop_scale = tuple(zip(flat[::2], flat[1::2], strict=True))
    return config


def views_label(config) -> str:
    """The crops of the config's groups, e.g. "2 x 224 + 10 x 96"."""
    counts: dict[int, int] = {}
    for group in data.crop_groups(config):
        counts[group.size] = counts.get(group.size, 0) + group.num_crops
    return " + ".join(f"{k} x {size}" for size, k in counts.items())


def rate_row(rate: Rate, total_crops: int, **first) -> dict:
    """A table row of ``rate``, after the row's ``first`` columns."""
    return {
        **first,
        "images/s": results.rounded(rate.wall),
        "crops/s": results.rounded(rate.wall * total_crops),
        "images per CPU s": results.rounded(rate.per_cpu),
        "CPU cores busy": results.rounded(rate.cores, 3),
        "CPU % in workers": results.rounded(100 * rate.in_children, 3),
        "first batch s": results.rounded(rate.first_batch_s, 3),
    }


def compare_host_paths(config, args, label: str) -> tuple[list[dict], list[str]]:
    """One host path (--on_device), or with --compare_on_device both and the on-device
    augmentation's own time: the rows and the ratio."""
    paths = [False, True] if args.compare_on_device else [args.on_device]
    if args.compare_on_device:  # tf.data's two host paths (grain and numpy crop on the host)
        if args.loader not in ("auto", "tf"):
            raise SystemExit(f"--compare_on_device times tf.data: drop --loader={args.loader}")
        config.loader = "tf"
    total_crops = data.total_crops(config)
    rates, rows, headline = {}, [], []
    for on_device in paths:
        config.augment.on_device = on_device
        rate = images_per_second(config, args.steps, args.warmup)
        rates[on_device] = rate
        crop_only = data.backend.views_on_device(config)
        what = "crop + flip on the host" if crop_only else "full host augmentation"
        what += " (on_device=True)" if on_device else ""
        print(
            f"{label}: {what}: {rate.wall:.0f} images/s ({rate.wall * total_crops:.0f} "
            f"crops/s), {rate.per_cpu:.1f} images per CPU second"
        )
        rows.append(rate_row(rate, total_crops, path=what))
    if args.compare_on_device:
        headline = [
            "host pipeline, crop + flip only (on_device=True) / full host augmentation: "
            f"{rates[True].wall / rates[False].wall:.2f}x images/s, "
            f"{rates[True].per_cpu / rates[False].per_cpu:.2f}x images per CPU second"
        ]
        print(headline[0])
        rows.append(device_augment_cost(config, args.batch_size, args.device_steps))
    return rows, headline


def method_augment(spec: str) -> ml_collections.ConfigDict:
    """data.augment of configs/<name>.py's get_config(preset), for spec "<name>[:<preset>]"."""
    name, _, preset = spec.partition(":")
    try:
        module = importlib.import_module(f"configs.{name}")
    except ModuleNotFoundError as e:
        raise SystemExit(f"--views={spec!r}: there is no configs/{name}.py") from e
    return ml_collections.ConfigDict(module.get_config(preset).data.augment.to_dict())


def compare_loaders(config, args) -> tuple[list[dict], list[str]]:
    """Every path of LOADER_PATHS for each method's views: the rows and the ratios."""
    rows, headline = [], []
    for spec in args.views.split(","):
        config.augment = method_augment(spec)
        views = f"{spec} ({views_label(config)})"
        rates = {}
        for path, fields in LOADER_PATHS:
            run = ml_collections.ConfigDict(config.to_dict())
            run.update_from_flattened_dict(fields)
            rate = images_per_second(run, args.steps, args.warmup)
            rates[path] = rate
            print(
                f"{views}, {path}: {rate.wall:.0f} images/s, {rate.per_cpu:.1f} images per CPU "
                f"second, {rate.cores:.2f} cores busy ({rate.in_children:.0%} in worker "
                f"processes), first batch after {rate.first_batch_s:.1f} s"
            )
            rows.append(rate_row(rate, data.total_crops(run), views=views, path=path))
        tf_device, grain_1, grain_2 = (rates[p] for p, _ in LOADER_PATHS[1:])
        headline += [
            f"{views}: grain 1 worker / tf.data on_device=True: "
            f"{grain_1.per_cpu / tf_device.per_cpu:.2f}x images per CPU second",
            f"{views}: grain 2 workers / 1 worker: {grain_2.wall / grain_1.wall:.2f}x images/s",
        ]
    for line in headline:
        print(line)
    return rows, headline


def main() -> None:
    args = parse_args()
    load_at_start = os.getloadavg()[0]
    config = data_config(args)
    tmp = None
    if args.source == "folder" and args.data_dir is None:
        tmp = tempfile.TemporaryDirectory()
        print(f"writing {args.num_images} synthetic JPEGs {tuple(args.image_shape)} ...")
        write_synthetic_folder(tmp.name, args.num_images, tuple(args.image_shape))
        config.data_dir = tmp.name
    else:
        config.data_dir = args.data_dir or os.path.join(tempfile.gettempdir(), "jssl_bench_tfds")

    label = (
        f"source={args.source} S={args.image_size} batch={args.batch_size} "
        f"crops={args.num_crops} sizes={args.crop_sizes or args.image_size} "
        f"steps/epoch={data.steps_per_epoch(config)} cpus={os.cpu_count()}"
    )
    if args.compare_loaders:
        label = (
            f"source={args.source} S={args.image_size} batch={args.batch_size} "
            f"images={data.num_examples(config, config.train_split)} cpus={os.cpu_count()}"
        )
        rows, headline = compare_loaders(config, args)
    else:
        rows, headline = compare_host_paths(config, args, label)
    if tmp is not None:
        tmp.cleanup()
    load_at_end = os.getloadavg()[0]
    load = f"load average (1 min) {load_at_start:.2f} at the start, {load_at_end:.2f} at the end"
    print(f"{load} on {os.cpu_count()} cores")
    results.record(
        result_name(args),
        rows,
        args=args,
        measures=results.summary(__doc__),
        headline=headline,
        notes=(
            f"{label}; {load}. Images per CPU second count the user + system time of this "
            "process (all of tf.data's threads) and of its child processes (grain's workers, "
            "read with psutil while they run) over the timed batches; first batch s is the "
            "wall time to the first batch (grain: its workers' start-up), left out of the rates."
        ),
    )


def result_name(args: argparse.Namespace) -> str:
    """The results file's name: input_pipeline-<source>-<size>px[-crops<k>][-<mode>]."""
    name = f"input_pipeline-{args.source}-{args.image_size}px"
    if args.compare_loaders:
        return name + "-loaders"
    if args.num_crops != "2":
        name += "-crops" + args.num_crops.replace(",", "+")
    if args.loader not in ("auto", "tf"):
        name += f"-{args.loader}"
    if args.compare_on_device or args.on_device:
        name += "-compare_on_device" if args.compare_on_device else "-on_device"
    return name


if __name__ == "__main__":
    main()
