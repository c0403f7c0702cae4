r"""The ``jssl`` command (and ``python launch.py``): flags, process set-up, one engine call.

  jssl --config=configs/moco.py:demo --workdir=runs/demo
  jssl --config=configs/moco.py --config.optim.base_lr=0.06 --workdir=runs/moco

``--config`` is a config file, relative to the working directory; the checkout it lives in is
put on ``sys.path`` (so its ``from configs import base`` resolves from any directory), and a
file outside a checkout imports the ``configs`` package installed with jssl. A module it cannot
import, or an override the field cannot take (``--config.data.batch_size=abc``), fails before
anything runs, naming the file or the field, the value and the type (``parse_flags``).
Multi-host: the same command on every host with --coordinator_address, --num_processes and
--process_id (or from SLURM / TPU pods); a process that fails stops them all
(jssl.process.stop_together). Exit status: 0 finished, 75 stopped by SIGTERM or a first Ctrl-C
after saving what is done (rerun the same command to resume), anything else a failure.
"""

from __future__ import annotations

import os
import sys
import textwrap

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jssl import process  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, e.g. configs/moco.py or configs/moco.py:demo.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, logs and outputs go.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-host run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_INITIALIZATION_TIMEOUT = flags.DEFINE_integer(
    "initialization_timeout",
    300,
    "Multi-host: seconds each process waits for all --num_processes to connect to the "
    "coordinator before it exits (status 1) saying what it waited for.",
)
flags.mark_flags_as_required(["config", "workdir"])


def config_checkout(argv: list[str]) -> str | None:
    """The directory holding the ``configs`` package of the ``--config`` file in ``argv``
    (``<checkout>`` for ``<checkout>/configs/moco.py:demo``), None when there is none."""
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            value = arg[len("--config=") :]
        elif arg == "--config" and i + 1 < len(argv):
            value = argv[i + 1]
        else:
            continue
        path = os.path.abspath(value.split(":", 1)[0])
        checkout = os.path.dirname(os.path.dirname(path))
        if os.path.isfile(os.path.join(checkout, "configs", "__init__.py")):
            return checkout
    return None


# How the type of a config field reads in a message, by the flag parser absl gave it.
_SCALAR_TYPES = {"int": "an integer", "float": "a number", "bool": "True or False"}


class ConfigOverrideError(flags.IllegalFlagValueError):
    """A ``--config.<field>=<value>`` whose value the field cannot take."""


class ConfigImportError(flags.IllegalFlagValueError):
    """A config file that imports a module Python cannot find."""


def parse_flags(
    argv: list[str], flag_values: flags.FlagValues = flags.FLAGS, config_name: str = "config"
) -> list[str]:
    """Parses ``argv`` into ``flag_values`` as absl does; a malformed override of the config
    flag ``config_name`` raises ConfigOverrideError naming the field, the value given and the
    type the field takes.

    ml_collections parses a scalar override with absl's parser for the field's type, whose
    error names neither the field's type nor an example; a tuple override it parses element
    by element as Python literals, keeping what fails as a string, so ``num_crops=abc`` would
    only fail deep in the run: the elements are checked here against the config's own."""
    try:
        remaining = flag_values(argv)
    except flags.IllegalFlagValueError as error:
        raise _reworded(error, argv, flag_values, config_name) from None
    except ImportError as error:
        raise ConfigImportError(_import_error_message(argv, error)) from error
    _check_tuple_overrides(flag_values, config_name, argv)
    return remaining


def _import_error_message(argv: list[str], error: ImportError) -> str:
    """What to do about a config file whose import of ``error.name`` failed."""
    paths = [value.split(":", 1)[0] for value in _given(argv, "config")]
    where = f"The config file {paths[-1]}" if paths else "A config file"
    message = f"{where} cannot be loaded: {error}. "
    name = error.name or ""
    if name != "configs" and not name.startswith("configs."):
        return message + "Install the module it imports, or add its folder to PYTHONPATH."
    try:
        import configs
    except ImportError:
        return message + (
            "jssl's recipes (configs.base, configs.moco, ...) are installed with jssl, and a "
            "config file inside a checkout's configs/ folder imports that checkout's: reinstall "
            "jssl (pip install <checkout>), or put the config file there."
        )
    return message + (
        f"The configs package found is jssl's recipes in {os.path.dirname(configs.__file__)}; "
        "import one of its modules (base, recipes, moco, ...), or put a module of your own on "
        "PYTHONPATH under another name."
    )


def overridden_fields(argv: list[str]) -> list[str]:
    """The config fields set on the command line (``--config.model.trunk=x`` -> ``model.trunk``),
    so that an evaluation engine keeps them over the evaluated workdir's config.json."""
    fields = []
    for arg in argv:
        name = arg.lstrip("-").split("=", 1)[0]
        if arg.startswith("-") and name.startswith("config."):
            fields.append(name[len("config.") :])
    return fields


def _given(argv: list[str], flag_name: str) -> list[str]:
    """The values of ``--flag_name`` in ``argv`` (``--f=v`` or ``--f v``), in order."""
    values = []
    for i, arg in enumerate(argv):
        if arg.lstrip("-").startswith(f"{flag_name}=") and arg.startswith("-"):
            values.append(arg.split("=", 1)[1])
        elif arg.lstrip("-") == flag_name and arg.startswith("-") and i + 1 < len(argv):
            values.append(argv[i + 1])
    return values


