"""Throughput of the SSL training input pipeline, two views or multi-crop (a script, not a test).

    python benchmarks/input_pipeline.py --source=demo --image_size=32 --batch_size=256
    python benchmarks/input_pipeline.py --source=folder --image_size=224 --batch_size=128
    python benchmarks/input_pipeline.py --source=folder --num_crops=2,6 --crop_sizes=224,96 \
        --crop_scales=0.14,1,0.05,0.14        # SwAV's multi-crop

--source=demo reads the built-in demo set (generated into --data_dir on first use); --source=folder
writes a synthetic ImageNet-like folder of random JPEGs (--image_shape, default 375x500) to a
temporary directory, or reads --data_dir if given. Prints examples/s and crops/s of this host.
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

    steps_per_epoch = data.steps_per_epoch(config)
    batches = 0
    epoch = 0
    start = None
    while batches < args.warmup + args.steps:
        for _ in data.build_train_dataset(config, seed=0, epoch=epoch).as_numpy_iterator():
            batches += 1
            if batches == args.warmup:
                start = time.perf_counter()
            if batches == args.warmup + args.steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - start
    examples = args.steps * args.batch_size
    print(
        f"source={args.source} S={args.image_size} batch={args.batch_size} "
        f"crops={args.num_crops} sizes={args.crop_sizes or args.image_size} "
        f"steps/epoch={steps_per_epoch} cpus={os.cpu_count()}: "
        f"{examples / elapsed:.0f} images/s ({examples * sum(num_crops) / elapsed:.0f} crops/s)"
    )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
