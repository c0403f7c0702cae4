"""The train engine's images/s end to end against its jitted step alone, same config and batches.

  python benchmarks/train_loop.py                          # MoCo's demo and test presets, CPU
  python benchmarks/train_loop.py --presets=demo --intervals=8 --log_every=10

For each preset of configs/moco.py, a few batches of jssl's pipeline are read once and kept in
memory, so that the input costs nothing. ``jssl.train`` trains on them (``batches=``, one epoch,
no kNN monitor, no test phase), timed at the loop's get of each next batch in chunks of
``--log_every`` steps after the first (which compiles the step): everything the loop does around
the step (the batch's copy to the devices in the prefetch thread, the stop flag, the non-finite
checks, the periodic actions, the metrics written). The step alone is the same compiled step
(``jssl.engines.train.make_step``: the same method, optimizer and state) called back to back on
batches already on the devices, in chunks of as many steps before, between and after the
loop's ``--rounds`` runs. Each figure is the median chunk's: images/s, and process CPU seconds
per step (all threads; other jobs on the machine move it less than wall time). The ratio loop /
step is what the loop leaves of the step's speed (the issue's bar: at least 0.95).
"""

from __future__ import annotations

import argparse
import glob
import itertools
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import results  # noqa: E402  benchmarks/, beside this script; notes the environment first

from jssl import process  # noqa: E402

process.configure()  # jssl's CPU XLA flags, before JAX starts (as jssl.train does)

import jax  # noqa: E402

import jssl  # noqa: E402
from configs import moco  # noqa: E402
from jssl import data, methods, parallel  # noqa: E402
from jssl.engines import train  # noqa: E402
from jssl.training import collapse, prefetch  # noqa: E402
from jssl.training.fresh import init_state  # noqa: E402
from jssl.training.step import stop_flags  # noqa: E402

CACHED_BATCHES = 4  # distinct batches, cycled through


def make_config(preset: str, log_every: int, data_dir: str):
    """MoCo's ``preset`` for one epoch on the caller's batches, logging every ``log_every``."""
    config = moco.get_config(preset)
    config.data.data_dir = data_dir
    config.num_epochs = 1
    config.log_every_steps = log_every
    config.knn.enabled = False
    config.test_every_epochs = 0
    config.checkpoint.every_steps = 0  # the epoch's end saves once, after the last interval
    config.optim.warmup_epochs = 0  # one epoch: the demo's warm-up epoch would leave no cosine
    return config


def cached_batches(config) -> list[dict]:
    """The first ``CACHED_BATCHES`` batches of the pipeline, as numpy arrays in memory."""
    dataset = data.build_train_dataset(
        config.data, seed=config.seed, epoch=0, process_index=0, process_count=1
    )
    batches = dataset.as_numpy_iterator()
    return [next(batches) for _ in range(CACHED_BATCHES)]


def _scalars(logdir: str, tag: str) -> dict[int, float]:
    import tensorflow as tf

    values = {}
    for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    values[event.step] = float(tf.make_ndarray(value.tensor))
    return values


def _chunks(marks: list[tuple[float, float]], chunk: int, images: int) -> list[tuple[float, float]]:
    """(images/s, CPU seconds per step) between consecutive (wall, process CPU) ``marks``,
    ``chunk`` steps of ``images`` apart."""
    pairs = zip(marks, marks[1:], strict=False)
    return [(chunk * images / (w1 - w0), (c1 - c0) / chunk) for (w0, c0), (w1, c1) in pairs]


def loop_chunks(config, batches: list[dict], steps: int, workdir: str):
    """The loop's chunks of ``log_every`` steps after the first (which compiles), timed at its
    gets of the next batch (the main thread, once per step), and the median
    ``perf/data_wait_fraction`` the run wrote for them."""
    marks = []
    untimed_next = prefetch.DevicePrefetch.__next__

    def timed_next(self):
        marks.append((time.perf_counter(), time.process_time()))
        return untimed_next(self)

    prefetch.DevicePrefetch.__next__ = timed_next
    try:
        summary = jssl.train(
            config, workdir, batches=[batches[i % len(batches)] for i in range(steps)]
        )
    finally:
        prefetch.DevicePrefetch.__next__ = untimed_next
    assert summary["step"] == steps, summary["step"]
    chunk = config.log_every_steps
    waits = _scalars(os.path.join(workdir, "tensorboard"), "perf/data_wait_fraction")
    wait = statistics.median(v for s, v in waits.items() if s > chunk)
    return _chunks(marks[chunk::chunk], chunk, config.data.batch_size), wait


