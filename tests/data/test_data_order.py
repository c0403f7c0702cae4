"""Training order across processes: a global permutation per epoch, batches independent of the
process count, exact resume, equal batch counts with unreadable examples, and split errors."""

import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from PIL import Image
from support.hidden_imports import prepare_array_record_demo
from support.launch import prepare_shared_dirs

import jssl.data as data
from jssl.data import sources


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    # The session's demo dataset (generated once, shared with the other test files).
    return prepare_shared_dirs(tmp_path_factory)[0]


@pytest.fixture(scope="module")
def array_record_dir(tmp_path_factory):
    """The demo dataset prepared in ArrayRecord files (random access), first 48 train examples."""
    return prepare_array_record_demo(str(tmp_path_factory.mktemp("array_record")), 48, 16)


def _config(data_dir, **overrides):
    config = data.default_config()
    config.update(
        dict(data_dir=data_dir, image_size=8, batch_size=8, train_subset=-1, shuffle_buffer=16)
    )
    # Crop and flip only: the order is under test, and tracing colour and blur ops costs seconds.
    config.augment.update(dict(color_jitter_prob=(0.0,), grayscale_prob=(0.0,), blur_prob=(0.0,)))
    config.update(overrides)
    return config


def _epoch(config, process_count=1, **kwargs):
    """Per process, the list of its batches (numpy dicts)."""
    return [
        list(
            data.build_train_dataset(
                config, process_index=p, process_count=process_count, **kwargs
            ).as_numpy_iterator()
        )
        for p in range(process_count)
    ]


def _global(per_process):
    """The global batches: each step's process-local rows concatenated in process order."""
    assert len({len(b) for b in per_process}) == 1, [len(b) for b in per_process]
    return [
        {
            "index": np.concatenate([b[t]["index"] for b in per_process]),
            "replaced": np.concatenate([b[t]["replaced"] for b in per_process]),
            "crops": np.concatenate([b[t]["crops"][0] for b in per_process]),
        }
        for t in range(len(per_process[0]))
    ]


