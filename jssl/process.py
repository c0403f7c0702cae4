"""Process set-up shared by every way of starting jssl (``jssl`` / ``launch.py``, and
``jssl.train`` from Python): CPU XLA flags before JAX starts its backends, TensorFlow (when
installed, for tf.data) kept off the accelerators, orbax's per-save INFO lines out of the log,
and the import-time objects frozen out of Python's garbage collector."""

from __future__ import annotations

import gc
import os


def configure() -> None:
    """What must happen before JAX initialises its backends: jssl's CPU XLA flags (harmless on
    GPU/TPU hosts) and quiet TensorFlow C++ logs."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from jssl import parallel

    parallel.configure_cpu_defaults()


def hide_accelerators_from_tensorflow() -> None:
    """tf.data only runs input pipelines; keep TensorFlow off the GPUs JAX uses. A no-op where
    TensorFlow is not installed (jssl's core and the demo data need none)."""
    try:
        import tensorflow as tf
    except ImportError:
        return
    tf.config.set_visible_devices([], "GPU")


def freeze_imports() -> None:
    """Quiets orbax's INFO records and freezes the objects the imports made (TensorFlow, JAX,
    flax, orbax: ~440k of them): they live as long as the process, and frozen, Python's full
    collections stop rescanning them, which took 0.2 s of the 0.9 s it takes to trace
    ResNet-18's MoCo step on 2 CPU cores (benchmarks/train_step.py)."""
    from jssl import engines

    engines.quiet_orbax_info_logs()
    gc.freeze()
