r"""Milliseconds of each 3x3 convolution of a ResNet-18 (CIFAR stem), against PyTorch.

  python benchmarks/conv_layers.py                      # batch 64 at 32 px, MoCo's R18 b64 step
  python benchmarks/conv_layers.py --batch=128 --no-torch
  python benchmarks/conv_layers.py --split_dw           # lax's weight gradient in its parts

For every distinct 3x3 convolution of ResNet-18 at ``--size`` px (the stem, then per stage the
strided first convolution and the stride-1 ones), times its forward, its input gradient (dx)
and its weight gradient (dw) alone, each a jitted function of fixed inputs, median of
``--repeats`` calls: through jssl's ``cpu_convolution`` (what the ResNet trains with on CPU),
through ``lax.conv_general_dilated`` (XLA's own), and through PyTorch's
``aten.convolution_backward`` in a separate process (``OMP_WAIT_POLICY=PASSIVE`` and
channels-last, as train_step.py's ``--compare_torch``; ``--torch_nchw`` for PyTorch's default
layout). This is where train_step.py's jssl / PyTorch ratio comes from, one
convolution at a time. The stem's dx is not timed: no step needs the image's gradient. Alone,
jssl's forward pays for its input's division by 1 (one more pass over the input); in the ResNet
that division fuses into the batch norm and ReLU that produce the input.

``--split_dw`` times, for each stride-1 convolution, the two parts XLA's CPU backend compiles
lax's weight gradient into: copies of the input as (C, H, W, N) and of the output gradient as
(H, W, N, O), then one convolution of the first by the second (the gradient is its kernel, the
output 3x3 pixels); what the copies cost next to what the convolution itself costs.

Each run prints its table and writes it to benchmarks/results/conv_layers.json (``--results``,
``--no_results``) with the command and the machine (benchmarks/results.py).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import results  # benchmarks/, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shapes(size: int) -> list[tuple[int, int, int, int]]:
    """(input size, in channels, out channels, stride) of ResNet-18's distinct 3x3 convs."""
    out = [(size, 3, 64, 1), (size, 64, 64, 1)]
    for c in (64, 128, 256):
        out += [(size, c, 2 * c, 2), ((size + 1) // 2, 2 * c, 2 * c, 1)]
        size = (size + 1) // 2
    return out


def _median_ms(fn, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _time_jax_conv(impl, shape, batch: int, repeats: int) -> list[float]:
    import jax

    h, cin, cout, s = shape
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (batch, h, h, cin))
    w = 0.05 * jax.random.normal(keys[1], (3, 3, cin, cout))
    dn = jax.lax.conv_dimension_numbers(x.shape, w.shape, ("NHWC", "HWIO", "NHWC"))

    def conv(x, w):
        return impl(x, w, (s, s), ((1, 1), (1, 1)), dimension_numbers=dn)

    dy = jax.random.normal(keys[2], jax.eval_shape(conv, x, w).shape)
    fwd = jax.jit(conv)
    dx = jax.jit(lambda dy, w: jax.vjp(lambda x_: conv(x_, w), x)[1](dy)[0])
    dw = jax.jit(lambda dy, x: jax.vjp(lambda w_: conv(x, w_), w)[1](dy)[0])
    return [
        _median_ms(lambda: fwd(x, w).block_until_ready(), repeats),
        _median_ms(lambda: dx(dy, w).block_until_ready(), repeats) if cin > 3 else float("nan"),
        _median_ms(lambda: dw(dy, x).block_until_ready(), repeats),
    ]


def _time_dw_parts(shape, batch: int, repeats: int) -> list[float]:
    import jax

    h, cin, cout, _ = shape
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (batch, h, h, cin))
    dy = jax.random.normal(keys[1], (batch, h, h, cout))
    # The permutations and dimension labels of XLA's optimised HLO for the stride-1 case.
    copies = jax.jit(lambda x, dy: (x.transpose(3, 1, 2, 0), dy.transpose(1, 2, 0, 3)))
    core = jax.jit(
        lambda xt, dyt: jax.lax.conv_general_dilated(
            xt, dyt, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
    )
    xt, dyt = copies(x, dy)
    return [
        _median_ms(lambda: jax.block_until_ready(copies(x, dy)), repeats),
        _median_ms(lambda: core(xt, dyt).block_until_ready(), repeats),
    ]


def time_dw_parts(batch: int, size: int, repeats: int) -> list[tuple[tuple, list[float]]]:
    sys.path.insert(0, ROOT)
    from jssl import parallel

    parallel.configure_cpu_defaults()
    return [(sh, _time_dw_parts(sh, batch, repeats)) for sh in shapes(size) if sh[3] == 1]


def time_jax(batch: int, size: int, repeats: int) -> dict[str, list[list[float]]]:
    sys.path.insert(0, ROOT)
    from jssl import parallel

    parallel.configure_cpu_defaults()
    import jax

    from jssl.models.cpu_ops import cpu_convolution

    impls = {"jssl": cpu_convolution, "lax": jax.lax.conv_general_dilated}
    return {
        name: [_time_jax_conv(impl, shape, batch, repeats) for shape in shapes(size)]
        for name, impl in impls.items()
    }


def _time_torch_conv(shape, batch: int, repeats: int, channels_last: bool) -> list[float]:
    import torch

    h, cin, cout, s = shape
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(batch, cin, h, h).contiguous(memory_format=fmt)
    w = (0.05 * torch.randn(cout, cin, 3, 3)).contiguous(memory_format=fmt)
    y = torch.nn.functional.conv2d(x, w, stride=s, padding=1)
    dy = torch.randn_like(y).contiguous(memory_format=fmt)

    def fwd():
        with torch.no_grad():
            return torch.nn.functional.conv2d(x, w, stride=s, padding=1)

    def grad(which):
        mask = [which == "dx", which == "dw", False]
        args = (dy, x, w, None, [s, s], [1, 1], [1, 1], False, [0, 0], 1, mask)
        return torch.ops.aten.convolution_backward(*args)

    return [
        _median_ms(fwd, repeats),
        _median_ms(lambda: grad("dx"), repeats) if cin > 3 else float("nan"),
        _median_ms(lambda: grad("dw"), repeats),
    ]


def time_torch(batch: int, size: int, repeats: int, channels_last: bool) -> list[list[float]]:
    return [_time_torch_conv(shape, batch, repeats, channels_last) for shape in shapes(size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--torch_nchw", action="store_true", help="PyTorch in NCHW")
    parser.add_argument("--split_dw", action="store_true", help="time lax's dw in its parts")
    parser.add_argument("--_torch_child", action="store_true", help=argparse.SUPPRESS)
    results.add_flags(parser)
    args = parser.parse_args()
    if args._torch_child:
        print(json.dumps(time_torch(args.batch, args.size, args.repeats, not args.torch_nchw)))
        return
    rows = time_jax(args.batch, args.size, args.repeats)
    if args.torch:
        env = dict(os.environ)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        child = [sys.executable, __file__, "--_torch_child"] + sys.argv[1:]
        out = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
        rows["torch"] = json.loads(out.stdout.strip().splitlines()[-1])
    names = list(rows)
    print(f"batch {args.batch}, ms per call, forward / dx / dw")
    print(f"{'conv':<18}" + "".join(f"{n:>24}" for n in names) + "   time jssl/torch")
    totals = {n: 0.0 for n in names}
    table = []
    for i, (h, cin, cout, s) in enumerate(shapes(args.size)):
        cells = []
        row = {"conv": f"{h} px {cin}->{cout} s{s}"}
        for n in names:
            t = rows[n][i]
            totals[n] += sum(v for v in t if v == v)
            cells.append(" / ".join("-" if v != v else f"{v:.1f}" for v in t))
            row[f"{n} ms fwd / dx / dw"] = cells[-1]
            row[f"{n} ms"] = results.rounded(sum(v for v in t if v == v))
        table.append(row)
        line = f"{h:>3} px {cin:>3}->{cout:<3} s{s}  " + "".join(f"{c:>24}" for c in cells)
        if "torch" in rows:
            jssl, torch = (sum(v for v in rows[n][i] if v == v) for n in ("jssl", "torch"))
            line += f"   {jssl / torch:.2f}"
        print(line)
    print("total ms: " + ", ".join(f"{n} {t:.1f}" for n, t in totals.items()))
    headline = [
        f"jssl / {n}, the convolutions' total ms: {totals['jssl'] / totals[n]:.2f}"
        for n in names
        if n != "jssl"
    ]
    if args.split_dw:
        print("lax's dw of each stride-1 convolution, ms: operand copies + convolution core")
        for (h, cin, cout, _), (copies, core) in time_dw_parts(args.batch, args.size, args.repeats):
            line = f"{h:>3} px {cin:>3}->{cout:<3}     {copies:.1f} + {core:.1f}"
            if "torch" in rows:
                j = shapes(args.size).index((h, cin, cout, 1))
                line += f"   (PyTorch's whole dw {rows['torch'][j][2]:.1f})"
            print(line)
    results.record(
        "conv_layers",
        table,
        args=args,
        measures=results.summary(__doc__),
        headline=headline,
        notes=f"batch {args.batch}, median of {args.repeats} calls; ms per call.",
    )


if __name__ == "__main__":
    main()
