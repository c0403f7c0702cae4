"""Runs a test file as a script on fake CPU devices: its ``__main__`` part computes on N devices
and saves what the test compares with the same computation on one."""

import os
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_on_devices(script: str, out, devices: int = 4, timeout: int = 120) -> dict:
    """``python script out`` with ``devices`` host-platform devices; returns ``np.load(out)``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = f" --xla_force_host_platform_device_count={devices}"
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + flags
    # jssl (the checkout) and tests/support are importable, as under pytest.
    paths = [REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    subprocess.run([sys.executable, script, str(out)], env=env, check=True, timeout=timeout)
    return dict(np.load(out))
