"""The same global batch gives the same loss and parameters on 1 device, on 4 devices with the
state split over them (parallel.shard_params) and, without batch norm, in exact accumulation's
micro-batches, and on 2 processes x 2 devices (gloo CPU collectives), with cross-replica batch
norm; a split state's checkpoint saved on 8 devices continues on 4 and on 1 as it does on 8."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from support.step_parity import configure

from jssl import methods
from jssl.checkpoints import weights

pytestmark = pytest.mark.e2e  # the end-to-end tier (JSSL_E2E_TESTS=1)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "support", "step_parity.py")


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    env["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    )
    return env


def _run(out, devices, *extra):
    subprocess.run(
        [sys.executable, SCRIPT, str(out), *extra],
        env=_env(devices),
        check=True,
        cwd=ROOT,
        timeout=300,
    )
    return dict(np.load(out))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# Methods whose one-step results must not depend on the device count; each names what a
# sharding bug would break. One subprocess per device count runs them all. SimCLR's, Barlow
# Twins' and VICReg's cross-device terms are compared at the loss level instead
# (test_losses_parallel.py, test_barlow_twins.py, test_vicreg.py, with a control showing the
# comparison can fail), and the step wiring they share (embeddings gathered over the global
# batch: simclr_accum; synchronised BN of two views in an online and a momentum encoder: moco,
# whose ResNet trunks run sync BN here) is covered by the rows below; supervised adds only sync
# BN, and BYOL's step is MoCo v3's wiring (synchronised BN in trunk, projector and predictor of
# the online and EMA networks) without the gathered keys. (A method that forgot to pass the
# mesh axis to its loss would no longer be caught here.) Leaving those five out saves minutes
# of CPU.
PARITY = {
    "moco": "the queue and the momentum encoder's EMA after every step",
    "swav": "Sinkhorn sums over every device and each device's slice of the queue (on from "
    "step 3 here), multi-crop 2x16 + 4x8 px, prototypes frozen for 2 steps",
    "mocov3": "negatives from every device's keys (the keys gathered, the queries' gradients "
    "local), synchronised BN of each view's batch in base and momentum encoders and the "
    "predictor, and the momentum encoder's EMA",
    "simsiam": "synchronised BN of each view's batch and the collapse monitor's statistics over "
    "the global batch",
    "dino": "the centre, a mean over the global batch, and the teacher's SyncBN statistics",
    "dino_vit": "the student's drop-path masks, keyed by the step, the crop and the example "
    "(each device's own key gave other masks on 4 devices than on 1)",
    "moco_larc": "LARC's trust ratios, norms of whole parameters that the split state holds "
    "in parts",
    # Exact accumulation (ACCUMULATE micro-batches per device on 4 devices against one pass
    # on 1): the objective and its gradient over the embeddings of every micro-batch of every
    # device, once per step (jssl/training/accumulation.py), on a BN-free ViT.
    "simclr_accum": "negatives from every micro-batch of every device, and drop-path masks "
    "keyed by example whatever micro-batch it lands in",
    "dino_accum": "the centre and the teacher's targets over every micro-batch of every device",
}
# Slow tier (JSSL_SLOW_TESTS=1), with the CI test that holds what each adds: MoCo v3 (its keys
# gathered without gradient: test_losses_parallel.py; synchronised BN in an online and a
# momentum encoder: the moco row, whose ResNet trunks run sync BN here; the EMA: moco), DINO on
# the ResNet (the centre: dino_vit; the teacher's synchronised BN statistics: moco's momentum
# encoder), SimSiam (synchronised BN of each view: moco; its collapse monitor is a logged
# metric), LARC (its trust ratios over split parameters: the optimizer on split state is
# every row's; LARC's own norms are tests/optim's) and DINO's accumulation on 4 devices (its
# centre over every device: dino_vit; over micro-batches: tests/methods/test_accumulation.py).
SLOW = ("mocov3", "dino", "simsiam", "moco_larc", "dino_accum")
# The 4-device runs split the state (parallel.shard_params, every kernel of the tiny models):
# parameters gathered for the forward pass, gradients reduce-scattered, the optimizer and
# after_update (EMA, queues, SwAV's prototype normalisation) on the split arrays. The
# replicated layout on several devices is the 2-process run's (and every other multi-device
# test's).
SHARDED = ("--shard_params", "1")
ACCUMULATE = ("--accumulation_steps", "2")  # 4 examples per device: 2 micro-batches of 2


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    """Every PARITY method on 1 and on 4 devices (the state split; the *_accum rows in
    micro-batches), the two processes side by side (XLA compiles on one core each, so together
    they take about the time of one)."""
    outs = {n: tmp_path_factory.mktemp(f"devices{n}") / "r.npz" for n in (1, 4)}
    names = [n for n in PARITY if os.environ.get("JSSL_SLOW_TESTS") == "1" or n not in SLOW]
    procs = {
        n: subprocess.Popen(
            [sys.executable, SCRIPT, str(out), "--methods", ",".join(names)]
            + list(SHARDED + ACCUMULATE if n > 1 else ()),
            env=_env(n),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for n, out in outs.items()
    }
    logs = {n: p.communicate(timeout=900)[0].decode() for n, p in procs.items()}
    for n, p in procs.items():
        assert p.returncode == 0, f"step_parity on {n} device(s) failed:\n{logs[n][-5000:]}"
    return {n: dict(np.load(out)) for n, out in outs.items()}


@pytest.fixture(scope="module")
def one_device(parity_runs):
    return parity_runs[1]


@pytest.fixture(scope="module")
def four_devices(parity_runs):
    return parity_runs[4]


def _relative_error(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def _assert_same(a, b, method):
    loss, params = f"{method}:loss", f"{method}:params"
    # Step 1 sees identical parameters: only the reduction order differs.
    np.testing.assert_allclose(a[loss][0], b[loss][0], rtol=1e-5, atol=1e-6)
    # Later steps inherit the parameter differences described below (T=0.1 amplifies them).
    np.testing.assert_allclose(a[loss][1:], b[loss][1:], rtol=5e-4)
    # Parameters are compared as whole vectors: the order of float32 reductions differs
    # between 1 and N devices, and batch norm over 4-example per-device slices of 16 px
    # images amplifies it in a few gradients (seen: relative error 1.6e-4, the same for 4
    # devices and for 2 processes x 2 devices). A wrong gather or mean gives errors ~1.
    assert _relative_error(a[params], b[params]) < 5e-4
    if f"{method}:ema" in a:
        assert _relative_error(a[f"{method}:ema"], b[f"{method}:ema"]) < 5e-5
    if f"{method}:state" in a:  # queues, centres
        np.testing.assert_allclose(a[f"{method}:state"], b[f"{method}:state"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "method", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in PARITY]
)
def test_four_devices_match_one(one_device, four_devices, method):
    assert int(four_devices["devices"]) == 4 and int(one_device["devices"]) == 1
    # The loss moves between steps, so the comparison covers the optimizer and the state.
    assert not np.allclose(one_device[f"{method}:loss"][0], one_device[f"{method}:loss"][1])
    if method.endswith("_accum"):  # micro-batches on 4 devices, one pass on 1
        assert int(four_devices[f"{method}:accumulation_steps"]) == int(ACCUMULATE[1])
        assert int(one_device[f"{method}:accumulation_steps"]) == 1
    _assert_same(one_device, four_devices, method)


# Slow tier: two processes are checked in CI by tests/training/test_multihost_train.py (a whole
# run, preempted and resumed, against one process) and tests/evaluation/test_extract.py.
@pytest.mark.slow
def test_two_processes_match_one(one_device, tmp_path):
    port = _free_port()
    out = tmp_path / "r.npz"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                SCRIPT,
                str(out),
                "--methods",
                "moco,simclr_accum",
                *ACCUMULATE,
                "--process_id",
                str(i),
                "--num_processes",
                "2",
                "--port",
                str(port),
            ],
            env=_env(2),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    two = dict(np.load(out))
    assert int(two["devices"]) == 4
    for method in ("moco", "simclr_accum"):
        _assert_same(one_device, two, method)


# Slow tier: MoCo's per-device batch norm with shuffle-BN runs on 4 devices in CI in
# tests/training/test_verify.py (its per_device_bn case).
@pytest.mark.slow
def test_per_device_bn_with_shuffle_runs_on_four_devices(tmp_path):
    """sync_bn=False uses per-device statistics and MoCo's shuffle-BN across devices."""
    result = _run(tmp_path / "r.npz", 4, "--sync_bn", "0", "--methods", "moco")
    assert np.all(np.isfinite(result["moco:loss"]))


