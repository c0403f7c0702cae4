r"""Weighted k-nearest-neighbour evaluation of frozen features (VISSL's nearest-neighbour
benchmark, ``configs/config/benchmark/nearest_neighbor/eval_resnet_8gpu_in1k_kNN.yaml``:
TOPK 200, SIGMA 0.1; DINO's ``eval_knn.py``: k in 10/20/100/200, T 0.07).

  python launch.py --config=configs/knn.py:demo --workdir=runs/demo_knn \
      --config.init.checkpoint=runs/demo                 # features computed from the model
  python launch.py --config=configs/knn.py:demo --workdir=runs/demo_knn \
      --config.knn.features_dir=runs/demo_features/features   # from extract_features output
  python launch.py --config=configs/knn.py --workdir=runs/moco_knn \
      --config.init.checkpoint=runs/moco --config.knn.layer=res5 --config.knn.pool=avg

The model fields come from the evaluated workdir's config.json (jssl.checkpoints.source_model),
so ``--config.init.checkpoint=<any method's workdir>`` is enough; a ``--config.model.*`` flag
wins, and a PyTorch file uses this preset's model fields (ResNet-50 by default).
Writes ``workdir/results.json``: ``{"layer", "temperature", "num_train", "num_test",
"k<k>": {"top1", "top5"}, ...}`` and TensorBoard scalars ``knn/<layer>/k<k>/top1``.

Presets: "" (ImageNet ResNet-50, VISSL k=200 T=0.1), "dino" (the same model, DINO's k and T),
"demo" (the demos' ResNet on the demo data), "test" (tiny, for the test suite).
"""

import ml_collections

from configs import base, recipes

PRESETS = ("", "imagenet", "dino", "demo", "test")


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    base.check_preset(preset, PRESETS, "configs/knn.py")
    c = base.get_base_config()
    recipes.evaluation(c, "knn", {"dino": ""}.get(preset, preset))
    k = c.knn
    # The train-time monitor's fields (configs/base.py) keep their meaning: layer,
    # temperature, train_split (the bank), test_split (the queries), batch_size (global,
    # feature computation). k is the monitor's; this engine evaluates every k in ks.
    k.layer = "avgpool"  # VISSL's kNN config reads the head output instead: layer="head"
    k.k = 200
    k.ks = (200,)
    k.temperature = 0.1
    k.train_split = c.data.train_split
    k.test_split = c.data.test_split
    k.batch_size = 256
    # An extract_features workdir or its features/ dir: read <layer> features from
    # there (memory-mapped) instead of running the model of init.checkpoint.
    k.features_dir = ""
    # jssl/evaluation/pooling.py spec applied to the layer on device before the kNN, when computing
    # features here ("none" | "avg" | "avg:k,s,p"); cached features are used as stored.
    k.pool = "none"
    c.log_every_steps = 100

    if preset == "dino":
        k.k = 20
        k.ks = (10, 20, 100, 200)  # eval_knn.py --nb_knn default; the paper reports 20-NN
        k.temperature = 0.07
    elif preset == "demo":
        k.k = 20
        k.ks = (20, 200)
        k.temperature = 0.07
        k.batch_size = 500
    elif preset == "test":
        k.k = 20
        k.ks = (5, 20)
        k.temperature = 0.07
        k.train_split = "train[:256]"
        k.test_split = "test[:100]"
        k.batch_size = 64
    return c
