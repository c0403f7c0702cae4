r"""A trained method's own loss on a held-out split (VISSL's test phase as an evaluator), on
any checkpoint of a jssl workdir. The engine is jssl/engines/test_loss.py.

  python launch.py --config=configs/moco.py:demo --workdir=runs/demo          # train first
  python launch.py --config=configs/test_loss.py:demo --workdir=runs/demo_test_loss \
      --config.init.checkpoint=runs/demo

The method, its heads and teacher, and its data recipe are the trained run's (its config.json
and checkpoint; a ``--config.method.name`` other than its own is refused); ``test_loss.split``
of its dataset is read once, the centre crop fed as every view. ``workdir/results.json`` holds
the loss, its terms and metrics (a supervised run's top-1) next to the protocol (method, split,
checkpoint and step).

Presets: "" / "imagenet", "demo", "test" (the split and batch size; the data is the run's).
"""

import ml_collections

from configs import base, recipes

PRESETS = ("", "imagenet", "demo", "test")


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    base.check_preset(preset, PRESETS, "configs/test_loss.py")
    c = base.get_base_config()
    recipes.evaluation(c, "test_loss", preset)
    c.test_loss = ml_collections.ConfigDict()
    t = c.test_loss
    t.split = c.data.test_split  # of the trained run's dataset
    t.batch_size = c.data.batch_size  # global, a multiple of the device count
    t.outputs = False  # per-example losses and embeddings in workdir/eval/epoch_<n>/
    return c
