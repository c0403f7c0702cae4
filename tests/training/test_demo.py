"""The README's quick start as a measurement: the MoCo demo preset, run as a user runs it,
must learn features that beat a randomly initialised network on kNN by a clear margin.

Slow (about 5 minutes on 2 cores): runs with JSSL_SLOW_TESTS=1.
"""

import re
import subprocess

import pytest
from support.launch import REPO, launch_args, launch_env, prepare_shared_dirs

# Measured (configs/moco.py _demo): learned 83.1-92.9% over seeds 0-2 and both BN modes, random
# init 48.9-57.6%, the smallest gap 29 points; 15 is far outside both spreads.
MARGIN = 15.0


@pytest.mark.slow
def test_demo_learned_knn_beats_random_init(tmp_path_factory):
    data_dir, cache_dir = prepare_shared_dirs(tmp_path_factory)
    workdir = tmp_path_factory.mktemp("demo")
    args = launch_args(workdir, data_dir, preset="demo")
    result = subprocess.run(
        args, cwd=REPO, env=launch_env(cache_dir), capture_output=True, text=True, timeout=900
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    match = re.search(r"learned ([\d.]+)% vs random init ([\d.]+)%", log)
    assert match, log[-5000:]
    learned, random_init = float(match.group(1)), float(match.group(2))
    assert learned > random_init + MARGIN, match.group(0)
