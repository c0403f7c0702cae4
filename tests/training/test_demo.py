"""The README's demos as measurements: each method's demo preset, run as a user runs it, must
learn features that beat a randomly initialised network on kNN by a clear margin.

Slow (2-5 minutes each on 2 cores): runs with JSSL_SLOW_TESTS=1.
``JSSL_SLOW_TESTS=1 python -m pytest tests/training/test_demo.py -k moco`` runs the quick start.
"""

import os
import sys

import pytest
from support.launch import REPO, prepare_shared_dirs

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import demos  # noqa: E402  (benchmarks/demos.py: the sweep over seeds and device counts)


# Each demo against its goal in demos.DEMOS: 10 points over random-init kNN, the MoCo quick
# start 15.
@pytest.mark.slow
@pytest.mark.parametrize("demo", list(demos.DEMOS))
def test_demo_learned_knn_beats_random_init(demo, tmp_path_factory):
    data_dir, _ = prepare_shared_dirs(tmp_path_factory)
    row = demos.run_demo(demo, seed=0, devices=1, data_dir=data_dir, timeout=900)
    assert row["margin"] > demos.DEMOS[demo], row
