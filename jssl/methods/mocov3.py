"""MoCo v3 (Chen, Xie, He 2021, "An Empirical Study of Training Self-Supervised Vision
Transformers"), following facebookresearch/moco-v3 (moco/builder.py ``MoCo``, ``MoCo_ResNet``,
``MoCo_ViT``; main_moco.py; vits.py). VISSL has no MoCo v3.

The base encoder is trunk + projector + predictor (``params["predictor"]``); the momentum
encoder an EMA of trunk and projector. Each view goes through both encoders one at a time, as
the reference's forward does (train-mode BN per view); the loss is ``ctr(q1, k2) + ctr(q2,
k1)`` (``jssl.losses.mocov3_info_nce``, term ``info_nce``), InfoNCE against the keys of the
global batch scaled by ``2 * T``. The momentum rises on a cosine to 1; ``after_update`` applies
at the end of step k the update the reference makes at the start of step k + 1, so the values
match and the checkpoint of step k holds the momentum encoder step k + 1 uses. On a ViT the
patch projection (``method.freeze_patch_embed``, ``--stop-grad-conv1``) and sin-cos position
embeddings are held fixed by the optimizer, update and weight decay included.
Recipes and deliberate differences: docs/methods.md#moco-v3.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
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

TERMS = ("info_nce",)
# The ViT's patch projection, frozen for the whole run: more steps than any run takes (the
# optimizer's step counter is int32).
PATCH_EMBED = "trunk/patch_embed"
POS_EMBED = "trunk/pos_embed"
WHOLE_RUN = 2**31 - 1


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    mcfg = config.method
    model = models.build_model(
        config.model, bn_axis_name=DATA_AXIS if config.model.sync_bn else None
    )
    # The reference's predictor, ``_build_mlp(2, dim, mlp_dim, dim, last_bn)``: bias-free
    # Dense layers, BN after the hidden one (``predictor_bn``), an affine-free BN on the
    # output when ``method.predictor_last_bn`` (ViT: yes, ResNet: no).
    predictor = build_predictor(config, model, last_bn=mcfg.predictor_last_bn, use_bias=False)
    momentum_at = common.target_momentum(config, steps_per_epoch)  # 0.99 -> 1, main_moco.py

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        return init_online_and_target(model, predictor, rng, images)

    target_model = common.without_drop_path(model)  # the momentum encoder: no stochastic depth

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        online_params = without_predictor(params)
        online_stats = without_predictor(state.batch_stats)
        predictor_stats = {PREDICTOR: state.batch_stats[PREDICTOR]}
        ema_stats = state.ema_batch_stats
        queries, keys, first = [], [], None
        # One view at a time, as the reference's forward.
        for crop, view in enumerate(common.views(batch)):
            drop_keys = common.view_drop_keys(model, rng, batch, crop, train)
            out, online_stats = common.apply_model(
                model, online_params, online_stats, view, train, drop_keys
            )
            q, new_predictor_stats = apply_predictor(
                predictor, params, predictor_stats, out["head"], train
            )
            predictor_stats = {PREDICTOR: new_predictor_stats}
            target, ema_stats = common.apply_model(
                target_model, state.ema_params, ema_stats, view, train
            )
            queries.append(q)
            keys.append(target["head"])
            first = out if first is None else first
        return Forward(
            embeddings={
                "queries": jnp.stack(queries),
                "keys": jax.lax.stop_gradient(jnp.stack(keys)),
            },
            features=first["avgpool"],
            batch_stats={**online_stats, **predictor_stats},
            head=first["head"],
            carry={"ema_batch_stats": common.mean_over_devices(ema_stats)},
        )

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        _, metrics, info_nce = losses.mocov3_info_nce(
            embeddings["queries"], embeddings["keys"], mcfg.temperature, DATA_AXIS
        )
        # The momentum the encoder update after this step uses.
        metrics["encoder_momentum"] = momentum_at(state.step + 1)
        return Objective(terms={"info_nce": info_nce}, metrics=metrics)

    def after_update(state, carry):
        # state.step counts the optimizer steps done, this one included.
        momentum_encoder = common.ema(
            without_predictor(state.params), state.ema_params, momentum_at(state.step)
        )
        return state.replace(
            ema_params=momentum_encoder,
            ema_batch_stats=carry["ema_batch_stats"],
        )

    frozen = ((PATCH_EMBED, WHOLE_RUN),) if mcfg.freeze_patch_embed else ()
    if models.is_vit(config.model) and config.model.get("pos_embed_init") == "sincos":
        # The reference's fixed sin-cos position embeddings (vits.py requires_grad=False).
        frozen += ((POS_EMBED, WHOLE_RUN),)
    return Method(
        init=init,
        forward=forward,
        objective=objective,
        after_update=after_update,
        model=model,
        frozen_params=frozen,
    )


def check_config(config: ml_collections.ConfigDict) -> None:
    """Start-up checks that would otherwise fail deep inside the step (or silently)."""
    from jssl import data

    total = data.total_crops(config.data)
    if total != 2:
        raise ValueError(
            f"data.augment.num_crops={tuple(config.data.augment.num_crops)}: MoCo v3 takes "
            "exactly two crops of each image (each view's query against the other's key); set "
            "--config.data.augment.num_crops='(1, 1)' (two groups of one crop, BYOL's "
            "asymmetric views) or '(2,)'."
        )
    mcfg = config.method
    if mcfg.temperature <= 0:
        raise ValueError(
            f"method.temperature={mcfg.temperature} must be positive (MoCo v3: 0.2 for ViT, "
            "1.0 for ResNet): set --config.method.temperature."
        )
    if not 0.0 <= mcfg.base_momentum <= mcfg.final_momentum <= 1.0:
        raise ValueError(
            f"method.base_momentum={mcfg.base_momentum} and method.final_momentum="
            f"{mcfg.final_momentum} must satisfy 0 <= base <= final <= 1 (MoCo v3: 0.99 -> 1; "
            "final = base for a constant momentum)."
        )
    check_predictor(config, "MoCo v3: (256, 4096, 256)")
    if mcfg.freeze_patch_embed and not str(config.model.trunk).startswith("vit"):
        raise ValueError(
            f"method.freeze_patch_embed=True freezes a ViT's patch projection, but "
            f"model.trunk={config.model.trunk!r} has none; set "
            "--config.method.freeze_patch_embed=False (the ResNet recipe trains every layer), "
            "or use a ViT trunk (--config.model.trunk=vit_small)."
        )