def _steps(out, devices, workdir, *extra) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, SCRIPT, str(out), "--methods", "moco", "--steps", "4", *SHARDED]
        + list(extra),
        env=_env(devices),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _finish(procs, timeout: int = 300) -> None:
    logs = [p.communicate(timeout=timeout)[0].decode() for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-5000:]


def test_split_checkpoint_continues_on_fewer_devices(tmp_path):
    """Saved after step 2 of 4 on 8 devices with the state split 8 ways, restored onto 4
    devices and onto 1 (orbax reads the parts into the new layout) and continued: the same
    losses, parameters, teacher and queue as the 8-device run's own steps 3 and 4."""
    workdir = tmp_path / "run"
    _finish([_steps(tmp_path / "8.npz", 8, workdir, "--save", str(workdir))])
    _finish([_steps(tmp_path / f"{n}.npz", n, workdir, "--resume", str(workdir)) for n in (4, 1)])
    eight = dict(np.load(tmp_path / "8.npz"))
    for n in (4, 1):
        resumed = dict(np.load(tmp_path / f"{n}.npz"))
        np.testing.assert_allclose(resumed["moco:loss"], eight["moco:loss"][2:], rtol=1e-5)
        for key in ("params", "ema"):
            assert _relative_error(eight[f"moco:{key}"], resumed[f"moco:{key}"]) < 1e-6, (n, key)
        np.testing.assert_allclose(resumed["moco:state"], eight["moco:state"], atol=1e-5)
    # The evaluation engines' reader takes the split checkpoint's online model whole.
    loaded = weights.load_variables(str(workdir), configure("moco"))
    np.testing.assert_array_equal(ravel_pytree(loaded["params"])[0], eight["moco:saved_params"])


