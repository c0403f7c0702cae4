r"""k-means clustering of extracted features on the devices, scored against the labels (NMI,
ARI, Hungarian-matched accuracy). The algorithm and scores are jssl/evaluation/clustering.py's.

  python launch.py --config=configs/extract_features.py:demo --workdir=runs/demo_features \
      --config.init.checkpoint=runs/demo                       # features first
  python launch.py --config=configs/cluster.py:demo --workdir=runs/demo_cluster
  python launch.py --config=configs/cluster.py --workdir=runs/moco_cluster \
      --config.cluster.features_dir=runs/moco_features --config.cluster.num_clusters=1000

``cluster.train_split``'s features are clustered (labels unseen) and scored; with
``cluster.test_split`` its features are assigned to the fitted centroids and scored too.
``workdir/results.json`` holds the scores next to the protocol (features, splits, every k-means
setting, the restart kept and every restart's inertia).

Presets: "" / "imagenet" (ImageNet avgpool features: train clustered, validation assigned),
"demo" (the demo features in runs/demo_features), "test" (tiny, for the test suite: the splits
that configs/extract_features.py:test writes, train[:64] and test[:40]).
"""

import ml_collections

from configs import base, extract_features, recipes

PRESETS = ("", "imagenet", "demo", "test")


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    base.check_preset(preset, PRESETS, "configs/cluster.py")
    c = base.get_base_config()
    recipes.evaluation(c, "cluster", preset)
    c.cluster = ml_collections.ConfigDict()
    k = c.cluster
    # An extract_features workdir (or its features/ dir) holding <split>/<layer>_*.npy.
    k.features_dir = ""
    k.layers = ("avgpool",)
    k.train_split = c.data.train_split  # clustered (k-means fit), then scored
    k.test_split = c.data.test_split  # assigned to the fitted centroids and scored; "" skips
    k.num_clusters = 0  # 0: the number of classes
    k.init = "k-means++"  # "k-means++" | "random" (k distinct rows)
    k.restarts = 3  # initialisations; the lowest inertia is kept
    k.max_iters = 300  # sklearn's
    k.tol = 1e-4  # of the mean per-dimension variance (sklearn's rule)
    k.normalize = True  # L2-normalise the features first (the cosine geometry kNN uses)
    k.chunk_rows = 4096  # rows each device assigns at a time (memory: chunk x clusters)

    if preset == "demo":
        k.features_dir = "runs/demo_features"
        k.restarts = 5
    elif preset == "test":
        # What configs/extract_features.py:test writes, so that its workdir is read as it is.
        k.train_split, k.test_split = extract_features.TEST_SPLITS
        k.chunk_rows = 16
    return c
