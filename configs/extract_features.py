r"""Feature extraction from a trained jssl model (VISSL's extract_features engine,
``vissl/engines/extract_features.py``): features, targets and dataset indices of whole
splits, written to ``workdir/features/<split>/<layer>_{features,targets,inds}.npy``.

  python launch.py --config=configs/moco.py:demo --workdir=runs/demo          # train first
  python launch.py --config=configs/extract_features.py:demo --workdir=runs/demo_features \
      --config.init.checkpoint=runs/demo
  python launch.py --config=configs/extract_features.py --workdir=runs/moco_features \
      --config.init.checkpoint=runs/moco --config.extract.layers='("res4","res5","avgpool")'

The model fields come from the evaluated workdir's config.json (jssl.checkpoints.source_model),
so ``--config.init.checkpoint=<any method's workdir>`` is enough; a ``--config.model.*`` flag
wins, and a PyTorch file uses this preset's model fields (ResNet-50 by default).
``init.checkpoint`` is a jssl workdir, a ``checkpoints/<step>`` dir or a .torch/.pth file
(trunk only); left empty, the workdir's own checkpoints are used.

Presets: "" (ImageNet ResNet-50, VISSL's ResNet-50 pooling table), "demo" (the demos' ResNet
on the demo data, 32 px), "test" (tiny, for the test suite).
"""

import ml_collections

from configs import base, recipes

# The "test" preset's splits, which the svm, low_shot and cluster "test" presets read: a
# slice is stored as features/train@0-64, and only a request for a slice finds it.
TEST_SPLITS = ("train[:64]", "test[:40]")  # 40 = 2.5 batches: padding is exercised


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_base_config()
    recipes.evaluation(c, "extract_features", preset)
    c.extract = ml_collections.ConfigDict()
    e = c.extract
    # Dataset splits to extract. TFDS slices work: "train[:10%]" of 8000 examples is written
    # to features/train@0-800 (see extract.split_dir_name), so slices never share a directory.
    e.splits = (c.data.train_split, c.data.test_split)
    # Model taps: conv1, conv1_relu, res2..res5 (NHWC maps), avgpool (VISSL's res5avg), head.
    e.layers = ("avgpool",)
    # jssl/evaluation/pooling.py: "none" | "avg" | "avg:k,s,p" | "vissl_resnet50" (VISSL's
    # LINEAR_EVAL_FEAT_POOL_OPS_MAP) for every layer, or "layer=spec;layer=spec".
    e.pool = "vissl_resnet50"
    e.batch_size = 256  # global; the last batch of a split is padded and masked
    c.log_every_steps = 100

    if preset == "demo":
        # The layers and pooling of configs/linear_eval.py:demo, so its cached-features mode
        # (--config.linear.cached_features=<this workdir>/features) can train on them.
        e.layers = ("res3", "res4", "res5", "avgpool")
        e.pool = "res3=avg:4,4,0;res4=avg:4,2,0;res5=avg:2,2,0"
        e.batch_size = 500
        c.log_every_steps = 4
    elif preset == "test":
        e.splits = TEST_SPLITS
        e.layers = ("res5", "avgpool", "head")
        e.pool = "avg"
        e.batch_size = 16
        c.log_every_steps = 1
    return c
