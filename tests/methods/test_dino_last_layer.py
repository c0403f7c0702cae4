"""DINO's head split between forward and objective (jssl.methods.dino): the forward stops at
the normalised bottleneck, the objective applies the last layers, and the step's loss and
gradients are those of the whole head."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from configs import dino
from jssl import data, losses, methods, parallel
from jssl.engines import train
from jssl.methods import common
from jssl.parallel import DATA_AXIS


def test_the_objective_applies_the_last_layer_and_it_learns():
    """The forward stops at the normalised bottleneck and the objective applies the student's
    and the teacher's last layers: the loss and every gradient, the last layer's included, are
    those of the whole head's logits through DINO's loss."""
    config = dino.get_config("test")  # crops (1, 1, 2): the teacher's are groups 0 and 1
    method = methods.get(config, 4)
    mesh = parallel.make_mesh()
    tx, _ = train.make_optimizer(config, method, 4)
    state = train.init_state(config, method, tx, mesh)
    # A teacher that differs from the student, so that mixing them up shows.
    state = state.replace(ema_params=jax.tree.map(lambda x: x * 0.9, state.params))
    batch = parallel.host_batch_to_global(data.synthetic_batch(config.data, 8, seed=0), mesh)

    def per_replica(state, batch):
        rng = jax.random.PRNGKey(0)

        def by_hand(params):
            count = common.num_crops(batch)
            out, _ = common.forward_crops(
                method.model, params, state.batch_stats, batch["crops"], True
            )
            teacher, _ = common.forward_crops(
                method.model, state.ema_params, state.ema_batch_stats, batch["crops"][:2], True
            )
            rows, _ = losses.dino_teacher_crop_losses(
                common.split_crops(out["head"], count),
                jax.lax.stop_gradient(common.split_crops(teacher["head"], 2)),
                state.method_state["center"],
                config.method.student_temp,
                config.method.warmup_teacher_temp,
                axis_name=DATA_AXIS,
            )
            return jax.lax.pmean(jnp.mean(rows), DATA_AXIS)

        def step_loss(params):
            return jax.lax.pmean(methods.loss(method, params, state, batch, rng)[0], DATA_AXIS)

        return jax.value_and_grad(step_loss)(state.params), jax.value_and_grad(by_hand)(
            state.params
        )

    run = jax.shard_map(
        per_replica, mesh=mesh, in_specs=(P(), P(DATA_AXIS)), out_specs=P(), check_vma=False
    )
    (loss, grads), (want_loss, want_grads) = jax.device_get(jax.jit(run)(state, batch))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    last = grads["head"]["last_layer"]["v"]
    assert np.abs(last).max() > 1e-4  # the objective's last layer gets its gradient
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
