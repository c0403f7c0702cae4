"""Shared pytest set-up: keep TensorFlow off accelerators and quiet, run JAX on the host CPU."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (minutes each: the full demo run) run only with JSSL_SLOW_TESTS=1,
    so that the default suite stays within CI's budget."""
    if os.environ.get("JSSL_SLOW_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set JSSL_SLOW_TESTS=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
