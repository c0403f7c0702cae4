"""Every device runs the train step's collectives in one order.

XLA's CPU runtime does not order a collective inside a conditional or a loop against the
collectives beside it (tests/support/hlo_order.py); where no data orders them, two devices can
take them in opposite orders and abort after the rendezvous timeout (seen: DINO's ViT demo on
2 devices, the collapse statistics' all-gather against the gradients' all-reduce, under load).
The test reads the compiled step of the recipes that nest collectives on 2 devices.

Run as a script (``python test_collective_order.py out.npz`` with 2 host devices), it compiles
those steps and saves the unordered pairs each has.
"""

import os
import sys

import numpy as np
import pytest
from support.hlo_order import unordered

pytestmark = pytest.mark.e2e  # the end-to-end tier (JSSL_E2E_TESTS=1)

# A conditional whose branch holds an all-gather, beside an all-reduce that nothing orders
# against it, as XLA prints an optimized module (abridged).
_CONCURRENT = """
HloModule step

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%gathered (p: f32[4]) -> f32[8] {
  %p = f32[4]{0} parameter(0)
  ROOT %all-gather.1 = f32[8]{0} all-gather(%p), channel_id=1, dimensions={0}
}

%skipped (q: f32[4]) -> f32[8] {
  %q = f32[4]{0} parameter(0)
  ROOT %zeros = f32[8]{0} broadcast(%q), dimensions={}
}

ENTRY %main (on: s32[], x: f32[4], g: f32[4]) -> (f32[8], f32[4]) {
  %on = s32[] parameter(0)
  %x = f32[4]{0} parameter(1)
  %g = f32[4]{0} parameter(2)
  %stats = f32[8]{0} conditional(%on, %x, %x), branch_computations={%skipped, %gathered}
  %psum = f32[4]{0} all-reduce(%g), channel_id=1, to_apply=%add
  ROOT %out = (f32[8]{0}, f32[4]{0}) tuple(%stats, %psum)
}
"""


def test_the_checker_finds_a_conditional_collective_beside_an_all_reduce():
    assert unordered(_CONCURRENT) == [("main", "psum", "stats")]
    # Ordered by data (the conditional reads the all-reduce's result): nothing to report.
    ordered = _CONCURRENT.replace("conditional(%on, %x, %x)", "conditional(%on, %psum, %x)")
    ordered = ordered.replace(
        "%stats = f32[8]{0} conditional(%on, %psum, %x), branch_computations={%skipped, "
        "%gathered}\n  %psum = f32[4]{0} all-reduce(%g), channel_id=1, to_apply=%add",
        "%psum = f32[4]{0} all-reduce(%g), channel_id=1, to_apply=%add\n  %stats = f32[8]{0} "
        "conditional(%on, %psum, %x), branch_computations={%skipped, %gathered}",
    )
    assert unordered(ordered) == []
    # Two plain collectives are kept in program order by the runtime itself.
    plain = _CONCURRENT.replace(
        "conditional(%on, %x, %x), branch_computations={%skipped, %gathered}",
        "all-gather(%x), channel_id=1, dimensions={0}",
    )
    assert unordered(plain) == []


# (name, config module, preset, overrides): the recipes whose steps nest collectives: the
# collapse statistics, the online probe, accumulation's loop, a split state's conditional
# update, Sinkhorn's loops (SwAV's per crop, DINOv2's two) and DeepCluster v2's k-means loops.
CASES = (
    ("swav", "swav", "test", {}),
    ("dinov2", "dinov2", "test", {}),
    ("deepclusterv2", "deepclusterv2", "test", {}),
    (
        "moco_accumulation_probe",
        "moco",
        "test",
        {"optim.accumulation_steps": 2, "probe.num_classes": 10},
    ),
    (
        "simclr_split_state_lars",
        "simclr",
        "test",
        {"parallel.shard_params": True, "parallel.shard_min_size": 0},
    ),
    (
        "dino_split_state_accumulation",
        "dino",
        "test_vit",
        {
            "parallel.shard_params": True,
            "parallel.shard_min_size": 0,
            "optim.accumulation_steps": 2,
        },
    ),
)


# Slow tier (JSSL_SLOW_TESTS=1), with the CI case that holds the same nesting: DINOv2's two
# Sinkhorn loops (SwAV's per-crop ones), DINO's accumulation loop over a split state (MoCo's
# accumulation loop; SimCLR's split state's conditional update).
SLOW_CASES = ("dinov2", "dino_split_state_accumulation")


def _cases() -> tuple:
    slow = os.environ.get("JSSL_SLOW_TESTS") == "1"
    return tuple(case for case in CASES if slow or case[0] not in SLOW_CASES)


def test_train_steps_order_their_collectives_on_two_devices(tmp_path):
    from support.devices import run_on_devices

    out = run_on_devices(os.path.abspath(__file__), tmp_path / "order.npz", devices=2, timeout=600)
    assert sorted(out) == sorted(name for name, *_ in _cases())
    for name, *_ in _cases():
        pairs = [str(p) for p in out[name]]
        assert not pairs, f"{name}: collectives with no order between them: {pairs}"


def _two_devices(out_path):
    """The script part: each case's step compiled as the train engine builds it, with the
    collapse statistics at its log steps, and the pairs its HLO leaves unordered."""
    import importlib

    import jax

    from jssl import data, parallel
    from jssl.engines import train
    from jssl.training import collapse
    from jssl.training.step import stop_flags

    assert jax.device_count() == 2, jax.devices()
    mesh = parallel.make_mesh()
    found = {}
    for name, module, preset, overrides in _cases():
        config = importlib.import_module(f"configs.{module}").get_config(preset)
        config.update_from_flattened_dict(overrides)
        method = train.methods.get(config, 4)
        tx, schedule = train.make_optimizer(config, method, 4)
        state = train.abstract_state(config, method, tx, mesh)
        step = train.make_step(config, method, tx, schedule, mesh, state, collapse.log_steps(2, 4))
        host = data.synthetic_batch(config.data, 2)
        sharding = parallel.data_sharding(mesh)
        batch = jax.tree.map(
            lambda x, s=sharding, n=config.data.batch_size: jax.ShapeDtypeStruct(
                (n, *x.shape[1:]), x.dtype, sharding=s
            ),
            host,
        )
        stop = stop_flags(mesh, False)
        text = step.lower(state, batch, stop).compile().as_text()
        found[name] = np.array([" ".join(p) for p in unordered(text)], dtype=str)
    np.savez(out_path, **found)


if __name__ == "__main__":
    _two_devices(sys.argv[1])
