"""Tests of the clustering evaluator (jssl.evaluation.clustering, the cluster engine): the
scores on hand-made clusterings, one Lloyd pass against numpy, k-means against scikit-learn,
determinism given the seed, the same clustering on 1 and 4 devices, and the engine's record.

Run as a script (``python tests/evaluation/test_clustering.py OUT.npz``) this file clusters the
test blobs on every visible device and saves the result; the 4-device test starts it with
4 forced CPU devices, as JAX may already have one device in pytest.
"""

import itertools
import json
import sys

import jax
import numpy as np
import pytest
from support.devices import run_on_devices

from configs import cluster as cluster_config
from jssl import engines, parallel
from jssl.engines import cluster
from jssl.evaluation import clustering


def _entropy(p):
    p = p[p > 0]
    return -np.sum(p * np.log(p))


def _nmi_ari_by_hand(labels, clusters):
    table = np.zeros((clusters.max() + 1, labels.max() + 1))
    np.add.at(table, (clusters, labels), 1)
    n = len(labels)
    joint = table / n
    mutual = _entropy(joint.sum(1)) + _entropy(joint.sum(0)) - _entropy(joint.ravel())
    nmi = mutual / ((_entropy(joint.sum(1)) + _entropy(joint.sum(0))) / 2)

    def pairs(x):
        return np.sum(x * (x - 1) / 2)

    index, rows, cols = pairs(table), pairs(table.sum(1)), pairs(table.sum(0))
    expected = rows * cols / pairs(np.array(n))
    ari = (index - expected) / ((rows + cols) / 2 - expected)
    return 100 * nmi, 100 * ari


def test_scores_of_hand_made_clusterings():
    labels = np.array([0, 0, 1, 1])
    assert clustering.cluster_scores(labels, np.array([1, 1, 0, 0])) == {
        "nmi": 100.0,
        "ari": 100.0,
        "accuracy": 100.0,
        "num_examples": 4,
    }
    scores = clustering.cluster_scores(labels, np.array([0, 0, 0, 1]))
    assert scores["accuracy"] == 75.0
    nmi, ari = _nmi_ari_by_hand(labels, np.array([0, 0, 0, 1]))
    assert scores["nmi"] == pytest.approx(nmi) and scores["ari"] == pytest.approx(ari)
    # More clusters than classes: cluster 1 stays unmatched, its example counts as an error.
    assert clustering.hungarian_accuracy(np.array([0, 0, 1, 1, 1]), np.array([0, 1, 2, 2, 2])) == 80


def test_matched_accuracy_and_scores_against_brute_force_on_random_clusterings():
    rng = np.random.default_rng(0)
    for _ in range(5):
        labels, clusters = rng.integers(0, 4, 40), rng.integers(0, 4, 40)
        best = max(
            np.sum(np.asarray(perm)[clusters] == labels)
            for perm in itertools.permutations(range(4))
        )
        scores = clustering.cluster_scores(labels, clusters)
        assert scores["accuracy"] == pytest.approx(100 * best / 40)
        nmi, ari = _nmi_ari_by_hand(labels, clusters)
        assert scores["nmi"] == pytest.approx(nmi) and scores["ari"] == pytest.approx(ari)


def _mesh():
    return jax.sharding.Mesh(np.asarray(jax.devices()[:1]), (parallel.DATA_AXIS,))


def _blobs(n=203, k=5, d=8, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(k, d)) * 4
    labels = rng.integers(0, k, n)
    return (centres[labels] + rng.normal(size=(n, d))).astype(np.float32), labels


@pytest.mark.parametrize("scatter", [True, False])  # the CPU's sums and the accelerators'
def test_one_assignment_pass_matches_numpy(scatter):
    x, _ = _blobs(37)
    data = clustering.shard_rows(x, _mesh(), normalize=False, chunk_rows=8)  # padded chunks
    centroids = x[[0, 5, 9]]
    sums, counts, inertia, labels = clustering._assign_fn(_mesh(), data.chunk, scatter)(
        data.x, data.valid, centroids
    )
    d2 = ((x[:, None, :].astype(np.float64) - centroids[None]) ** 2).sum(-1)
    want = d2.argmin(1)
    np.testing.assert_array_equal(np.asarray(labels)[:37], want)
    np.testing.assert_allclose(counts, np.bincount(want, minlength=3))
    np.testing.assert_allclose(sums, [x[want == c].sum(0) for c in range(3)], rtol=1e-5)
    assert float(inertia) == pytest.approx(d2.min(1).sum(), rel=1e-5)


