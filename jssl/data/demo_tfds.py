"""The TFDS builder "jssl_demo": the demo images of jssl.data.demo stored as a TFDS dataset.

Importing this module registers the builder (it imports tensorflow_datasets); the tf.data
pipeline prepares it on first use (jssl.data.tfds_source). The images are demo.make_example's, so
the numpy pipeline, which needs no TensorFlow, reads the same dataset.
"""

from __future__ import annotations

import tensorflow_datasets as tfds

from jssl.data import demo


class JsslDemo(tfds.core.GeneratorBasedBuilder):
    """TFDS builder "jssl_demo": procedurally generated shapes, no download."""

    VERSION = tfds.core.Version(demo.VERSION)
    RELEASE_NOTES = {
        "1.0.0": "Initial release: 10 shape classes, 8000 train / 2000 test.",
        "1.1.0": "Plain gradient backgrounds and larger, central shapes (no texture shortcut).",
        "1.2.0": "Palette colours shared across images, uniform backgrounds (no identity cues).",
        "1.3.0": "No per-image pixel noise (a fingerprint shared by overlapping crops).",
        "1.4.0": "Per-image shape geometry: stretch, small rotation, stroke thickness.",
        "1.5.0": "Dark backgrounds, light foregrounds: shapes stay visible in grayscale.",
    }
    # No download, so no checksums file to locate. Locating it (the inherited `code_path`) imports
    # the `importlib_resources` backport, which TFDS 4.9.10 does not declare as a dependency.
    code_path = None

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description="10 classes of shapes in palette colours on uniform backgrounds.",
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(demo.IMAGE_SIZE, demo.IMAGE_SIZE, 3)),
                    "label": tfds.features.ClassLabel(names=demo.CLASS_NAMES),
                }
            ),
            supervised_keys=("image", "label"),
            # Keep generation order on disk so that dataset index i is example i of the split.
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # everything is generated locally
        return {split: self._generate_examples(split, n) for split, n in demo.SPLIT_SIZES.items()}

    def _generate_examples(self, split: str, num: int):
        for index in range(num):
            image, label = demo.make_example(split, index)
            yield index, {"image": image, "label": label}
