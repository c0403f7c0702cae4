"""BYOL (Grill et al. 2020, "Bootstrap Your Own Latent: A New Approach to Self-Supervised
Learning"), as VISSL trains it (configs/config/pretrain/byol/byol_8node_resnet.yaml,
vissl/losses/byol_loss.py, vissl/hooks/byol_hooks.py).

Per step: the two views of each image (one crop in each of two crop groups, which differ in
blur and solarisation) go through the online network, trunk + projector (``params["trunk"]``,
``params["head"]``) + predictor (``params["predictor"]``, its own subtree as SwAV's
prototypes), and through the target network, trunk + projector with the EMA parameters
``ema_params`` / ``ema_batch_stats`` (no predictor: VISSL builds the target from the first head
only). Each view's prediction regresses onto the other view's target projection,
``2 - 2 cos``, both directions summed (``jssl.losses.byol_loss``, loss term ``regression``);
the target gets no gradient. After the optimizer step the target moves towards the online
trunk and projector, ``xi <- tau xi + (1 - tau) theta``, with ``tau`` cosine from
``base_momentum`` (0.996) to ``final_momentum`` (1) over ``num_epochs * steps_per_epoch``
steps (Sec. 3.2; ``common.cosine_momentum``). The update after k optimizer steps uses
``tau(k)``, the value VISSL's hook uses at iteration k before the forward.

The two views of a size go through the trunk as one batch (VISSL's simclr_collator stacks
them), so train-mode batch norm normalises both views together; the projector and the
predictor see both views at once too. The target runs in train mode (VISSL's target network
is a module in training mode): its batch norm uses batch statistics, and its running
statistics (``ema_batch_stats``, used in evaluation) follow its own forwards, not the EMA.

Deliberate differences from VISSL:
- The default preset is the paper's recipe: base lr 0.2 per 256 and weight decay 1.5e-6 with
  biases and BN parameters excluded from both weight decay and the LARS trust ratio, cosine
  to 0 (VISSL's 300-epoch yaml: 0.3, 1e-6, biases decayed, cosine to 1e-5 of the peak).
- Per-device batch-norm running statistics (``model.sync_bn=False``) of the online and the
  target network are averaged over devices after each step; the recipe uses SyncBN.
- BYOL's reference (JAX) code runs each view through the networks separately, so its BN
  statistics are per view; VISSL's, followed here, are over both views.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jssl import losses, models
from jssl.methods import LossOutput, Method, common
from jssl.parallel import DATA_AXIS

TERMS = ("regression",)
PREDICTOR = "predictor"


def build_predictor(config: ml_collections.ConfigDict, model: Any) -> models.MLPHead:
    """The predictor MLP of ``method.predictor_dims``, BN after its hidden layer(s) when
    ``method.predictor_bn``, in the projector's dtype and batch-norm axis."""
    return models.MLPHead(
        dims=tuple(int(d) for d in config.method.predictor_dims),
        use_bn=config.method.predictor_bn,
        dtype=model.head.dtype,
        bn_axis_name=model.head.bn_axis_name,
    )


def init_with_predictor(
    model: Any, predictor: Any, rng: jax.Array, images: jax.Array
) -> tuple[dict, dict, dict]:
    """``(params, batch_stats, online model variables)``: the model's variables with the
    predictor's under ``"predictor"`` in both collections."""
    model_rng, predictor_rng = jax.random.split(rng)
    variables = model.init(model_rng, images, train=False)
    dim = predictor.dims[0]
    pred = predictor.init(predictor_rng, jnp.zeros((2, dim), jnp.float32), train=False)
    model_stats = variables.get("batch_stats", {})
    params = {**variables["params"], PREDICTOR: pred["params"]}
    batch_stats = {**model_stats, PREDICTOR: pred.get("batch_stats", {})}
    return params, batch_stats, {"params": variables["params"], "batch_stats": model_stats}


def init_online_and_target(model: Any, predictor: Any, rng: jax.Array, images: jax.Array):
    """A predictor method's initial state: the online network with its predictor, and a
    target / momentum encoder that starts as a copy of the online trunk and projector (VISSL
    ``_build_byol_target_network``; MoCo v3 builder.py ``param_m.data.copy_(param_b.data)``);
    the predictor has no counterpart there."""
    params, batch_stats, variables = init_with_predictor(model, predictor, rng, images)
    return dict(
        params=params,
        batch_stats=batch_stats,
        ema_params=jax.tree.map(jnp.copy, variables["params"]),
        ema_batch_stats=jax.tree.map(jnp.copy, variables.get("batch_stats", {})),
    )