def _write_folder(root, classes=4, per_class=6):
    """A class-sorted folder: class c's files get dataset indices [c * per_class, ...)."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        os.makedirs(root / "train" / f"class{c}")
        for i in range(per_class):
            pixels = rng.integers(0, 255, (6 + i, 7, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "train" / f"class{c}" / f"{i}.png")
    return sources.list_image_folder(str(root), "train")[0]


def test_epoch_order_is_a_fresh_permutation():
    orders = [data.epoch_order(50, 8, seed=3, epoch=e) for e in range(2)]
    for order in orders:
        assert order.shape == (6, 8)
        assert len(set(order.ravel())) == 48 and order.max() < 50
    assert not np.array_equal(orders[0], orders[1])
    np.testing.assert_array_equal(orders[0], data.epoch_order(50, 8, seed=3, epoch=0))
    # Process p's stream is its quarter of every global batch, in step order.
    streams = [data.process_order(orders[0], p, 4) for p in range(4)]
    np.testing.assert_array_equal(
        np.stack([s.reshape(6, 2) for s in streams], axis=1).reshape(6, 8), orders[0]
    )
    with pytest.raises(ValueError, match="not divisible"):
        data.process_order(orders[0], 0, 3)


@pytest.mark.e2e
@pytest.mark.parametrize("source", ["demo_cached", "folder", "array_record"])
def test_global_batch_does_not_depend_on_process_count(source, demo_dir, tmp_path, request):
    if source == "folder":
        _write_folder(tmp_path)
        config = _config(str(tmp_path), source="folder")
        num = 24
    elif source == "array_record":  # uncached TFDS, read by index
        config = _config(request.getfixturevalue("array_record_dir"), train_subset=24)
        assert "exact" in data.train_order(config)
        num = 24
    else:
        config = _config(demo_dir, cache=True, train_subset=24)
        num = 24
    runs = {p: _global(_epoch(config, p, seed=1, epoch=2)) for p in (1, 2, 4)}
    expected = data.epoch_order(num, 8, seed=1, epoch=2)
    assert len(runs[1]) == 3
    for batches in runs.values():
        for t, batch in enumerate(batches):
            np.testing.assert_array_equal(batch["index"], expected[t])
            assert not batch["replaced"].any()
            np.testing.assert_array_equal(batch["crops"], runs[1][t]["crops"])


def test_every_host_sees_every_class(tmp_path):
    _write_folder(tmp_path)
    config = _config(str(tmp_path), source="folder")
    indices = {}
    for epoch in (0, 1):
        for p, batches in enumerate(_epoch(config, 2, seed=0, epoch=epoch)):
            indices[epoch, p] = np.concatenate([b["index"] for b in batches])
            # Contiguous shards of this class-sorted folder gave each host only two classes.
            assert set(indices[epoch, p] // 6) == {0, 1, 2, 3}
    assert set(indices[0, 0]) != set(indices[1, 0])


def test_uncached_tfds_blocks(demo_dir):
    config = _config(demo_dir, train_subset=96, batch_size=16)
    assert "seeded blocks" in data.train_order(config)  # TFRecord files: the documented limit
    per_process = _epoch(config, 2, seed=0, epoch=0)
    assert [len(b) for b in per_process] == [6, 6]
    seen = [np.concatenate([b["index"] for b in batches]) for batches in per_process]
    both = np.concatenate(seen)
    assert len(set(both)) == len(both) == 96  # each example once (96 = 6 steps x 16)
    blocks = [
        data.stream_block_ranges(1000, 480, seed=0, epoch=e, process_index=p, process_count=2)
        for e in (0, 1)
        for p in (0, 1)
    ]
    for ranges in blocks:
        assert sum(end - start for start, end in ranges) == 480 and len(ranges) >= 16
    covered = [i for ranges in blocks[:2] for start, end in ranges for i in range(start, end)]
    assert len(set(covered)) == 960
    assert blocks[0] != blocks[2]  # a different draw of blocks each epoch


def test_resume_replays_the_tail_on_each_process(demo_dir):
    config = _config(demo_dir, cache=True, train_subset=48, batch_size=8)
    full = _epoch(config, 2, seed=5, epoch=1)
    tail = _epoch(config, 2, seed=5, epoch=1, start_step=4)
    for f, t in zip(full, tail, strict=True):
        assert len(t) == 2
        for a, b in zip(f[4:], t, strict=True):
            np.testing.assert_array_equal(a["index"], b["index"])
            np.testing.assert_array_equal(a["crops"][0][:, 0], b["crops"][0][:, 0])


def _expected_rows(stream, bad):
    """The rule: an unreadable position takes the next readable index of the stream, wrapping."""
    good = [j for j in range(len(stream)) if stream[j] not in bad]
    rows = []
    for j in range(len(stream)):
        following = [g for g in good if g >= j] or good
        rows.append(stream[following[0]])
    return np.array(rows), np.array([s in bad for s in stream])


def _check_replaced(config, stream_of, bad, process_count=2):
    full = _epoch(config, process_count, seed=0, epoch=0)
    assert len({len(b) for b in full}) == 1  # equal batch counts on every process
    for p, batches in enumerate(full):
        index, replaced = _expected_rows(stream_of(p), bad)
        np.testing.assert_array_equal(np.concatenate([b["index"] for b in batches]), index)
        np.testing.assert_array_equal(np.concatenate([b["replaced"] for b in batches]), replaced)
    resumed = _epoch(config, process_count, seed=0, epoch=0, start_step=1)
    for f, r in zip(full, resumed, strict=True):
        for a, b in zip(f[1:], r, strict=True):
            for key in ("index", "replaced"):
                np.testing.assert_array_equal(a[key], b[key])
            np.testing.assert_array_equal(a["crops"][0][:, 1], b["crops"][0][:, 1])
    return full


def test_folder_skip_corrupt_replaces_in_place(tmp_path, capfd):
    paths = _write_folder(tmp_path)
    order = data.epoch_order(24, 8, seed=0, epoch=0)
    streams = [data.process_order(order, p, 2) for p in range(2)]
    # Process 0: one bad file mid-stream and the last one (wraps to its first readable one).
    bad = {int(streams[0][2]), int(streams[0][-1])}
    for i in bad:
        with open(paths[i], "wb") as f:
            f.write(b"not a png")
    # tf.data's rows (tests/data/test_grain.py holds grain's to the same).
    config = _config(str(tmp_path), source="folder", skip_corrupt=True, loader="tf")
    full = _check_replaced(config, lambda p: streams[p], bad)
    assert sum(int(b["replaced"].sum()) for b in full[0]) == 2
    assert "skipped unreadable image" in capfd.readouterr().err
    config.skip_corrupt = False
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"Unreadable.*\.png"):
        _epoch(config, 2, seed=0, epoch=0)
    for path in paths:  # nothing left to stand in: a clear error, not a short epoch
        with open(path, "wb") as f:
            f.write(b"not a png")
    config.skip_corrupt = True
    with pytest.raises(tf.errors.InvalidArgumentError, match="No readable image"):
        _epoch(config, 1, seed=0, epoch=0)


def _mock_tfds(num, bad):
    """tfds.testing.mock_data serving PNG bytes, with garbage at the indices in `bad`."""
    images = [
        b"garbage" if i in bad else tf.io.encode_png(np.full((5, 4, 3), i, np.uint8)).numpy()
        for i in range(num)
    ]

    def as_dataset(self, *args, **kwargs):
        return tf.data.Dataset.from_tensor_slices(
            {"image": images, "label": np.arange(num, dtype=np.int64) % 10}
        )

    return tfds.testing.mock_data(as_dataset_fn=as_dataset)


def test_tfds_skip_corrupt_cached(tmp_path):
    order = data.epoch_order(32, 8, seed=0, epoch=0)
    streams = [data.process_order(order, p, 2) for p in range(2)]
    bad = {int(streams[1][0]), int(streams[1][-1]), int(streams[0][5])}
    config = _config(str(tmp_path), source="tfds", name="cifar10", cache=True, skip_corrupt=True)
    with _mock_tfds(32, bad):
        _check_replaced(config, lambda p: streams[p], bad)
        config.update(dict(skip_corrupt=False, train_subset=31))  # a new cache key
        with pytest.raises(ValueError, match=r"unreadable or corrupt.*skip_corrupt=True"):
            _epoch(config, 1, seed=0, epoch=0)


def test_tfds_skip_corrupt_streamed(tmp_path):
    config = _config(str(tmp_path), source="tfds", name="cifar10")
    with _mock_tfds(32, set()):
        clean = _epoch(config, 2, seed=0, epoch=0)
    streams = [np.concatenate([b["index"] for b in batches]) for batches in clean]
    # Two adjacent bad ones on process 1 and the last one of process 0 (wraps around).
    bad = {int(streams[1][3]), int(streams[1][4]), int(streams[0][-1])}
    with _mock_tfds(32, bad):
        config.skip_corrupt = True
        _check_replaced(config, lambda p: streams[p], bad)
        config.skip_corrupt = False
        with pytest.raises(tf.errors.InvalidArgumentError):
            _epoch(config, 1, seed=0, epoch=0)


def test_array_record_skip_corrupt_and_eval(array_record_dir, monkeypatch):
    config = _config(array_record_dir, train_subset=32)
    order = data.epoch_order(32, 8, seed=0, epoch=0)
    streams = [data.process_order(order, p, 2) for p in range(2)]
    bad = {int(streams[0][1]), int(streams[1][-1])}
    fetch = sources.SplitSource.fetch

    def fetch_with_garbage(self, indices):
        images, labels = fetch(self, indices)
        images[[int(i) in bad for i in indices]] = b"garbage"
        return images, labels

    monkeypatch.setattr(sources.SplitSource, "fetch", fetch_with_garbage)
    config.skip_corrupt = True
    _check_replaced(config, lambda p: streams[p], bad)
    config.skip_corrupt = False
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"Unreadable.*example \d+ of split"):
        _epoch(config, 2, seed=0, epoch=0)
    monkeypatch.undo()
    # data.cache decodes the split through the same reads, and gives the same rows.
    config.cache = True
    cached = _global(_epoch(config, 2, seed=0, epoch=0))
    for t, batch in enumerate(cached):
        np.testing.assert_array_equal(batch["index"], order[t])
    # Evaluation reads the ArrayRecord files in index order: every example once.
    batches = list(data.build_eval_dataset(config, "test", batch_size=8).as_numpy_iterator())
    np.testing.assert_array_equal(np.concatenate([b["index"] for b in batches]), np.arange(16))


def test_unknown_split_names_the_choices(demo_dir, tmp_path):
    with pytest.raises(
        ValueError, match=r"Unknown split 'tset'.*\['test', 'train'\].*data.test_split"
    ):
        data.num_examples(_config(demo_dir, test_split="tset"), "tset")
    _write_folder(tmp_path)
    config = _config(str(tmp_path), source="folder", train_split="tset")
    with pytest.raises(ValueError, match=r"Unknown split 'tset'.*\['train'\].*data.train_split"):
        data.steps_per_epoch(config)
    for split in ("/etc", "../x", "train/../../etc", ""):
        config.train_split = split
        with pytest.raises(ValueError, match="absolute paths and '..' are refused"):
            data.steps_per_epoch(config)
