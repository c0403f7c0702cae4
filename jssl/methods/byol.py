"""BYOL (Grill et al. 2020, "Bootstrap Your Own Latent: A New Approach to Self-Supervised
Learning"): the recipe is the paper's and DeepMind's reference; the step follows VISSL's BYOL
pull request (#454: vissl/losses/byol_loss.py, vissl/hooks/byol_hooks.py), which VISSL's main
branch never merged.

Per step: both views go through the online network (trunk + projector + predictor,
``params["predictor"]``) and the target network (trunk + projector with ``ema_params``, in
train mode), each as one batch of both views; each view's prediction regresses onto the other
view's target projection, ``2 - 2 cos`` both ways (``jssl.losses.byol_loss``, term
``regression``). After the optimizer step the target moves towards the online network with
``tau`` cosine from ``base_momentum`` to 1 (``common.cosine_momentum``); the target's running
BN statistics follow its own forwards, not the EMA.

Recipe and deliberate differences: docs/methods.md#byol.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections

from jssl import losses, models
from jssl.methods import Forward, Method, Objective, common
from jssl.methods.predictor import (
    PREDICTOR,
    apply_predictor,
    build_predictor,
    check_predictor,
    init_online_and_target,
    without_predictor,
)
from jssl.parallel import DATA_AXIS

TERMS = ("regression",)


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    model = models.build_model(
        config.model, bn_axis_name=DATA_AXIS if config.model.sync_bn else None
    )
    predictor = build_predictor(config, model)
    momentum_at = common.target_momentum(config, steps_per_epoch)

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        return init_online_and_target(model, predictor, rng, images)

    # The target network runs without stochastic depth, as DINO's teacher.
    target_model = common.without_drop_path(model)

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        out, online_stats = common.forward_crops(
            model,
            without_predictor(params),
            without_predictor(state.batch_stats),
            batch["crops"],
            train,
            rng,
            batch.get("index"),
        )
        predictions, predictor_stats = apply_predictor(
            predictor, params, state.batch_stats, out["head"], train
        )
        target, ema_batch_stats = common.forward_crops(
            target_model, state.ema_params, state.ema_batch_stats, batch["crops"], train
        )
        n = out["head"].shape[0] // 2
        return Forward(
            embeddings={
                "predictions": common.split_crops(predictions, 2),
                "targets": jax.lax.stop_gradient(common.split_crops(target["head"], 2)),
            },
            features=out["avgpool"][:n],
            batch_stats={**online_stats, PREDICTOR: predictor_stats},
            head=out["head"][:n],
            carry={"ema_batch_stats": common.mean_over_devices(ema_batch_stats)},
        )

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        _, metrics, regression = losses.byol_loss(
            embeddings["predictions"], embeddings["targets"], DATA_AXIS
        )
        # The momentum the target update after this step uses.
        metrics["target_momentum"] = momentum_at(state.step + 1)
        return Objective(terms={"regression": regression}, metrics=metrics)

    def after_update(state, carry):
        # state.step counts the optimizer steps done, this one included.
        target = common.ema(
            without_predictor(state.params), state.ema_params, momentum_at(state.step)
        )
        return state.replace(
            ema_params=target,
            ema_batch_stats=carry["ema_batch_stats"],
        )

    return Method(
        init=init, forward=forward, objective=objective, after_update=after_update, model=model
    )


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
