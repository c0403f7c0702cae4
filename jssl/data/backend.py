"""Which input pipeline serves a data config, which half of the views the train step makes,
and synthetic batches of that layout.

Three pipelines read jssl's sources: tf.data (jssl.data.pipeline) any source; grain
(jssl.data.grain_pipeline) image folders, TFDS ArrayRecord datasets and the demo data, without
TensorFlow; a numpy pipeline (jssl.data.numpy_pipeline) the demo data. ``data.loader="auto"``
picks grain for image folders (more images per CPU second than tf.data:
benchmarks/input_pipeline.py --compare_loaders), tf.data for TFDS and the demo data where
TensorFlow is installed, and without it grain for TFDS and the numpy pipeline for the demo;
"tf", "grain" and "numpy" (demo only) choose one. grain and the numpy pipeline crop and flip on
the host and leave the rest of each view to the train step (jssl.data.device_augment) whatever
data.augment.on_device says, unless the views need nothing more (the linear heads' images);
``views_on_device`` tells the step and the pipelines which half makes what.
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
from absl import logging

from jssl.data import crops

LOADERS = ("auto", "tf", "grain", "numpy")
HOST_CROP_LOADERS = ("grain", "numpy")  # crop + flip on the host, the rest in the step
_TF_PACKAGES = ("tensorflow", "tensorflow_datasets")


@functools.cache
def tensorflow_available() -> bool:
    """Whether tensorflow and tensorflow_datasets are installed, found without importing them
    (deciding costs nothing; a broken install then fails loudly where tf.data is built)."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in _TF_PACKAGES)
    except (ImportError, ValueError):  # a finder refusing them; a None entry in sys.modules
        return False


def _wanted(data_config) -> str:
    wanted = data_config.get("loader", "auto")
    if wanted not in LOADERS:
        raise ValueError(f"data.loader={wanted!r}: use one of {LOADERS}.")
    if wanted == "numpy" and data_config.source != "demo":
        raise ValueError(
            f'data.loader="numpy" reads only the built-in demo data, not data.source='
            f'{data_config.source!r}: set data.loader="auto" (tf.data) for that source.'
        )
    return wanted


@functools.cache
def _announce(loader: str) -> None:
    logging.info(
        "jssl.data: TensorFlow is not installed, so the data is read by the %s pipeline "
        "(crop and flip on the host, colour, blur and solarisation in the train step).",
        loader,
    )


def resolve(data_config) -> str:
    """The pipeline that reads ``data_config``: "tf", "grain" or "numpy"."""
    wanted = _wanted(data_config)
    if wanted != "auto":
        return wanted
    if data_config.source == "folder":
        return "grain"
    if tensorflow_available():
        return "tf"
    loader = "numpy" if data_config.source == "demo" else "grain"
    _announce(loader)
    return loader


def require_tfds(data_config) -> None:
    """Raises an ImportError saying what to do when a TFDS source is read without
    tensorflow_datasets installed (grain reads its ArrayRecord files without TensorFlow)."""
    if importlib.util.find_spec("tensorflow_datasets") is None:
        raise ImportError(
            f"data.source={data_config.source!r} reads a TFDS dataset, and tensorflow_datasets is "
            "not installed: pip install tensorflow-datasets."
        )


def require_tensorflow(data_config) -> None:
    """Raises an ImportError saying what to do when ``data_config`` needs tf.data but
    TensorFlow or TFDS cannot be imported."""
    if tensorflow_available():
        return
    if data_config.source == "demo":
        fix = 'or set data.loader="auto" (or "grain") to read the demo data without them.'
    else:
        fix = (
            'or set data.loader="auto" (or "grain") to read image folders and TFDS ArrayRecord '
            "datasets without TensorFlow."
        )
    raise ImportError(
        f"data.source={data_config.source!r} with data.loader="
        f"{data_config.get('loader', 'auto')!r} is read with tf.data, and tensorflow or "
        f"tensorflow_datasets is not installed: pip install tensorflow-cpu tensorflow-datasets "
        "(the jssl[tf] extra), " + fix
    )


def views_on_device(data_config) -> bool:
    """Whether the train step makes the photometric half of the views (colour, grey, blur,
    solarise, RandAugment, random erasing) from the host's uint8 crops and seeds: with
    data.augment.on_device, and with grain or the numpy pipeline whenever a crop group needs
    more than crop and flip. Never raises for a source that needs TensorFlow: the step of a
    benchmark on synthetic batches builds without."""
    if data_config.augment.get("on_device", False):
        return True
    if resolve(data_config) not in HOST_CROP_LOADERS:
        return False
    return any(crops.photometric(group) for group in crops.crop_groups(data_config))


def synthetic_batch(data_config, batch_size: int, seed: int = 0) -> dict:
    """A host batch of noise shaped as the training pipeline's (every crop group), for
    benchmarks and tests of the step that need no data: Gaussian float32 views, or where the
    step makes the views (views_on_device) uniform uint8 crops and their
    ``aug_seeds``."""
    rs = np.random.RandomState(seed)
    groups = crops.crop_groups(data_config)
    shapes = [(batch_size, g.num_crops, g.size, g.size, 3) for g in groups]
    batch = {
        "crops": tuple(rs.normal(size=shape).astype(np.float32) for shape in shapes),
        "label": np.zeros(batch_size, np.int32),
        "index": np.arange(batch_size),
    }
    if views_on_device(data_config):
        batch["crops"] = tuple(rs.randint(0, 256, shape, dtype=np.uint8) for shape in shapes)
        batch["aug_seeds"] = tuple(
            rs.randint(0, 2**32, (batch_size, g.num_crops, 3, 2), dtype=np.uint32) for g in groups
        )
    return batch
