r"""Images/s of feature extraction: the engine's eval forward, pooling, gather and .npy writes.

  python benchmarks/extract_features.py                      # both cases on the present devices
  python benchmarks/extract_features.py --cases=demo_32 --batches=20

Cases: r50_224 = ResNet-50 at 224 px, VISSL's pooled res4 + res5 + avgpool (the linear
benchmark's taps), global batch 64; demo_32 = the moco demo model (ResNet-18 x0.25, CIFAR
stem) at 32 px, avgpool, global batch 500. Synthetic images and randomly initialised
weights, so this measures what jssl.engines.extract_features adds on top of the input pipeline
(benchmarks/input_pipeline.py measures that). The first batch (compilation) is not timed.

Each run prints one line per case and writes them to benchmarks/results/extract_features.json
(``--results``, ``--no_results``) with the command and the machine (benchmarks/results.py).
"""

import argparse
import os
import sys
import tempfile
import time

import results  # benchmarks/, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CASES = {
    "r50_224": dict(preset="", layers=("res4", "res5", "avgpool"), pool="vissl_resnet50", batch=64),
    "demo_32": dict(preset="demo", layers=("avgpool",), pool="none", batch=500),
}


def run_case(name: str, num_batches: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from configs import extract_features
    from jssl import parallel
    from jssl.checkpoints import weights
    from jssl.engines import extract_features as extract_engine
    from jssl.evaluation import features, pooling
    from jssl.evaluation.batches import from_host_batches

    spec = CASES[name]
    config = extract_features.get_config(spec["preset"])
    batch, size = spec["batch"], config.data.image_size
    mesh = parallel.make_mesh()
    model = weights.trunk_model(config)  # the engine's model for trunk layers
    variables = jax.jit(
        lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3)), train=False),
        out_shardings=parallel.replicated(mesh),
    )()
    layers = spec["layers"]
    extract_fn = extract_engine.make_extract_fn(
        model, layers, pooling.layer_pools(spec["pool"], layers)
    )
    images = np.random.RandomState(0).normal(size=(batch, size, size, 3)).astype(np.float32)
    num = batch * num_batches

    def batches():
        for b in range(num_batches):
            yield {
                "image": images,
                "label": np.zeros(batch, np.int32),
                "index": np.arange(b * batch, (b + 1) * batch),
                "mask": np.ones(batch, bool),
            }

    shapes = {k: v.shape[1:] for k, v in jax.eval_shape(extract_fn, variables, images).items()}
    with tempfile.TemporaryDirectory() as out:
        writer = extract_engine._SplitWriter(out, shapes, num)
        stream = features.iterate_features(
            lambda x: extract_fn(variables, x), from_host_batches(batches(), mesh)
        )
        start = time.perf_counter()
        for step, (feats, labels, indices) in enumerate(stream):
            writer.write(feats, labels, indices)
            if step == 0:
                compile_s = time.perf_counter() - start
                start = time.perf_counter()
        seconds = time.perf_counter() - start
        writer.finish(allow_missing=False)
    return {
        "case": name,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "batch": batch,
        "features": ", ".join(f"{k} {int(np.prod(v))}" for k, v in shapes.items()),
        "first batch s (compile)": round(compile_s, 1),
        "images/s": round(batch * (num_batches - 1) / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {list(CASES)}")
    parser.add_argument("--batches", type=int, default=6, help="batches per case, first untimed")
    results.add_flags(parser)
    args = parser.parse_args()
    from jssl import parallel

    parallel.configure_cpu_defaults()
    rows = []
    for name in args.cases.split(","):
        rows.append(run_case(name, max(2, args.batches)))
        print(rows[-1], flush=True)
    results.record("extract_features", rows, args=args, measures=results.summary(__doc__))


if __name__ == "__main__":
    main()
