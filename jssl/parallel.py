"""Devices, mesh, the sharding rule of the train state, and the host-local <-> global array
plumbing.

jssl runs one jitted step over a 1-D mesh of every device of every process, the batch
sharded on the ``data`` axis. Methods that need named collectives (MoCo's gathered keys,
batch-norm statistics) run their per-replica code inside ``jax.shard_map`` over that axis.
With ``parallel.shard_params`` the large arrays of the state are split over the same axis
(ZeRO-3 / FSDP): ``leaf_spec`` is the rule, ``gather`` and ``mean_to_shards`` the step's
collectives. ``after`` orders collectives that nothing else orders (XLA's CPU runtime).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"

# XLA's YNNPACK fusion of individual convolutions is slower than XLA's own convolution
# emitter for ResNet training steps on CPU (benchmarks/train_step.py --compare_cpu_flags).
CPU_XLA_FLAGS = ("--xla_cpu_experimental_ynn_fusion_type=-individual_convolution",)


def configure_cpu_defaults() -> None:
    """Adds jssl's CPU XLA flags to ``XLA_FLAGS`` unless the user already set them.

    Must run before JAX initialises its backends (i.e. before the first computation);
    flags only affect the CPU backend, so this is harmless on GPU/TPU hosts.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in CPU_XLA_FLAGS:
        name = flag.split("=")[0]
        if name not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    initialization_timeout: int = 300,
) -> None:
    """Starts ``jax.distributed`` when this is a multi-process run.

    Multi-process when a coordinator is given explicitly, or when the cluster environment
    (SLURM, TPU pods, ...) lets ``jax.distributed.initialize()`` discover one. On a CPU
    cluster (or the tests' localhost processes) the gloo collectives are used. A process that
    waits more than ``initialization_timeout`` seconds for the others to connect exits with
    status 1 and a line saying what it waited for (``_connect_deadline``).
    """
    explicit = coordinator_address is not None
    if not explicit and (num_processes is not None or process_id is not None):
        raise ValueError(
            "--num_processes/--process_id were given without --coordinator_address: pass all "
            "three (HOST:PORT of process 0) for a multi-host run, or none for a single process."
        )
    if initialization_timeout < 1:
        raise ValueError(
            f"--initialization_timeout={initialization_timeout} must be at least 1 (seconds)."
        )
    cluster = None if explicit else _cluster_environment()
    if not explicit and cluster is None:
        return
    # Only the CPU backend reads this; it lets CPU-only clusters (and the tests) all-reduce.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    deadline = _connect_deadline(
        initialization_timeout, coordinator_address, num_processes, process_id
    )
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            # jax's own deadline aborts the process with a C++ stack dump that says only
            # "another task died"; it is left as a backstop behind jssl's.
            initialization_timeout=initialization_timeout + _JAX_BACKSTOP_S,
        )
    except (RuntimeError, ValueError) as e:
        if explicit:
            raise
        raise RuntimeError(
            f"The environment looks like a multi-process {cluster} job, but jax.distributed "
            f"could not start from it ({type(e).__name__}: {e}). Pass --coordinator_address, "
            "--num_processes and --process_id explicitly, or unset the cluster variables "
            f"({', '.join(_CLUSTER_KEYS[cluster])}) to run a single process."
        ) from e
    finally:
        deadline.cancel()
    logging.info(
        "jax.distributed: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


# Seconds jax.distributed's own connection deadline runs after jssl's (see ``initialize``).
_JAX_BACKSTOP_S = 30


def _connect_deadline(
    timeout_s: int, address: str | None, num_processes: int | None, process_id: int | None
) -> threading.Timer:
    """A started timer that, unless cancelled within ``timeout_s``, logs which connection this
    process waited for and how to fix it, and exits the process with status 1.

    jax.distributed's connection is one call that waits for every process; when it gives up it
    aborts with a C++ stack dump that says "another task died", naming neither the processes
    missing (it does not tell them) nor the setting to raise. This message gives what is known:
    the count, the coordinator's address, and whether anything answers there.
    """

    def give_up() -> None:
        me = "This process" if process_id is None else f"Process {process_id}"
        count = "all the processes" if num_processes is None else f"all {num_processes} processes"
        where = address or "the coordinator the cluster environment names"
        # jax.distributed does not say which processes are missing; of two, it is the other.
        missing = "not all did (jax.distributed does not say which)"
        if num_processes == 2 and process_id == 0:
            missing = "process 1 did not"
        message = (
            f"{me} waited {timeout_s} s (--initialization_timeout) for {count} of the run to "
            f"connect to the coordinator at {where}, and {missing}. "
        )
        if process_id != 0 and address is not None and not _answers(address):
            message += (
                f"Nothing answers at {address}: process 0, which runs the coordinator, has not "
                "started or cannot be reached from this host at that address. "
            )
        if num_processes is not None:
            message += (
                f"Start every process with the same --coordinator_address and "
                f"--num_processes={num_processes}, each with its own --process_id in 0.."
                f"{num_processes - 1}; "
            )
        message += "raise --initialization_timeout if some processes start later."
        logging.error("%s", message)
        logging.flush()
        os._exit(1)

    timer = threading.Timer(timeout_s, give_up)
    timer.daemon = True
    timer.start()
    return timer


def _answers(address: str) -> bool:
    """Whether something accepts a TCP connection at ``HOST:PORT`` (within 2 s)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


_CLUSTER_KEYS = {
    "SLURM": ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_STEP_NODELIST"),
    "Cloud TPU": ("TPU_WORKER_HOSTNAMES",),
    "Multislice TPU": ("MEGASCALE_COORDINATOR_ADDRESS",),
}


def _cluster_environment() -> str | None:
    """The multi-process cluster this process was started in, or None for a single process.

    SLURM counts only for a step started by ``srun`` with more than one task: a SLURM_JOB_ID
    alone (an ``salloc`` shell, a batch script running python directly, a variable left in
    the environment) is one process. A TPU VM counts when it lists more than one worker.
    """
    env = os.environ
    if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env and "SLURM_STEP_NODELIST" in env:
        tasks = env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1"))
        if tasks.isdigit() and int(tasks) > 1:
            return "SLURM"
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]) > 1:
        return "Cloud TPU"
    if "MEGASCALE_COORDINATOR_ADDRESS" in env:
        return "Multislice TPU"
    return None


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh named ``data`` over ``devices``, by default every device of every process
    (the verify engine's reference passes one device)."""
    return Mesh(np.asarray(jax.devices() if devices is None else list(devices)), (DATA_AXIS,))


def after(tree: Any, *deps: Any) -> Any:
    """``tree`` unchanged, but computed only once every leaf of ``deps`` is: a data dependency
    XLA keeps (a select on a comparison that never holds), where none exists.

    Every device must enter a step's collectives in one order. On GPUs and TPUs they run in the
    compiled order; XLA's CPU runtime runs whatever the data allow in parallel and keeps only
    the collectives of one computation in order, not one inside a loop or a conditional
    against those beside it (Sinkhorn's loop, accumulation's, a conditional update). Two
    devices could then take them in opposite orders and wait for each other until the
    rendezvous aborts; ``after`` puts them in one order (tests/training/test_collective_order.py
    reads the compiled steps). ``optimization_barrier`` does not: XLA's CPU pipeline drops it.
    """
    leaves = jax.tree.leaves(deps)
    if not leaves:
        return tree
    # Every element (of one, XLA would see which part of a stack it comes from), in one sum:
    # XLA's CPU backend compiles a reduction per leaf as a kernel of its own.
    total = jnp.sum(jnp.concatenate([jnp.ravel(leaf).astype(jnp.float32) for leaf in leaves]))
    return jax.tree.map(lambda x: jnp.where(total > jnp.inf, jnp.zeros_like(x), x), tree)


def data_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over the data axis."""
    return NamedSharding(mesh, P(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def leaf_spec(shape: tuple[int, ...], devices: int, min_size: int) -> P:
    """The FSDP rule for one array: its largest dimension that ``devices`` divides is split
    over the data axis (the last of equal ones: a kernel's output features); an array of fewer
    than ``min_size`` elements (biases, norms, small kernels: splitting them saves little and
    costs a collective each), or with no such dimension, is replicated."""
    if devices == 1 or int(np.prod(shape, dtype=np.int64)) < min_size:
        return P()
    best = None
    for dim, size in enumerate(shape):
        if size % devices == 0 and (best is None or size >= shape[best]):
            best = dim
    if best is None:
        return P()
    return P(*[DATA_AXIS if dim == best else None for dim in range(len(shape))])


def sharded_dim(spec: P) -> int | None:
    """The dimension ``spec`` splits over the data axis; None when it is replicated."""
    for dim, axis in enumerate(spec):
        if axis == DATA_AXIS:
            return dim
    return None


def gather(tree: Any, specs: Any, kept: Any = None) -> Any:
    """Inside ``shard_map``: every leaf that ``specs`` splits over the data axis, whole, but
    those that ``kept`` (a tree of bools like ``tree``) marks: the rematerialised blocks that
    use them gather them (jssl.models.remat.gathering)."""

    def whole(x, spec, keep=False):
        dim = sharded_dim(spec)
        if dim is None or keep:
            return x
        return jax.lax.all_gather(x, DATA_AXIS, axis=dim, tiled=True)

    if kept is None:
        return jax.tree.map(whole, tree, specs)
    return jax.tree.map(whole, tree, specs, kept)


def mean_to_shards(tree: Any, specs: Any, replicas: int, summed: Any = None) -> Any:
    """Inside ``shard_map``: per-device values (gradients) averaged over the data axis, each
    leaf left as this device's part of its spec (a reduce-scatter) or whole (an all-reduce).
    Leaves that ``summed`` (a tree of bools) marks are this device's part of the sum already
    (the gradient of a block's own gather, whose transpose is the reduce-scatter): divided.

    Over one device the mean is the value itself, but XLA would still emit the all-reduce and
    give every gradient a second buffer; it is left out.
    """

    def mean(x, spec, done=False):
        if replicas == 1:
            return x
        dim = sharded_dim(spec)
        if dim is None:
            return jax.lax.pmean(x, DATA_AXIS)
        if done:
            return x / replicas
        return jax.lax.psum_scatter(x, DATA_AXIS, scatter_dimension=dim, tiled=True) / replicas

    if summed is None:
        return jax.tree.map(mean, tree, specs)
    return jax.tree.map(mean, tree, specs, summed)


def named(mesh: Mesh, specs: Any) -> Any:
    """``specs`` (a pytree of PartitionSpec) as NamedShardings on ``mesh``."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


def host_batch_to_global(batch: Mapping[str, Any], mesh: Mesh) -> Any:
    """Turns this process's slice of the batch into global arrays sharded on ``data``.

    Every process passes its own host-local rows; the global batch is their concatenation
    in process order, which is how the data pipeline splits it.
    """
    sharding = data_sharding(mesh)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch
    )


def global_to_host(tree: Any) -> Any:
    """Fetches (possibly multi-process) global arrays as full numpy arrays on every host."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, jax.device_get(tree))
    return multihost_utils.process_allgather(tree, tiled=True)


def check_batch_divisible(global_batch: int, field: str = "data.batch_size") -> None:
    """The global batch (the config field ``field``) must split evenly over devices and
    processes."""
    n, p = jax.device_count(), jax.process_count()
    if global_batch % n:
        raise ValueError(
            f"{field}={global_batch} is not divisible by the {n} devices; "
            f"set --config.{field} to a multiple of {n}."
        )
    if global_batch % p:
        raise ValueError(
            f"{field}={global_batch} is not divisible by the {p} processes; "
            f"set --config.{field} to a multiple of {p}."
        )
