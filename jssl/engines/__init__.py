"""Engines: what a run does with a config. ``config.engine`` names one of ``ENGINES``; each is
the module ``jssl.engines.<name>`` exposing ``run(config, workdir) -> dict`` and, where it has
start-up checks, ``validate(config)``, which ``run`` here calls before the workdir is touched.
Adding an engine is one module and one name here."""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import ml_collections
from absl import logging

from jssl.checkpoints import source_model
from jssl.checkpoints import workdir as workdir_lib

ENGINES = (
    "train",
    "extract_features",
    "knn",
    "linear_eval",
    "verify",
    "export",
    "svm",
    "low_shot",
    "cluster",
    "test_loss",
    "evaluate",
)


# The engines that act on a stop request themselves (SIGTERM, a first Ctrl-C): they save
# what is done at an agreed point and return ``preempted``. The others keep nothing worth
# saving part of: a stop ends them where they are, before their results are written.
STOP_CLEANLY = ("train", "linear_eval", "extract_features", "evaluate")


def exit_status(summary: dict[str, Any]) -> int:
    """The process exit status for an engine's summary: 0 when it finished, 75
    (``preemption.PREEMPTED_EXIT_CODE``) when it stopped on SIGTERM or a first Ctrl-C after
    saving, so that a scheduler or wrapper script knows to rerun the same command to resume;
    1 when a check failed (verify's ``passed`` False)."""
    from jssl.training import preemption

    if summary.get("passed") is False:
        return 1
    return preemption.PREEMPTED_EXIT_CODE if summary.get("preempted") else 0


def enable_compilation_cache(config: ml_collections.ConfigDict) -> str | None:
    """Points JAX's persistent compilation cache at ``config.compilation_cache_dir`` unless
    JAX already has a cache directory (``JAX_COMPILATION_CACHE_DIR``, or set by the caller).
    Returns the directory in use, None when the cache is off. Only compilations of 1 s or
    more are cached (JAX's default threshold), so small helper functions do not fill it."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    wanted = config.get("compilation_cache_dir", "")
    if not wanted:
        return None
    path = os.path.abspath(os.path.expanduser(wanted))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"compilation_cache_dir={wanted!r}: cannot create {path} ({e.strerror}); pass a "
            "writable directory, or --config.compilation_cache_dir='' to turn the cache off."
        ) from None
    jax.config.update("jax_compilation_cache_dir", path)
    logging.info("JAX compilation cache: %s", path)
    return path


def quiet_orbax_info_logs() -> None:
    """Keeps orbax's INFO records (about 40 lines per save: throughput, metadata, renames) out
    of the log of a run started with the default ``--verbosity=0``; its warnings and errors
    still show, and ``--verbosity=1`` shows everything."""
    import logging as std_logging

    class _DropOrbaxInfo(std_logging.Filter):
        def filter(self, record: std_logging.LogRecord) -> bool:
            if record.levelno >= std_logging.WARNING or logging.get_verbosity() >= 1:
                return True
            return f"{os.sep}orbax{os.sep}" not in record.pathname

    logging.get_absl_handler().addFilter(_DropOrbaxInfo())


def check_positive(config: ml_collections.ConfigDict, *fields: str) -> None:
    """Start-up check that each dotted ``field`` of ``config`` is an integer >= 1."""
    for field in fields:
        value = config
        for name in field.split("."):
            value = value[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field}={value!r} must be positive: set --config.{field}=<n> > 0.")


def engine_module(name: str) -> ModuleType:
    """The module of engine ``name`` (imported)."""
    if name not in ENGINES:
        raise ValueError(f"engine={name!r} is not one of {ENGINES}; set --config.engine.")
    return importlib.import_module(f"jssl.engines.{name}")


def engine_function(name: str):
    """The ``run(config, workdir)`` function of engine ``name`` (importing its module)."""
    return engine_module(name).run


def validate(config: ml_collections.ConfigDict) -> None:
    """The start-up checks of ``config.engine`` (its module's ``validate``, where it has one);
    each failure raises an exception that names the field and the fix."""
    check = getattr(engine_module(config.engine), "validate", None)
    if check is not None:
        check(config)


def run(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    explicit: Iterable[str] = (),
    batches: Any = None,
    steps_per_epoch: int | None = None,
) -> dict[str, Any]:
    """Runs ``config.engine`` on ``workdir``: the config is validated first, so a refused
    config leaves nothing behind (no workdir, no config.json, no compilation cache).

    An evaluation engine first takes the ``model.*`` fields of the workdir it evaluates
    (jssl.checkpoints.source_model), except the dotted fields in ``explicit`` (the command
    line's overrides). ``batches`` and ``steps_per_epoch`` (train only) replace jssl's input
    pipeline by the caller's own host batches (see ``jssl.train``).

    ``~`` in ``workdir`` is the home directory: the shell leaves ``--workdir=~/x`` as it is."""
    workdir = os.path.expanduser(workdir)
    name = config.engine
    run_engine = engine_function(name)
    if batches is not None:
        if name != "train":
            raise ValueError(f"batches= is for engine='train', not {name!r}.")
        run_engine = functools.partial(run_engine, batches=batches, steps_per_epoch=steps_per_epoch)
    source_model.adopt(config, workdir, explicit)
    validate(config)
    enable_compilation_cache(config)
    if name in STOP_CLEANLY:
        return _run_locked(run_engine, config, workdir)
    from jssl.training import preemption

    try:
        with preemption.stop_at_once():
            return _run_locked(run_engine, config, workdir)
    except preemption.StopNow as stop:
        logging.warning("%s", stop)
        return {"preempted": True}


def _run_locked(run_engine, config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """``run_engine`` holding the workdir's lock (and, but for extraction, its config rules)."""
    if config.engine == "extract_features":
        # Extraction may read the training run's own workdir (its config stays as it is);
        # the lock keeps it from running beside that training, or beside another extraction.
        with workdir_lib.lock(workdir):
            return run_engine(config, workdir)
    # One run per workdir at a time, and the workdir's first config kept and enforced
    # (a resumed run must not change what it trains; see jssl.checkpoints.run_config.SAFE_FIELDS).
    with workdir_lib.open_run(config, workdir):
        return run_engine(config, workdir)
