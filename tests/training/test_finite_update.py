"""The step's non-finite guard, as one conditional (``finite_update="cond"``, CPU's default) and
as selects per leaf (``"select"``, accelerators' default: no host read of the flag): the same
update on a finite step, the whole state kept from the first non-finite step on, and with the
state split over 8 devices the selects keep every leaf's sharding.

Run as a script (``python test_finite_update.py out.npz`` with 8 host devices), it trains MoCo
with a split state under the selects and saves what the sharding test checks.
"""

import os
import sys

import jax
import numpy as np
import pytest

from configs import moco
from jssl import data, methods, parallel
from jssl.engines.train import init_state, make_optimizer
from jssl.training.step import make_train_step, stop_flags

GUARDS = ("cond", "select")
DEVICES = 8


def _parts(config, mesh):
    """(method, tx, schedule, initial state) of ``config`` over ``mesh``."""
    method = methods.get(config)
    tx, schedule = make_optimizer(config, method, steps_per_epoch=4)
    return method, tx, schedule, init_state(config, method, tx, mesh)


def _nan_batch(batch: dict) -> dict:
    """``batch`` with one NaN pixel: batch norm spreads it to every gradient."""
    first = batch["crops"][0].copy()
    first[0, 0, 0, 0, 0] = np.nan
    return dict(batch, crops=(first, *batch["crops"][1:]))


def _fresh(host_state):
    """Device arrays of a host copy of the state (the step donates what it is given), laid out
    as the step returns them, so that each step compiles once."""
    return jax.device_put(host_state, parallel.replicated(parallel.make_mesh()))


@pytest.fixture(scope="module")
def setup():
    """MoCo's tiny preset (EMA key encoder, queue, batch norm, online probe) on one device: the
    initial state on the host, a finite and a NaN global batch, a compiled step per guard."""
    config = moco.get_config("test")
    mesh = parallel.make_mesh()
    method, tx, schedule, state = _parts(config, mesh)
    host_batch = data.synthetic_batch(config.data, 16)
    steps = {
        guard: make_train_step(method, tx, schedule, mesh, probe_config=config, finite_update=guard)
        for guard in GUARDS
    }
    batches = {
        "finite": parallel.host_batch_to_global(host_batch, mesh),
        "nan": parallel.host_batch_to_global(_nan_batch(host_batch), mesh),
    }
    return jax.device_get(state), batches, steps


def test_a_finite_step_updates_alike_under_both_guards(setup):
    initial, batches, steps = setup
    after = {}
    for guard in GUARDS:
        state, metrics = steps[guard](_fresh(initial), batches["finite"])
        assert np.isfinite(float(metrics["loss"]))
        after[guard] = jax.device_get(state)
    assert int(after["select"].step) == 1 and int(after["select"].nonfinite_step) == -1
    # The update really ran: the parameters, the EMA teacher and the queue moved.
    for field in ("params", "ema_params", "method_state"):
        changed = jax.tree.map(
            lambda a, b: not np.array_equal(a, b),
            getattr(after["select"], field),
            getattr(initial, field),
        )
        assert any(jax.tree.leaves(changed)), field
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        jax.tree.map(np.asarray, after["select"]),
        jax.tree.map(np.asarray, after["cond"]),
    )


@pytest.mark.parametrize("guard", GUARDS)
def test_a_non_finite_step_and_those_after_it_keep_the_state(setup, guard):
    """From a good step on: a NaN batch keeps params, optimizer, BN, EMA, queue, probe and the
    step count, and records the step; the finite step after it keeps them too."""
    initial, batches, steps = setup
    state, _ = steps[guard](_fresh(initial), batches["finite"])
    good = jax.device_get(state)
    for name in ("nan", "finite"):
        state, metrics = steps[guard](state, batches[name])
        if name == "finite":  # (the NaN batch's loss may be finite: its gradient is not)
            assert np.isfinite(float(metrics["loss"]))
        kept = jax.device_get(state)
        assert int(kept.nonfinite_step) == 1, name
        jax.tree.map(np.testing.assert_array_equal, kept.replace(nonfinite_step=-1), good)


