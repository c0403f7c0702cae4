"""Results files are written whole or not at all: a stop or a full disk mid-write leaves the
previous file (SIGTERM in the one-shot engines: tests/evaluation/test_knn.py)."""

import json
import os

import pytest

from jssl.evaluation import results


def test_results_files_are_replaced_whole(tmp_path, monkeypatch):
    path = str(tmp_path / "results.json")
    results.save_json(path, {"a": 1})

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", fail)
    with pytest.raises(OSError):
        results.save_json(path, {"a": 2})
    with open(path) as f:
        assert json.load(f) == {"a": 1}
    assert os.listdir(tmp_path) == ["results.json"]
