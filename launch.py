r"""jssl's entry point: flags, process set-up, then one engine call. No logic lives here.

  python launch.py --config=configs/moco.py:demo --workdir=runs/demo
  python launch.py --config=configs/moco.py --config.optim.base_lr=0.06 --workdir=runs/moco

Multi-host: run the same command on every host with --coordinator_address=HOST:PORT
--num_processes=N --process_id=I (or let SLURM / TPU pods provide them).

Exit status: 0 finished, 75 stopped by SIGTERM after saving a checkpoint (rerun the same
command to resume), anything else a failure.
"""

import gc
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jssl import parallel  # noqa: E402

parallel.configure_cpu_defaults()

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, e.g. configs/moco.py or configs/moco.py:demo.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, logs and outputs go.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-host run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    import tensorflow as tf

    # tf.data only runs input pipelines; keep TensorFlow off the accelerators JAX uses.
    tf.config.set_visible_devices([], "GPU")
    parallel.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)

    import jax

    from jssl import engines

    engines.quiet_orbax_info_logs()
    engines.engine_function(_CONFIG.value.engine)  # imports the engine's modules
    # The ~440k objects the imports made (TensorFlow, JAX, flax, orbax) live as long as the
    # process: frozen, Python's full collections stop rescanning them, which took 0.2 s of
    # the 0.9 s it takes to trace ResNet-18's MoCo step on 2 CPU cores
    # (benchmarks/train_step.py).
    gc.freeze()

    logging.info(
        "jssl: %d process(es), %d device(s) (%s)",
        jax.process_count(),
        jax.device_count(),
        jax.devices()[0].platform,
    )
    summary = engines.run(_CONFIG.value, _WORKDIR.value)
    # 75 = preempted by SIGTERM after saving a checkpoint: rerun the same command to resume.
    sys.exit(engines.exit_status(summary))


if __name__ == "__main__":
    app.run(main)
