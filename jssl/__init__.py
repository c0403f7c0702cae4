"""jssl: self-supervised visual representation learning in JAX/Flax (a VISSL reimplementation).

From the command line, ``jssl --config=configs/moco.py:demo --workdir=runs/demo`` (or
``python launch.py ...``). From Python, :func:`train` runs the train engine with the same
process set-up, on jssl's data pipeline or on batches of the caller's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

# clu imports its TensorFlow summary writer with clu.metric_writers (and so with
# clu.periodic_actions); where TensorFlow is not installed, hand clu a TensorFlow-free one
# before anything imports clu. Cheap: imports no TensorFlow, JAX or clu.
from jssl.training import summaries as _summaries

_summaries.allow_clu_without_tensorflow()

__version__ = "0.1.0"


def train(
    config: Any,
    workdir: str,
    *,
    batches: Iterable[dict] | Callable[[int], Iterable[dict]] | None = None,
    steps_per_epoch: int | None = None,
) -> dict:
    """Trains ``config`` (a ``get_config(preset)`` of configs/) in ``workdir``, as
    ``jssl --config=... --workdir=...`` does: the same process set-up (CPU XLA flags, which
    must come before JAX's first computation; TensorFlow off the accelerators; the
    compilation cache), the workdir's lock and config rules, resume and checkpoints.

    ``batches``: the caller's own host batches instead of jssl's pipeline: an iterable read
    once per epoch (a list, a PyTorch DataLoader, ...) or a function ``epoch -> iterable``.
    Each batch is a dict laid out as jssl.data's (``crops``: one ``(n, crops, S, S, 3)``
    float32 array per crop group of ``data.augment``; ``index``: ``(n,)`` dataset indices;
    ``label`` where the method or the online probe reads labels), ``n`` = this process's
    share of ``data.batch_size``. ``steps_per_epoch`` batches make an epoch (default
    ``len(batches)``). A resumed run skips the batches of its epoch already trained on.

    Returns the train engine's summary (``step``, ``loss``, ``preempted``, ...).
    """
    from jssl import process

    process.configure()
    process.hide_accelerators_from_tensorflow()
    from jssl import engines

    config.engine = "train"
    engines.engine_function("train")
    process.freeze_imports()
    return engines.run(config, workdir, batches=batches, steps_per_epoch=steps_per_epoch)
