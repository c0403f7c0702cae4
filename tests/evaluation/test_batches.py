"""Tests of jssl.evaluation.batches: every example once, padding rows masked, and the host
metadata aligned with the rows of the global batch, on 1 device and on 4.

Run as a script (``python tests/evaluation/test_batches.py OUT.npz``) this file reads the
demo split on every visible device, checks each batch, and saves what it read; the 4-device
test starts it in a fresh process with XLA_FLAGS forcing 4 CPU devices, because JAX may
already be initialised with one device in the pytest process.
"""

import sys

import jax
import numpy as np
import pytest
from support.devices import run_on_devices

from jssl import data, parallel
from jssl.evaluation.batches import MAX_INDEX, eval_batches, from_host_batches

SPLIT, NUM_EXAMPLES, BATCH = "test[:13]", 13, 8  # 13 = 8 + 5: the last batch has 3 padded rows


def _data_config():
    config = data.default_config()
    # The built-in demo set read without TensorFlow, at a small size.
    config.update(dict(source="demo", loader="numpy", image_size=8))
    return config


def _read(mesh) -> dict[str, np.ndarray]:
    """Every row ``eval_batches`` yields (padding included), after checking each batch."""
    rows: dict[str, list[np.ndarray]] = {"image": [], "label": [], "index": [], "mask": []}
    for batch, meta in eval_batches(_data_config(), SPLIT, BATCH, mesh):
        assert {k: v.dtype for k, v in meta.items()} == {
            "label": np.int32,
            "index": np.int32,
            "mask": np.bool_,
        }
        assert set(batch) == {"image", "label", "index", "mask"}
        for value in batch.values():
            assert value.shape[0] == BATCH
            assert value.sharding.spec[0] == parallel.DATA_AXIS
        # Each device's rows of the global batch carry the metadata of the same rows.
        for name in meta:
            assert batch[name].dtype == meta[name].dtype
            for shard in batch[name].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), meta[name][shard.index])
        assert np.all(meta["index"][~meta["mask"]] == 0)  # padding index made 0
        rows["image"].append(np.asarray(batch["image"]))
        for name in meta:
            rows[name].append(meta[name])
    return {name: np.concatenate(value) for name, value in rows.items()}


def _check(rows: dict[str, np.ndarray]) -> None:
    mask = rows["mask"]
    assert len(mask) == 2 * BATCH and mask.sum() == NUM_EXAMPLES  # one padded last batch
    assert not mask[-(2 * BATCH - NUM_EXAMPLES) :].any()
    index = rows["index"][mask]
    np.testing.assert_array_equal(np.sort(index), np.arange(NUM_EXAMPLES))  # each once
    # The images and labels are those of the examples the metadata names.
    reference = list(
        data.build_eval_dataset(_data_config(), SPLIT, batch_size=1).as_numpy_iterator()
    )
    want_image = {int(b["index"][0]): b["image"][0] for b in reference}
    want_label = {int(b["index"][0]): int(b["label"][0]) for b in reference}
    for image, label, i in zip(rows["image"][mask], rows["label"][mask], index, strict=True):
        np.testing.assert_array_equal(image, want_image[int(i)])
        assert label == want_label[int(i)]


def _one_device_mesh():
    return jax.sharding.Mesh(np.asarray(jax.devices()[:1]), (parallel.DATA_AXIS,))


def test_every_example_once_on_one_device():
    _check(_read(_one_device_mesh()))


def test_every_example_once_on_four_devices(tmp_path):
    rows = run_on_devices(__file__, tmp_path / "four.npz", timeout=60)
    assert int(rows.pop("num_devices")) == 4
    _check(rows)
    one = _read(_one_device_mesh())
    for name, value in one.items():
        np.testing.assert_array_equal(rows[name], value, err_msg=name)


def _host_batch(index, mask):
    n = len(index)
    return {
        "image": np.arange(n, dtype=np.float32)[:, None],
        "label": np.arange(n) % 3,
        "index": np.asarray(index, np.int64),
        "mask": np.asarray(mask),
    }


@pytest.mark.parametrize("bad", [-1, MAX_INDEX + 1])
def test_indices_outside_int32_are_refused(bad):
    batch = _host_batch([0, bad, 2, 3], [True] * 4)
    with pytest.raises(ValueError, match=r"dataset indices must lie in \[0, 2147483647\]"):
        next(from_host_batches([batch], _one_device_mesh()))
    # The same placeholder on a padding row is fine.
    padded = _host_batch([0, bad, 2, 3], [True, False, True, True])
    _, meta = next(from_host_batches([padded], _one_device_mesh()))
    np.testing.assert_array_equal(meta["index"], [0, 0, 2, 3])


def test_batches_without_index_keep_their_other_arrays():
    """Cached features (linear_eval's test batches): a pytree of inputs, no dataset index."""
    inputs = {"res5": np.ones((4, 3), np.float32), "avgpool": np.zeros((4, 2), np.float32)}
    host = {"inputs": inputs, "label": np.array([1, 2, 0, 0]), "mask": np.arange(4) < 2}
    batch, meta = next(from_host_batches([host], _one_device_mesh()))
    assert set(meta) == {"label", "mask"} and set(batch) == {"inputs", "label", "mask"}
    np.testing.assert_array_equal(np.asarray(batch["inputs"]["res5"]), inputs["res5"])
    assert batch["label"].dtype == np.int32 and batch["mask"].dtype == np.bool_
    np.testing.assert_array_equal(meta["mask"], [True, True, False, False])


if __name__ == "__main__":
    np.savez(sys.argv[1], num_devices=jax.device_count(), **_read(parallel.make_mesh()))
