"""One case of benchmarks/train_step.py in its own process: the step's timings as JSON.

``train_step.spawn`` runs ``python benchmarks/step_child.py '<job as JSON>'`` once per case, so
that compile caches and XLA flags do not leak between cases; this prints the case's step times,
compile time, peak memory and loss as the last line of its output. Every import of jax, jssl and
torch is inside a function, so importing the module needs none of them.
"""

import gc
import json
import os
import subprocess
import sys
import time

import mfu  # benchmarks/, beside this script
from step_cases import CASES, case_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(job: dict, env: dict, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Runs ``job`` in a fresh process of this script with ``env``; its output as text."""
    command = [sys.executable, os.path.abspath(__file__), json.dumps(job)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def _host_peak_bytes() -> int:
    """The process's peak resident memory (RSS)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_bytes(device=None) -> int:
    peak = (device.memory_stats() or {}).get("peak_bytes_in_use") if device else None
    return _host_peak_bytes() if peak is None else peak  # CPU: the process's peak RSS


def run_case(
    case: str,
    dtype: str,
    steps: int,
    method_name: str,
    queue_size: int,
    on_device: bool = False,
    bare: bool = False,
    batch: int | None = None,
    compile_only: bool = False,
    flops: float | None = None,
    trace_dir: str | None = None,
) -> dict:
    """Runs in a child process: builds the method's step, compiles it and times each step.
    ``batch`` replaces the case's; ``compile_only`` returns after compiling, with XLA's plan of
    the step's device memory (benchmarks/method_steps.py fills a compilation cache so);
    ``flops`` is a count made before; ``trace_dir`` takes a jax.profiler trace of 5 more steps."""
    import bare_step
    import jax

    from jssl import data, methods, parallel
    from jssl.data import device_augment
    from jssl.engines.train import init_state, make_optimizer
    from jssl.training.step import make_train_step, stop_flags

    spec = dict(CASES[case], batch=batch or CASES[case]["batch"])
    config = case_config(method_name, spec, dtype, queue_size, on_device)
    mesh = parallel.make_mesh()
    method = methods.get(config, steps_per_epoch=1000)
    tx, schedule = make_optimizer(config, method, steps_per_epoch=1000)
    state = init_state(config, method, tx, mesh)
    augment = device_augment.make_batch_augment(config.data)
    step = make_train_step(method, tx, schedule, mesh, augment=augment)
    if bare:  # the same method without jssl's machinery around it (bare_step.py)
        step = bare_step.make_bare_step(method, tx, mesh)

    host = data.synthetic_batch(config.data, spec["batch"])
    batch_arrays = parallel.host_batch_to_global(host, mesh)
    stop = stop_flags(mesh, False)
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = step.lower(state, batch_arrays, stop)
    compiled = lowered.compile()
    compile_s, compile_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    flops = flops or mfu.step_flops(lowered)
    device = jax.devices()[0]
    if flops is None and device.platform != "cpu" and not batch:  # count_on_cpu: the case's
        flops = mfu.count_on_cpu(method_name, case, dtype, queue_size, on_device)
    if compile_only:
        plan = compiled.memory_analysis()
        planned = plan.argument_size_in_bytes + plan.output_size_in_bytes
        planned += plan.temp_size_in_bytes - plan.alias_size_in_bytes
        limit = (device.memory_stats() or {}).get("bytes_limit")
        return dict(
            compile_s=compile_s,
            compile_cpu_s=compile_cpu_s,
            flops=flops,
            planned_gib=planned / 2**30,
            limit_gib=limit / 2**30 if limit else None,
        )
    state, metrics = compiled(state, batch_arrays, stop)  # warm-up
    jax.block_until_ready((state, metrics))
    times, cpu_times = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        state, metrics = compiled(state, batch_arrays, stop)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    augment_s = []
    if augment is not None:  # the same augmentation alone, one jitted call per batch
        augment_alone = jax.jit(augment)
        jax.block_until_ready(augment_alone(batch_arrays))
        for _ in range(steps):
            t0 = time.perf_counter()
            jax.block_until_ready(augment_alone(batch_arrays))
            augment_s.append(time.perf_counter() - t0)
    if trace_dir:  # 5 more steps under the profiler (a Perfetto trace beside the xplane)
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(5):
                state, metrics = compiled(state, batch_arrays, stop)
            jax.block_until_ready((state, metrics))
    return dict(
        augment_s=augment_s,
        devices=f"{jax.device_count()}x{device.platform}",
        step_s=times,
        cpu_s=cpu_times,
        compile_s=compile_s,
        compile_cpu_s=compile_cpu_s,
        peak_gib=_peak_bytes(device) / 2**30,
        host_peak_gib=_host_peak_bytes() / 2**30,
        loss=float(metrics["loss"]),
        flops=flops,
        device_kind=device.device_kind,
    )


def run_torch_case(
    case: str,
    dtype: str,
    steps: int,
    queue_size: int,
    channels_last: bool = True,
    compile: bool = False,
) -> dict:
    """Runs in a child process: the PyTorch reference step of the same shapes."""
    import torch_reference  # imports torch, a development dependency

    result = torch_reference.run_case(CASES[case], dtype, steps, queue_size, channels_last, compile)
    peak = result.pop("device_peak_gib")
    return dict(result, peak_gib=_peak_bytes() / 2**30 if peak is None else peak)


def main(job: dict) -> None:
    """Runs ``job`` (a dict of train_step.spawn) and prints its result as JSON."""
    if job["impl"] == "torch":
        channels_last = job.get("layout", "channels_last") == "channels_last"
        result = run_torch_case(
            job["case"],
            job["dtype"],
            job["steps"],
            job["queue"],
            channels_last,
            job.get("compile", False),
        )
        print(json.dumps(result))
        return
    if not os.environ.get("JSSL_XLA_DEFAULTS"):
        from jssl import parallel

        parallel.configure_cpu_defaults()
    # Both JAX steps' processes import the same modules, so that their peak RSS differs only by
    # what building and running the step holds: --with_plain compares the two.
    import plain_step

    from jssl.engines import train  # noqa: F401

    # As launch.py does after its imports: full collections would otherwise rescan every
    # imported object while the step is traced.
    gc.freeze()
    if job["impl"] == "plain":
        config = case_config("moco", CASES[job["case"]], job["dtype"], job["queue"])
        result = plain_step.run_case(config, job["steps"])
        print(json.dumps(dict(result, host_peak_gib=_host_peak_bytes() / 2**30)))
        return
    args = job["case"], job["dtype"], job["steps"], job["method"], job["queue"]
    options = ("batch", "compile_only", "flops", "trace_dir")
    result = run_case(
        *args,
        job.get("on_device", False),
        job.get("bare", False),
        **{k: job[k] for k in options if job.get(k) is not None},
    )
    print(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, ROOT)  # jssl and configs; benchmarks/ is the script's own directory
    main(json.loads(sys.argv[1]))