class StepAlone:
    """The engine's compiled step for ``config`` (``jssl.engines.train.make_step``: the same
    method, optimizer and state as the loop's) on batches already on the devices, compiled
    and warmed up once; ``chunks`` times chunks of ``log_every`` back-to-back calls."""

    def __init__(self, config, batches: list[dict], steps: int):
        mesh = parallel.make_mesh()
        method = methods.get(config, steps)
        tx, schedule = train.make_optimizer(config, method, steps)
        self.state = init_state(config, method, tx, mesh)
        at_log_steps = collapse.log_steps(config.log_every_steps, steps)
        self.step = train.make_step(config, method, tx, schedule, mesh, self.state, at_log_steps)
        self.batches = itertools.cycle([parallel.host_batch_to_global(b, mesh) for b in batches])
        self.flags = stop_flags(mesh, False)
        self.chunk, self.images = config.log_every_steps, config.data.batch_size
        self._calls(1)  # compiles
        self._calls(self.chunk)  # warms up

    def _calls(self, count: int) -> tuple[float, float]:
        for _ in range(count):
            self.state, _ = self.step(self.state, next(self.batches), self.flags)
        jax.block_until_ready(self.state)
        return time.perf_counter(), time.process_time()

    def chunks(self, count: int) -> list[tuple[float, float]]:
        marks = [(time.perf_counter(), time.process_time())]
        marks += [self._calls(self.chunk) for _ in range(count)]
        return _chunks(marks, self.chunk, self.images)


def measure(preset: str, args, data_dir: str) -> dict:
    steps = args.log_every * (args.intervals + 1)  # the first interval compiles
    config = make_config(preset, args.log_every, data_dir)
    batches = cached_batches(config)
    half = max(args.intervals // 2, 1)
    step_alone = StepAlone(config, batches, steps)
    alone, loop, waits = step_alone.chunks(half), [], []
    for _ in range(args.rounds):  # the loop's runs between chunks of the step alone
        with tempfile.TemporaryDirectory() as workdir:
            chunks, wait = loop_chunks(config, batches, steps, workdir)
        loop += chunks
        waits.append(wait)
        alone += step_alone.chunks(half)
    wait = statistics.median(waits)
    print(f"moco:{preset}: step alone {alone}; loop {loop}", flush=True)
    rate_alone = statistics.median(r for r, _ in alone)
    rate_loop = statistics.median(r for r, _ in loop)
    cpu_alone = statistics.median(c for _, c in alone)
    cpu_loop = statistics.median(c for _, c in loop)
    row = {
        "preset": f"moco:{preset}",
        "batch": config.data.batch_size,
        "px": config.data.image_size,
        "chunks loop+step": f"{len(loop)}+{len(alone)} x {args.log_every}",
        "step alone img/s": results.rounded(rate_alone),
        "loop img/s": results.rounded(rate_loop),
        "loop/step img/s": results.rounded(rate_loop / rate_alone, 3),
        "step alone CPU s/step": results.rounded(cpu_alone),
        "loop CPU s/step": results.rounded(cpu_loop),
        "loop/step CPU s/step": results.rounded(cpu_loop / cpu_alone, 3),
        "loop data wait": results.rounded(wait, 3),
    }
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="demo,test", help="presets of configs/moco.py")
    parser.add_argument("--log_every", type=int, default=10, help="steps per log interval")
    parser.add_argument("--intervals", type=int, default=6, help="timed log intervals per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of the loop")
    parser.add_argument(
        "--data_dir", default=os.path.join(tempfile.gettempdir(), "jssl_bench_tfds")
    )
    results.add_flags(parser)
    args = parser.parse_args()
    rows = [measure(p, args, args.data_dir) for p in args.presets.split(",")]
    headline = [
        f"train loop / step alone, {r['preset']}: {r['loop/step img/s']:.3f} img/s, "
        f"{r['loop/step CPU s/step']:.3f} CPU seconds per step"
        for r in rows
    ]
    print("\n".join(headline))
    results.record(
        "train_loop",
        rows,
        args=args,
        measures=results.summary(__doc__),
        headline=headline,
        notes=(
            "loop: chunks of --log_every steps timed at the loop's gets of its batches, after "
            "the first log interval; step alone: chunks of as many back-to-back calls, before, "
            "between and after the loop's runs; both the median chunk. loop data wait: the "
            "median perf/data_wait_fraction the run wrote after its first interval (the "
            "batches are in memory: the hand-over from the prefetch thread). On CPUs the loop's "
            "host work shares the cores with the step, so its CPU seconds show in the wall time."
        ),
    )


if __name__ == "__main__":
    main()