def target_momentum(config: ml_collections.ConfigDict, steps_per_epoch: int | None):
    """``momentum_at(steps_done)``: cosine from ``method.base_momentum`` to
    ``method.final_momentum`` over the run (BYOL Sec. 3.2; MoCo v3 ``adjust_moco_momentum``).
    Evaluation engines pass no epoch length; the momentum is then never used."""
    mcfg = config.method
    total_steps = int(config.num_epochs * steps_per_epoch) if steps_per_epoch else 1

    def momentum_at(steps_done: jax.Array) -> jax.Array:
        return common.cosine_momentum(
            steps_done, total_steps, mcfg.base_momentum, mcfg.final_momentum
        )

    return momentum_at


def without_predictor(tree: dict) -> dict:
    return {k: v for k, v in tree.items() if k != PREDICTOR}


def apply_predictor(predictor, params, batch_stats, z: jax.Array, train: bool):
    """``(predictions, new predictor batch_stats)``, as ``common.apply_model`` for the model."""
    if not batch_stats[PREDICTOR]:  # no BN in the predictor (method.predictor_bn False)
        return predictor.apply({"params": params[PREDICTOR]}, z, train=train), {}
    return common.apply_model(predictor, params[PREDICTOR], batch_stats[PREDICTOR], z, train)


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    model = models.build_model(
        config.model, bn_axis_name=DATA_AXIS if config.model.sync_bn else None
    )
    predictor = build_predictor(config, model)
    momentum_at = target_momentum(config, steps_per_epoch)
    weights_at = common.loss_weights(config, TERMS, steps_per_epoch)

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        return init_online_and_target(model, predictor, rng, images)

    def loss(params, state, batch, rng, train: bool = True):
        out, online_stats = common.forward_crops(
            model,
            without_predictor(params),
            without_predictor(state.batch_stats),
            batch["crops"],
            train,
        )
        predictions, predictor_stats = apply_predictor(
            predictor, params, state.batch_stats, out["head"], train
        )
        target, ema_batch_stats = common.forward_crops(
            model, state.ema_params, state.ema_batch_stats, batch["crops"], train
        )
        n = out["head"].shape[0] // 2
        _, metrics, regression = losses.byol_loss(
            common.split_crops(predictions, 2),
            common.split_crops(target["head"], 2),
            DATA_AXIS,
        )
        terms = {"regression": regression}
        value, per_example, term_metrics = common.weighted_loss(terms, weights_at(state.step))
        # The momentum the target update after this step uses.
        metrics["target_momentum"] = momentum_at(state.step + 1)
        return value, LossOutput(
            metrics={**metrics, **term_metrics},
            batch_stats={**online_stats, PREDICTOR: predictor_stats},
            carry={"ema_batch_stats": ema_batch_stats},
            features=out["avgpool"][:n],
            embeddings=out["head"][:n],
            per_example_loss=per_example,
            terms=terms,
        )

    def after_update(state, carry):
        # state.step counts the optimizer steps done, this one included.
        target = common.ema(
            without_predictor(state.params), state.ema_params, momentum_at(state.step)
        )
        return state.replace(
            ema_params=target,
            ema_batch_stats=common.mean_over_devices(carry["ema_batch_stats"]),
        )

    return Method(init=init, loss=loss, after_update=after_update, model=model)


def check_config(config: ml_collections.ConfigDict) -> None:
    """Start-up checks that would otherwise fail deep inside the step (or silently)."""
    from jssl import data

    total = data.total_crops(config.data)
    if total != 2:
        raise ValueError(
            f"data.augment.num_crops={tuple(config.data.augment.num_crops)}: BYOL takes exactly "
            "two crops of each image (each predicts the other's target); set "
            "--config.data.augment.num_crops='(1, 1)' (two groups of one crop, with blur_prob "
            "and solarize_prob per group) or '(2,)'."
        )
    mcfg = config.method
    if not 0.0 <= mcfg.base_momentum <= mcfg.final_momentum <= 1.0:
        raise ValueError(
            f"method.base_momentum={mcfg.base_momentum} and method.final_momentum="
            f"{mcfg.final_momentum} must satisfy 0 <= base <= final <= 1 (BYOL: 0.996 -> 1)."
        )
    check_predictor(config, "BYOL: (256, 4096, 256)")


def check_predictor(config: ml_collections.ConfigDict, example: str) -> None:
    """The predictor maps the projector's output to a vector of the same size."""
    head = tuple(config.model.head_dims)
    if len(head) < 2:
        raise ValueError(
            f"model.head_dims={head}: {config.method.name} needs a projector head, "
            "(trunk features, hidden..., embedding)."
        )
    dims = tuple(config.method.predictor_dims)
    if len(dims) < 2 or dims[0] != head[-1] or dims[-1] != head[-1]:
        raise ValueError(
            f"method.predictor_dims={dims} must start and end with the projector's output "
            f"dim, model.head_dims[-1]={head[-1]} (the prediction regresses onto a projection), "
            f"e.g. --config.method.predictor_dims='({head[-1]}, {4 * head[-1]}, {head[-1]})'; "
            f"{example}."
        )
