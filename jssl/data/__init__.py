"""jssl.data: deterministic, host-local input pipelines for SSL training and evaluation.

Sources: "demo" (a built-in generated TFDS dataset, offline), "tfds" (any TFDS dataset by name)
and "folder" (root/<split>/<class>/<images>). The trainer uses four functions:

- build_train_dataset: one epoch of this process's batches of augmented crops (one array per
  crop group, see crops.py; with data.augment.on_device uint8 crops + flips and the seeds from
  which the train step makes the views, see device_augment.py), with a per-row
  "replaced" flag (True where an unreadable example was replaced, data.skip_corrupt=True); the
  order is a seeded global permutation per epoch (epoch_order, process_order; see order.py);
- build_eval_dataset: the whole split, un-augmented, padded with a mask to static shapes;
- num_examples, steps_per_epoch: sizes, the same on every process.
"""

from __future__ import annotations

import ml_collections

from jssl.data.crops import CropGroup, crop_groups, synthetic_batch, total_crops
from jssl.data.order import epoch_order, process_order, shard_bounds, stream_block_ranges
from jssl.data.pipeline import (
    build_eval_dataset,
    build_train_dataset,
    num_examples,
    steps_per_epoch,
    train_order,
)

__all__ = [
    "CropGroup",
    "crop_groups",
    "total_crops",
    "build_eval_dataset",
    "build_train_dataset",
    "default_config",
    "epoch_order",
    "num_examples",
    "process_order",
    "shard_bounds",
    "steps_per_epoch",
    "stream_block_ranges",
    "synthetic_batch",
    "train_order",
]


def default_config() -> ml_collections.ConfigDict:
    """The data config with its defaults (configs/base.py defines the same fields)."""
    return ml_collections.ConfigDict(
        dict(
            source="demo",  # "demo" | "tfds" | "folder"
            name="",  # TFDS dataset name when source="tfds"
            data_dir=None,  # TFDS data_dir (demo/tfds); the root folder when source="folder"
            train_split="train",
            test_split="test",
            batch_size=256,  # global: split evenly over processes
            image_size=224,  # output crop side S
            train_subset=-1,  # >0: only the first N train examples (VISSL's DATA_LIMIT)
            shuffle_buffer=16384,
            skip_corrupt=False,  # True: replace unreadable images (flagged "replaced") and log them
            cache=False,  # keep decoded examples in memory across epochs (small datasets)
            augment=dict(
                num_crops=(2,),  # crops per group (jssl.data.crops)
                crop_sizes=(),  # one side per group; () = image_size
                crop_scale=(0.2, 1.0),  # one (min, max) pair, or one per group
                crop_ratio=(3 / 4, 4 / 3),
                flip_prob=(0.5,),  # probabilities: one for every group, or one per group
                color_jitter_prob=(0.8,),
                color_strength=0.5,  # VISSL ImgPilColorDistortion strength s
                grayscale_prob=(0.2,),
                blur_prob=(0.5,),
                blur_sigma=(0.1, 2.0),  # pixels, as PIL's GaussianBlur radius in VISSL
                solarize_prob=(0.0,),
                mean=(0.485, 0.456, 0.406),
                std=(0.229, 0.224, 0.225),
                on_device=False,  # True: host crops + flips, the step the rest (device_augment)
            ),
        )
    )
