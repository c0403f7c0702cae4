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

--compare_on_device times both host paths in one run, the full augmentation on the host and
the crop + flip only of data.augment.on_device=True (its host cost), prints their ratio, then
times the jitted on-device augmentation alone (jssl.data.device_augment) on a batch of uint8
crops of the same shapes on this process's first JAX device: what it adds to the train step.

Each run prints its figures and writes them with the command and the machine to
benchmarks/results/input_pipeline-<source>-<size>px[-<mode>].json (``--results``,
``--no_results``); benchmarks/report.py makes docs/benchmarks.md from those files.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
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


def images_per_second(config, steps: int, warmup: int) -> tuple[float, float]:
    """Examples per wall second and per CPU second (all of tf.data's threads, user + system,
    which other jobs on a shared machine move less) of this process's training pipeline over
    `steps` batches after `warmup`."""
    batches, epoch, start, cpu = 0, 0, None, None
    while batches < warmup + steps:
        for _ in data.build_train_dataset(config, seed=0, epoch=epoch).as_numpy_iterator():
            batches += 1
            if batches == warmup:
                start, cpu = time.perf_counter(), time.process_time()
            if batches == warmup + steps:
                break
        epoch += 1
    examples = steps * config.batch_size
    return examples / (time.perf_counter() - start), examples / (time.process_time() - cpu)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=["demo", "folder"], default="demo")
    parser.add_argument("--data_dir", default=None, help="TFDS data_dir or image folder root")
    parser.add_argument("--image_size", type=int, default=32, help="output crop side S")
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--num_crops", default="2", help="crops per group, e.g. 2 or 2,6")
    parser.add_argument("--crop_sizes", default="", help="side per group; default image_size")
    parser.add_argument("--crop_scales", default="", help="min,max per group, flattened")
    parser.add_argument("--steps", type=int, default=20, help="timed batches (after warm-up)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--num_images", type=int, default=1024, help="synthetic folder size")
    parser.add_argument("--image_shape", type=int, nargs=2, default=(375, 500), help="H W")
    parser.add_argument("--cache", action="store_true", help="data.cache=True (demo)")
    parser.add_argument(
        "--on_device", action="store_true", help="data.augment.on_device=True: crop + flip only"
    )
    parser.add_argument(
        "--compare_on_device",
        action="store_true",
        help="both host paths in one run, their ratio, and the on-device augmentation's time",
    )
    parser.add_argument("--device_steps", type=int, default=5, help="timed augmentation calls")
    results.add_flags(parser)
    args = parser.parse_args()

    config = data.default_config()
    config.update(
        dict(
            source=args.source,
            image_size=args.image_size,
            batch_size=args.batch_size,
            cache=args.cache,
        )
    )
    num_crops = tuple(int(k) for k in args.num_crops.split(","))
    config.augment.num_crops = num_crops
    if args.crop_sizes:
        config.augment.crop_sizes = tuple(int(k) for k in args.crop_sizes.split(","))
    if args.crop_scales:
        flat = [float(x) for x in args.crop_scales.split(",")]
        config.augment.crop_scale = tuple(zip(flat[::2], flat[1::2], strict=True))
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
    paths = [False, True] if args.compare_on_device else [args.on_device]
    rates, rows, headline = {}, [], []
    for on_device in paths:
        config.augment.on_device = on_device
        wall, per_cpu = images_per_second(config, args.steps, args.warmup)
        rates[on_device] = (wall, per_cpu)
        what = "crop + flip on the host (on_device=True)" if on_device else "full host augmentation"
        print(
            f"{label}: {what}: {wall:.0f} images/s ({wall * sum(num_crops):.0f} crops/s), "
            f"{per_cpu:.1f} images per CPU second"
        )
        rows.append(
            {
                "path": what,
                "images/s": results.rounded(wall),
                "crops/s": results.rounded(wall * sum(num_crops)),
                "images per CPU s": results.rounded(per_cpu),
            }
        )
    if args.compare_on_device:
        headline = [
            "host pipeline, crop + flip only (on_device=True) / full host augmentation: "
            f"{rates[True][0] / rates[False][0]:.2f}x images/s, "
            f"{rates[True][1] / rates[False][1]:.2f}x images per CPU second"
        ]
        print(headline[0])
        rows.append(device_augment_cost(config, args.batch_size, args.device_steps))
    if tmp is not None:
        tmp.cleanup()
    name = f"input_pipeline-{args.source}-{args.image_size}px"
    if args.num_crops != "2":
        name += "-crops" + args.num_crops.replace(",", "+")
    if args.compare_on_device or args.on_device:
        name += "-compare_on_device" if args.compare_on_device else "-on_device"
    results.record(
        name,
        rows,
        args=args,
        measures=results.summary(__doc__),
        headline=headline,
        notes=f"{label}; images per CPU second counts all of tf.data's threads.",
    )


if __name__ == "__main__":
    main()