def test_kmeans_finds_sklearns_partition_and_is_deterministic():
    from sklearn.cluster import KMeans
    from sklearn.metrics import adjusted_rand_score

    x, labels = _blobs()
    data = clustering.shard_rows(x, _mesh(), normalize=False, chunk_rows=16)
    got = clustering.kmeans(data, 5, seed=0, restarts=3)
    want = KMeans(5, n_init=3, random_state=0).fit(x)
    assert adjusted_rand_score(want.labels_, got.assignments) == 1.0
    assert got.inertia == pytest.approx(want.inertia_, rel=1e-4)
    assert got.converged and got.inertia == min(got.inertias)
    again = clustering.kmeans(data, 5, seed=0, restarts=3)
    np.testing.assert_array_equal(again.centroids, got.centroids)
    assert again.inertias == got.inertias
    other = clustering.kmeans(data, 5, seed=1, restarts=3, init="random")
    assert other.inertias != got.inertias
    # Held-out rows go to their nearest fitted centroid.
    assigned, _ = clustering.assign(data, got.centroids)
    np.testing.assert_array_equal(assigned, got.assignments)


def _cluster_on_visible_devices() -> dict[str, np.ndarray]:
    x, _ = _blobs()
    data = clustering.shard_rows(x, parallel.make_mesh(), normalize=True, chunk_rows=16)
    out = {}
    for init in clustering.INITS:
        fit = clustering.kmeans(data, 5, seed=3, restarts=2, init=init)
        out[f"{init}_centroids"], out[f"{init}_labels"] = fit.centroids, fit.assignments
    return out


def test_the_same_clustering_on_one_and_four_devices(tmp_path):
    four = run_on_devices(__file__, tmp_path / "four.npz")
    assert int(four["num_devices"]) == 4
    one = _cluster_on_visible_devices()
    for name, value in one.items():
        np.testing.assert_allclose(four[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


if __name__ == "__main__":
    np.savez(sys.argv[1], num_devices=jax.device_count(), **_cluster_on_visible_devices())


def _config(root, **overrides):
    config = cluster_config.get_config("test")
    config.cluster.features_dir = root
    config.cluster.train_split, config.cluster.test_split = "train", "test"  # features_dir()'s
    config.update_from_flattened_dict(overrides)
    return config


def test_the_engine_writes_the_scores_with_their_protocol(tmp_path):
    from test_svm import features_dir  # tests/evaluation is not on the script's path

    root = features_dir(tmp_path, classes=3)
    workdir = tmp_path / "cluster"
    results = engines.run(_config(root), str(workdir))
    with open(workdir / "results.json") as f:
        assert json.load(f) == json.loads(json.dumps(results))
    layer = results["layers"]["avgpool"]
    protocol = layer["protocol"]
    assert protocol["num_clusters"] == 3 and protocol["num_clusters_from"] == "the classes"
    assert protocol["settings"]["init"] == "k-means++" and protocol["settings"]["restarts"] == 3
    assert protocol["features"]["checkpoint_step"] == 300
    assert len(protocol["inertias"]) == 3
    assert protocol["inertias"][protocol["restart_kept"]] == min(protocol["inertias"])
    assert layer["train"]["num_examples"] == 60 and layer["test"]["num_examples"] == 30
    for split in ("train", "test"):
        assert set(layer[split]) == {"nmi", "ari", "accuracy", "num_examples", "inertia"}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"cluster.init": "kmeans||"}, r"cluster.init='kmeans\|\|' is not one of"),
        ({"cluster.restarts": 0}, r"cluster.restarts=0 must be an integer >= 1"),
        ({"cluster.num_clusters": 61}, r"cluster.num_clusters=61 is more than the 60"),
        ({"cluster.tol": -1.0}, r"cluster.tol=-1.0 must be a finite number >= 0"),
        ({"cluster.features_dir": ""}, r"cluster.features_dir is empty"),
    ],
)
def test_bad_settings_are_refused_before_the_workdir_is_touched(tmp_path, overrides, message):
    from test_svm import features_dir  # tests/evaluation is not on the script's path

    config = _config(features_dir(tmp_path), **overrides)
    workdir = tmp_path / "cluster"
    with pytest.raises(ValueError, match=message):
        engines.run(config, str(workdir))
    assert not workdir.exists()


def test_multi_label_targets_are_refused(tmp_path):
    from test_svm import features_dir

    with pytest.raises(ValueError, match="multi-label"):
        cluster.validate(_config(features_dir(tmp_path, multi_label=True)))
