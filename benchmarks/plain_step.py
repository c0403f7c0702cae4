"""A minimal JAX MoCo v2 step on jssl's model: the same model, loss and optimizer as jssl's
MoCo step, without jssl's train-step machinery (no mesh or shard_map, no cross-device means,
no non-finite guard, no metrics), one ``jax.jit`` with the state donated.

``train_step.py --compare_torch --with_plain`` times it next to jssl's step and PyTorch's: the
difference between it and jssl's step is what jssl's machinery costs in compile and step time;
the difference between it and PyTorch is XLA's.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jssl import losses, models


def run_case(config: Any, steps: int, seed: int = 0) -> dict[str, Any]:
    """Compiles the step for ``config`` (a MoCo config) and times ``steps`` steps."""
    model = models.build_model(config.model)
    n, size = config.data.batch_size, config.data.image_size
    rng = jax.random.PRNGKey(seed)
    init_rng, queue_rng, data_rng = jax.random.split(rng, 3)
    views = jax.random.normal(data_rng, (2, n, size, size, 3))
    variables = model.init(init_rng, views[0], train=False)
    embedding_dim = config.model.head_dims[-1]
    queue = losses.l2_normalize(
        jax.random.normal(queue_rng, (config.method.queue_size, embedding_dim))
    )
    o = config.optim
    # torch.optim.SGD's weight decay, as jssl.optim's SGD: added to the gradient before momentum.
    tx = optax.chain(
        optax.add_decayed_weights(o.weight_decay),
        optax.sgd(o.base_lr * n / o.base_lr_batch_size, o.momentum, nesterov=o.nesterov),
    )
    params = variables["params"]
    state = dict(
        params=params,
        batch_stats=variables["batch_stats"],
        ema_params=jax.tree.map(jnp.copy, params),
        ema_batch_stats=jax.tree.map(jnp.copy, variables["batch_stats"]),
        opt_state=tx.init(params),
        queue=queue,
        ptr=jnp.zeros((), jnp.int32),
        rng=rng,
    )
    temperature, momentum = config.method.temperature, config.method.momentum

    def loss_fn(params, state, views, rng):
        out, new_stats = model.apply(
            {"params": params, "batch_stats": state["batch_stats"]},
            views[0],
            train=True,
            mutable=["batch_stats"],
        )
        perm = jax.random.permutation(rng, n)  # shuffle-BN on one device
        key_out, key_stats = model.apply(
            {"params": state["ema_params"], "batch_stats": state["ema_batch_stats"]},
            views[1][perm],
            train=True,
            mutable=["batch_stats"],
        )
        keys = key_out["head"][jnp.argsort(perm)].astype(jnp.float32)
        keys = jax.lax.stop_gradient(losses.l2_normalize(keys))
        loss, _, _ = losses.info_nce_with_queue(out["head"], keys, state["queue"], temperature)
        return loss, (new_stats["batch_stats"], key_stats["batch_stats"], keys)

    def step(state, views):
        rng, step_rng = jax.random.split(state["rng"])
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, (stats, key_stats, keys)), grads = grad_fn(state["params"], state, views, step_rng)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        queue = jax.lax.dynamic_update_slice(state["queue"], keys, (state["ptr"], 0))
        new_state = dict(
            params=params,
            batch_stats=stats,
            ema_params=optax.incremental_update(params, state["ema_params"], 1 - momentum),
            ema_batch_stats=key_stats,
            opt_state=opt_state,
            queue=queue,
            ptr=(state["ptr"] + n) % queue.shape[0],
            rng=rng,
        )
        return new_state, loss

    # The views are an argument, as jssl's batch is: closed over, they would be baked into the
    # program as constants, which would make its compile time incomparable with jssl's.
    t0, c0 = time.perf_counter(), time.process_time()
    compiled = jax.jit(step, donate_argnums=0).lower(state, views).compile()
    compile_s, compile_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    state, loss = compiled(state, views)  # warm-up
    jax.block_until_ready((state, loss))
    times, cpu_times = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        state, loss = compiled(state, views)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    return dict(
        step_s=times,
        cpu_s=cpu_times,
        compile_s=compile_s,
        compile_cpu_s=compile_cpu_s,
        loss=float(loss),
    )
