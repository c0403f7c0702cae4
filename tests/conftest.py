"""Shared pytest set-up: keep TensorFlow off accelerators and quiet, run JAX on the host CPU."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