@pytest.mark.slow
def test_split_state_matches_the_replicated_one_for_every_method(tmp_path):
    """Every method (and the ViT and LARC rows of PARITY) on 8 devices, the state split with
    every trunk block recomputed (each gathering its own split parameters) and replicated
    without remat: the same losses and parameters up to float rounding (the same arithmetic,
    gathered and reduce-scattered instead of all-reduced). The 4-device runs above split the
    state without remat."""
    names = ",".join([*methods.METHODS, "dino_vit", "moco_larc"])
    out = {mode: tmp_path / f"{mode}.npz" for mode in ("replicated", "split")}
    procs = [
        subprocess.Popen(
            [sys.executable, SCRIPT, str(out[mode]), "--methods", names]
            + list(SHARDED + ("--remat", "full") if mode == "split" else ()),
            env=_env(8),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for mode in out
    ]
    _finish(procs, timeout=1800)
    replicated, split = (dict(np.load(path)) for path in out.values())
    for name in names.split(","):
        # atol: SimSiam's loss (a negative cosine) passes near 0 (-0.0084, 3e-7 apart).
        np.testing.assert_allclose(
            split[f"{name}:loss"], replicated[f"{name}:loss"], rtol=1e-5, atol=1e-6
        )
        for key in ("params", "ema", "state"):
            if f"{name}:{key}" in replicated:
                error = _relative_error(replicated[f"{name}:{key}"], split[f"{name}:{key}"])
                assert error < 1e-5, (name, key, error)