def _example(flag_name: str, default) -> str:
    """``--flag_name=<default>`` as a shell takes it (a tuple single-quoted, its strings in
    double quotes)."""

    def literal(value) -> str:
        if isinstance(value, (tuple, list)):
            items = [literal(item) for item in value]
            return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
        if isinstance(value, bool):
            return str(value)
        return f'"{value}"' if isinstance(value, str) else repr(value)

    if isinstance(default, (tuple, list)):
        return f"--{flag_name}='{literal(default)}'"
    return f"--{flag_name}={default}"


def _reworded(
    error: flags.IllegalFlagValueError,
    argv: list[str],
    flag_values: flags.FlagValues,
    config_name: str,
) -> flags.IllegalFlagValueError:
    """absl's "flag --config.a.b=x: invalid literal for int()..." as a ConfigOverrideError
    with the field's type and an example; other errors as they are."""
    message = str(error)
    fields = [name for name in flag_values if name.startswith(f"{config_name}.")]
    for flag_name in sorted(fields, key=len, reverse=True):
        flag = flag_values[flag_name]
        kind = _SCALAR_TYPES.get(flag.flag_type())
        if kind is None:
            continue
        for value in _given(argv, flag_name):
            if message.startswith(f"flag --{flag_name}={value}: "):
                field = flag_name.split(".", 1)[1]
                return ConfigOverrideError(
                    f"--{flag_name}={value!r} is not valid: the config field {field} takes "
                    f"{kind} (its value in the config file: {flag.default!r}), e.g. "
                    f"{_example(flag_name, flag.default)}."
                )
    return error


def _leaves(value) -> list:
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def _element_kind(default) -> str | None:
    """What the elements of a tuple field are, judged by its config-file value."""
    types = {type(leaf) for leaf in _leaves(default)}
    if types == {int}:
        return "integers"
    if types and types <= {int, float}:
        return "numbers"
    if types == {str}:
        return "strings"
    return None  # empty, or mixed: nothing to check against


def _fits(kind: str, leaf) -> bool:
    if kind == "integers":
        return type(leaf) is int
    if kind == "numbers":
        return type(leaf) in (int, float)
    # A string spelling a tuple is ml_collections' fallback for an unquoted "(a, b)".
    return isinstance(leaf, str) and not leaf.startswith(("(", "["))


def _check_tuple_overrides(flag_values: flags.FlagValues, config_name: str, argv: list[str]):
    """Each overridden tuple field's elements against the config file's: integers where it
    has integers, numbers where it has numbers, strings (not a tuple's spelling) where it has
    strings. A field whose config value is empty gives nothing to check against."""
    overrides = config_flags.get_override_values(flag_values[config_name])
    for field, value in overrides.items():
        flag_name = f"{config_name}.{field}"
        if not isinstance(value, tuple) or flag_name not in flag_values:
            continue
        default = flag_values[flag_name].default
        kind = _element_kind(default)
        if kind is None or all(_fits(kind, leaf) for leaf in _leaves(value)):
            continue
        shown = " ".join(_given(argv, flag_name)) or repr(value)
        hint = ", each one quoted" if kind == "strings" else ""
        raise ConfigOverrideError(
            f"--{flag_name}={shown!r} is not valid: the config field {field} takes a tuple of "
            f"{kind}{hint} (its value in the config file: {tuple(default)}), not "
            f"{value!r}; e.g. {_example(flag_name, default)}."
        )


def _parse_flags_with_usage(argv: list[str]) -> list[str]:
    """``app.run``'s flags parser: absl's report of a flags error (and exit status 1), with
    config overrides reworded by ``parse_flags``."""
    try:
        return parse_flags(argv)
    except flags.Error as error:
        message = str(error)
        if "\n" in message:
            message = "\n" + textwrap.indent(message, "  ")
        sys.stderr.write(f"FATAL Flags parsing error: {message}\n")
        sys.stderr.write("Pass --helpshort or --helpfull to see help on flags.\n")
        sys.exit(1)


def _main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    import jax

    from jssl import engines, parallel

    process.hide_accelerators_from_tensorflow()
    parallel.initialize(
        _COORDINATOR.value,
        _NUM_PROCESSES.value,
        _PROCESS_ID.value,
        initialization_timeout=_INITIALIZATION_TIMEOUT.value,
    )
    with process.stop_together():  # one process's error stops every process of the run
        engines.engine_function(_CONFIG.value.engine)  # imports the engine's modules
        process.freeze_imports()
        logging.info(
            "jssl: %d process(es), %d device(s) (%s)",
            jax.process_count(),
            jax.device_count(),
            jax.devices()[0].platform,
        )
        summary = engines.run(_CONFIG.value, _WORKDIR.value, explicit=overridden_fields(sys.argv))
    # 75 = preempted after saving a checkpoint: rerun the same command to resume.
    sys.exit(engines.exit_status(summary))


def main() -> None:
    """Entry point of the ``jssl`` console script and of ``launch.py``."""
    checkout = config_checkout(sys.argv)
    if checkout is not None and checkout not in sys.path:
        sys.path.insert(0, checkout)
    process.configure()
    app.run(_main, flags_parser=_parse_flags_with_usage)
