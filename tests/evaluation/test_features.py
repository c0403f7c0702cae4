"""Tests for jssl.evaluation.features: exact-once, sorted, and the same on 1 and 4 devices.

Run as a script (``python tests/test_features.py OUT.npz``) this file collects the toy
features on every visible device and saves them; the 4-device test starts it in a fresh
process with XLA_FLAGS forcing 4 CPU devices, because JAX may already be initialised with
one device in the pytest process.
"""

import sys

import jax
import numpy as np
import pytest
from support.devices import run_on_devices

from jssl import parallel
from jssl.evaluation import features
from jssl.evaluation.batches import from_host_batches

NUM_EXAMPLES, BATCH, SIZE = 13, 8, 4  # 13 = 8 + 5: the last batch has 3 padded rows


@jax.jit
def _forward(image):
    return {"avgpool": image.mean((1, 2)), "res5": image[:, ::2, ::2], "head": image.sum((1, 2, 3))}


def _batches():
    """The split in a shuffled order, batched, the last batch padded with masked rows."""
    rng = np.random.default_rng(0)
    images = rng.normal(size=(NUM_EXAMPLES, SIZE, SIZE, 3)).astype(np.float32)
    labels = np.arange(NUM_EXAMPLES, dtype=np.int32) % 3
    order = rng.permutation(NUM_EXAMPLES)
    for start in range(0, NUM_EXAMPLES, BATCH):
        idx = order[start : start + BATCH]
        pad = BATCH - len(idx)
        # Padding repeats a real example: only the mask tells it apart.
        full = np.concatenate([idx, np.full(pad, idx[0])])
        yield {
            "image": images[full],
            "label": labels[full],
            "index": full.astype(np.int64),
            "mask": np.arange(BATCH) < len(idx),
        }


def _expected():
    images = np.concatenate([b["image"][b["mask"]] for b in _batches()])
    index = np.concatenate([b["index"][b["mask"]] for b in _batches()])
    images = images[np.argsort(index)]
    return {"avgpool": images.mean((1, 2)), "res5": images[:, ::2, ::2]}


def _collect(mesh):
    return features.collect_features(
        _forward,
        from_host_batches(_batches(), mesh),
        ["avgpool", "res5"],
        pool={"res5": lambda x: x.max((1, 2))},
        log_every=1,
    )


def _one_device_mesh():
    return jax.sharding.Mesh(np.asarray(jax.devices()[:1]), (parallel.DATA_AXIS,))


def test_exact_once_and_sorted():
    got = _collect(_one_device_mesh())
    np.testing.assert_array_equal(got.indices, np.arange(NUM_EXAMPLES))
    assert got.indices.dtype == np.int64
    np.testing.assert_array_equal(got.labels, np.arange(NUM_EXAMPLES) % 3)
    want = _expected()
    np.testing.assert_allclose(got.features["avgpool"], want["avgpool"], rtol=1e-6)
    np.testing.assert_allclose(got.features["res5"], want["res5"].max((1, 2)), rtol=1e-6)
    assert all(f.dtype == np.float32 for f in got.features.values())


def test_feature_maps_keep_their_shape():
    batches = from_host_batches(_batches(), _one_device_mesh())
    got = features.collect_features(_forward, batches, ["res5"])
    assert got.features["res5"].shape == (NUM_EXAMPLES, SIZE // 2, SIZE // 2, 3)
    np.testing.assert_allclose(got.features["res5"], _expected()["res5"], rtol=1e-6)


def test_unknown_layer_lists_taps():
    with pytest.raises(KeyError, match=r"res4.*avgpool.*head.*res5"):
        features.collect_features(
            _forward, from_host_batches(_batches(), _one_device_mesh()), ["res4"]
        )


def test_repeated_index_is_an_error():
    def twice():
        batch = next(_batches())
        yield batch
        yield batch

    with pytest.raises(ValueError, match="more than once"):
        features.collect_features(
            _forward, from_host_batches(twice(), _one_device_mesh()), ["avgpool"]
        )


def test_four_devices_match_one(tmp_path):
    four = run_on_devices(__file__, tmp_path / "four.npz", timeout=60)
    assert int(four["num_devices"]) == 4
    one = _collect(_one_device_mesh())
    np.testing.assert_array_equal(four["indices"], one.indices)
    np.testing.assert_array_equal(four["labels"], one.labels)
    for layer in ("avgpool", "res5"):
        np.testing.assert_allclose(four[layer], one.features[layer], rtol=1e-6)


if __name__ == "__main__":
    result = _collect(parallel.make_mesh())
    np.savez(
        sys.argv[1],
        num_devices=jax.device_count(),
        indices=result.indices,
        labels=result.labels,
        **result.features,
    )


def test_padding_rows_may_carry_placeholder_indices():
    """The data pipeline marks padding with index -1 (mask False): that is not an error."""

    def marked():
        for batch in _batches():
            yield dict(batch, index=np.where(batch["mask"], batch["index"], -1))

    batches = from_host_batches(marked(), _one_device_mesh())
    result = features.collect_features(_forward, batches, ["avgpool"])
    np.testing.assert_array_equal(result.indices, np.arange(NUM_EXAMPLES))
    np.testing.assert_allclose(result.features["avgpool"], _expected()["avgpool"], rtol=1e-6)


def test_iterate_features_streams_the_real_rows():
    def forward(image):
        return {"avgpool": _forward(image)["avgpool"]}

    stream = features.iterate_features(forward, from_host_batches(_batches(), _one_device_mesh()))
    feats, labels, indices = zip(*stream, strict=True)
    assert [len(i) for i in indices] == [BATCH, NUM_EXAMPLES - BATCH]  # padding dropped
    indices = np.concatenate(indices)
    assert indices.dtype == np.int64
    order = np.argsort(indices)
    np.testing.assert_array_equal(indices[order], np.arange(NUM_EXAMPLES))
    np.testing.assert_array_equal(np.concatenate(labels)[order], np.arange(NUM_EXAMPLES) % 3)
    avgpool = np.concatenate([f["avgpool"] for f in feats])[order]
    np.testing.assert_allclose(avgpool, _expected()["avgpool"], rtol=1e-6)