def test_auto_is_the_conditional_on_cpu_and_select_has_none(setup):
    """MoCo's step has no conditional but the guard's: the lowered programs show which ran."""
    initial, batches, steps = setup
    stop = stop_flags(parallel.make_mesh(), False)

    def conditionals(step) -> int:
        lowered = step.lower(_fresh(initial), batches["finite"], stop)
        return lowered.as_text().count("stablehlo.case")

    config = moco.get_config("test")
    mesh = parallel.make_mesh()
    method, tx, schedule, _ = _parts(config, mesh)
    auto = make_train_step(method, tx, schedule, mesh, probe_config=config)
    assert conditionals(auto) == conditionals(steps["cond"]) == 1
    assert conditionals(steps["select"]) == 0


def test_auto_selects_off_cpu_and_an_unknown_guard_is_refused():
    from jssl.training.step import _guard_by_cond

    assert _guard_by_cond("auto", on_cpu=True) and not _guard_by_cond("auto", on_cpu=False)
    assert _guard_by_cond("cond", on_cpu=False) and not _guard_by_cond("select", on_cpu=True)
    config = moco.get_config("test")
    mesh = parallel.make_mesh()
    method, tx, schedule, _ = _parts(config, mesh)
    with pytest.raises(ValueError, match="finite_update='where'"):
        make_train_step(method, tx, schedule, mesh, finite_update="where")


@pytest.mark.e2e
def test_select_keeps_a_split_state_sharded_on_8_devices(tmp_path):
    from support.devices import run_on_devices

    out = run_on_devices(
        os.path.abspath(__file__), tmp_path / "shardings.npz", devices=DEVICES, timeout=600
    )
    assert out["split_leaves"] > 0  # the layout under test really splits some leaves
    names = [str(n) for n in out["changed"]]
    assert not names, f"leaves whose sharding the step changed: {names}"
    assert bool(out["kept_on_nan"]) and int(out["nonfinite_step"]) == 1


def _eight_devices(out_path):
    """The script part: MoCo with its state split over 8 devices (every kernel), one finite
    and one NaN step under the selects; which leaves came back laid out otherwise."""
    from jssl.training.state import specs_of

    assert jax.device_count() == DEVICES, jax.devices()
    config = moco.get_config("test")
    config.parallel.shard_params = True
    config.parallel.shard_min_size = 0
    mesh = parallel.make_mesh()
    method, tx, schedule, state = _parts(config, mesh)
    before = jax.tree_util.tree_flatten_with_path(state)[0]
    shardings = [(jax.tree_util.keystr(path), x.sharding, x.ndim) for path, x in before]
    step = make_train_step(
        method,
        tx,
        schedule,
        mesh,
        probe_config=config,
        state_specs=specs_of(state),
        finite_update="select",
    )
    host_batch = data.synthetic_batch(config.data, 16)
    state, _ = step(state, parallel.host_batch_to_global(host_batch, mesh))
    good = jax.device_get(state)
    state, _ = step(state, parallel.host_batch_to_global(_nan_batch(host_batch), mesh))
    changed = [
        name
        for (name, sharding, ndim), x in zip(shardings, jax.tree.leaves(state), strict=True)
        if not x.sharding.is_equivalent_to(sharding, ndim)
    ]
    kept = jax.device_get(state)
    same = jax.tree.map(np.array_equal, kept.replace(nonfinite_step=-1), good)
    np.savez(
        out_path,
        changed=np.array(changed, dtype=str),
        split_leaves=sum(parallel.sharded_dim(s.spec) is not None for _, s, _ in shardings),
        kept_on_nan=all(jax.tree.leaves(same)),
        nonfinite_step=int(kept.nonfinite_step),
    )


if __name__ == "__main__":
    _eight_devices(sys.argv[1])
