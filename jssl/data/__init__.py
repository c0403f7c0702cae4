"""jssl.data: deterministic, host-local input pipelines for SSL training and evaluation.

Sources: "demo" (a built-in generated dataset, offline), "tfds" (any TFDS dataset by name) and
"folder" (root/<split>/<class>/<images>). ``build_train_dataset`` gives one epoch of this
process's batches of augmented crops (one array per crop group, crops.py; where the step makes
the photometric half, uint8 crops and their seeds, device_augment.py), each row flagged
"replaced" where an unreadable example was replaced, in a seeded global order (order.py);
``build_eval_dataset`` the whole split, un-augmented, padded with a mask to static shapes;
``num_examples`` and ``steps_per_epoch`` the sizes, the same on every process. backend.py picks
the pipeline per config (grain_pipeline.py, pipeline.py for tf.data, numpy_pipeline.py for the
demo) and loader.py builds it. Importing jssl.data, the crop groups, the order and the
on-device augmentation never imports TensorFlow; only building a tf.data pipeline does. More:
docs/operations.md, "Data"; docs/design.md, "Data".
"""

from __future__ import annotations

import ml_collections

from jssl.data.backend import synthetic_batch
from jssl.data.crops import CropGroup, crop_groups, total_crops
from jssl.data.loader import build_eval_dataset, build_train_dataset
from jssl.data.order import epoch_order, process_order, shard_bounds, stream_block_ranges
from jssl.data.splits import num_examples, steps_per_epoch, train_order

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
    """The data fields of every jssl config (configs/base.py starts from these)."""
    d = ml_collections.ConfigDict()
    d.source = "demo"  # "demo" | "tfds" | "folder"
    d.name = ""  # TFDS name when source="tfds", e.g. "imagenet2012"
    d.data_dir = ml_collections.config_dict.placeholder(str)  # TFDS dir / folder root
    # "auto": grain for image folders; tf.data for TFDS and the demo where TensorFlow is
    # installed, else grain (the demo: numpy); "tf" / "grain" / "numpy" (demo only) to choose.
    d.loader = "auto"
    d.workers = -1  # grain's input worker processes; -1: one per core less one, 0: threads
    d.train_split = "train"
    d.test_split = "test"
    d.batch_size = 256  # global, over all devices and processes
    d.image_size = 224  # output crop side
    d.train_subset = -1  # >0: only the first N train examples (VISSL DATA_LIMIT)
    d.shuffle_buffer = 16384
    d.skip_corrupt = False  # True: replace unreadable images (counted per epoch), not fail
    d.cache = False  # keep decoded examples in memory (small datasets)
    d.augment = ml_collections.ConfigDict()
    a = d.augment
    # Crop groups (jssl/data/crops.py): crops per group, e.g. (2,) two views, (2, 6) SwAV's
    # multi-crop. crop_sizes: one side per group, () = data.image_size. crop_scale and the
    # probabilities: one value for every group, or one per group.
    a.num_crops = (2,)
    a.crop_sizes = ()
    a.crop_scale = (0.2, 1.0)  # (min, max) area fraction, or one pair per group
    a.crop_ratio = (3 / 4, 4 / 3)
    a.flip_prob = (0.5,)
    a.color_jitter_prob = (0.8,)
    a.color_strength = 0.5  # jitter (0.8s, 0.8s, 0.8s, 0.2s), VISSL ImgPilColorDistortion
    a.grayscale_prob = (0.2,)
    a.blur_prob = (0.5,)
    a.blur_sigma = (0.1, 2.0)  # pixels, as PIL's GaussianBlur radius in VISSL
    a.solarize_prob = (0.0,)
    a.mean = (0.485, 0.456, 0.406)
    a.std = (0.229, 0.224, 0.225)
    a.on_device = False  # True: host crops + flips (uint8), the step does the rest (device_augment)
    a.randaugment_ops = 0  # RandAugment ops per image after the flip (randaugment.py); 0 = off
    a.randaugment_magnitude = 9.0  # timm's 0..10 scale ("rand-m9"), used when randaugment_ops > 0
    a.randaugment_magnitude_std = 0.5  # per-op Gaussian noise on the magnitude ("mstd0.5")
    a.random_erasing_prob = 0.0  # timm RandomErasing after normalisation, pixel noise; 0 = off
    return d
