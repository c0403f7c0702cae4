"""MAE (He et al. 2022, "Masked Autoencoders Are Scalable Vision Learners"), following
facebookresearch/mae (``models_mae.py``, ``main_pretrain.py``, ``engine_pretrain.py``,
``util/pos_embed.py``) and solo-learn's ``solo/methods/mae.py`` for running it as one method
among others. VISSL has no MAE.

Per step and crop: ``method.mask_ratio`` of each image's patches are masked at random, keyed
by (seed, step, crop, example index); the ViT encoder (its ``keep=`` option) runs on the
visible patches, ``jssl.models.mae.MAEDecoder`` rebuilds every patch, and the loss
(``jssl.losses.masked_patch_mse``, term ``reconstruction``) is the mean squared error on the
masked patches (per-patch normalised pixels with ``method.norm_pix_loss``). Sin-cos position
embeddings are held fixed. ``make_images`` draws crops, masks and reconstructions for
TensorBoard.

Recipes, evaluation taps and deliberate differences: docs/methods.md#mae.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jssl import losses, models
from jssl.methods import Forward, Method, Objective, common
from jssl.models import mae as mae_lib

TERMS = ("reconstruction",)
POS_EMBED = "trunk/pos_embed"
WHOLE_RUN = 2**31 - 1  # more steps than any run takes (the optimizer's step is int32)
DECODER = "decoder"
IMAGES_SHOWN = 8  # examples in each TensorBoard picture


def build(config: ml_collections.ConfigDict):
    """(model, decoder): the ViT trunk without a head (``Method.model``, what evaluation
    reads) and the MAE decoder for its patch size and dtype."""
    mcfg = config.method
    model = models.build_model(config.model)
    decoder = mae_lib.MAEDecoder(
        embed_dim=int(mcfg.decoder_dim),
        depth=int(mcfg.decoder_depth),
        num_heads=int(mcfg.decoder_heads),
        patch_size=int(config.model.patch_size),
        dtype=jnp.bfloat16 if config.model.dtype == "bfloat16" else jnp.float32,
    )
    return model, decoder


def _masked_pass(model, decoder, params, state, images, index, rng, train, mask_ratio):
    """Masking, encoder and decoder on (C, n, S, S, 3) crops: (taps, predicted patches,
    target patches, masking), rows crop-major (row c * n + i)."""
    crops, n = images.shape[:2]
    flat = images.reshape(crops * n, *images.shape[2:])
    p = decoder.patch_size
    grid = (flat.shape[1] // p, flat.shape[2] // p)
    example = common.example_keys(rng, index, common.MASK_STREAM)
    keys = jnp.concatenate(
        [jax.vmap(lambda k, c=c: jax.random.fold_in(k, c))(example) for c in range(crops)]
    )
    masking = mae_lib.random_masking(keys, grid[0] * grid[1], mask_ratio)
    row_keys = None
    if train and common.uses_drop_path(model):
        row_keys = common.drop_path_keys(rng, index, crops)  # crop-major, as the rows
    trunk_params = {k: v for k, v in params.items() if k != DECODER}
    taps, _ = common.apply_model(
        model, trunk_params, state.batch_stats, flat, train, row_keys, keep=masking.keep
    )
    latent = jnp.concatenate([taps["avgpool"][:, None], taps["patch_tokens"]], axis=1)
    pred = decoder.apply({"params": params[DECODER]}, latent, masking.restore, grid, train)
    return taps, pred, mae_lib.patchify(flat, p), masking


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    mcfg = config.method
    model, decoder = build(config)
    mask_ratio = float(mcfg.mask_ratio)
    norm_pix = bool(mcfg.norm_pix_loss)

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        trunk_rng, decoder_rng = jax.random.split(rng)
        variables = model.init(trunk_rng, images, train=False)
        p = decoder.patch_size
        num_patches = (images.shape[1] // p) * (images.shape[2] // p)
        visible = mae_lib.num_visible(num_patches, mask_ratio)
        width = models.trunk_feature_dim(config.model)
        latent = jnp.zeros((1, 1 + visible, width), jnp.float32)
        restore = jnp.arange(num_patches, dtype=jnp.int32)[None]
        grid = (images.shape[1] // p, images.shape[2] // p)
        decoder_params = decoder.init(decoder_rng, latent, restore, grid, False)["params"]
        return dict(
            params={**variables["params"], DECODER: decoder_params},
            batch_stats=variables.get("batch_stats", {}),
            ema_params={},
            ema_batch_stats={},
            method_state={},
        )

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        views = jnp.stack(common.views(batch))  # (C, n, S, S, 3)
        crops, n = views.shape[:2]
        taps, pred, target, masking = _masked_pass(
            model, decoder, params, state, views, batch["index"], rng, train, mask_ratio
        )
        features = taps["avgpool"][:n]
        if not train:
            # The test phase's features (its kNN queries, features.npy) are the whole crop's,
            # as every other evaluation's: the encoder once more, on every patch.
            trunk_params = {k: v for k, v in params.items() if k != DECODER}
            whole, _ = common.apply_model(model, trunk_params, state.batch_stats, views[0], False)
            features = whole["avgpool"]
        split = lambda x: common.split_crops(x, crops)  # noqa: E731
        return Forward(
            embeddings={
                "pred": split(pred),
                "target": jax.lax.stop_gradient(split(target)),
                "mask": split(masking.mask.astype(jnp.float32)),
            },
            features=jax.lax.stop_gradient(features),
            batch_stats=state.batch_stats,
        )

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        per_crop = losses.masked_patch_mse(
            embeddings["pred"], embeddings["target"], embeddings["mask"], norm_pix
        )  # (C, n)
        return Objective(terms={"reconstruction": jnp.mean(per_crop, axis=0)})

    frozen = ()
    if config.model.get("pos_embed_init") == "sincos":
        frozen = ((POS_EMBED, WHOLE_RUN),)  # MAE: pos_embed requires_grad=False
    return Method(
        init=init, forward=forward, objective=objective, model=model, frozen_params=frozen
    )


def make_images(config: ml_collections.ConfigDict):
    """The train engine's picture hook: ``images(params, state, batch, rng) -> {name: columns}``
    with, for the first examples of ``batch`` (crop 0), the columns crop | masked crop (masked
    patches at the normalisation's mean) | reconstruction | reconstruction with the visible
    patches pasted in (MAE's demo notebook), each (n, S, S, 3) in the crops' normalised space.
    With ``norm_pix_loss`` the predicted patches are shown at the true patches' mean and
    spread (the model predicts neither)."""
    model, decoder = build(config)
    mask_ratio = float(config.method.mask_ratio)
    norm_pix = bool(config.method.norm_pix_loss)
    p = decoder.patch_size
    mean = jnp.asarray(config.data.augment.mean, jnp.float32)
    std = jnp.asarray(config.data.augment.std, jnp.float32)

    def images(params, state, batch, rng) -> dict[str, list[jax.Array]]:
        crop = batch["crops"][0][:IMAGES_SHOWN, 0]
        if crop.dtype == jnp.uint8:  # data.augment.on_device's host crops
            crop = (crop.astype(jnp.float32) / 255.0 - mean) / std
        index = batch["index"][:IMAGES_SHOWN]
        _, pred, target, masking = _masked_pass(
            model, decoder, params, state, crop[None], index, rng, False, mask_ratio
        )
        pred = pred.astype(jnp.float32)
        if norm_pix:
            spread = jnp.sqrt(jnp.var(target, axis=-1, keepdims=True, ddof=1) + 1e-6)
            pred = pred * spread + jnp.mean(target, axis=-1, keepdims=True)
        mask = masking.mask[..., None]
        grid = (crop.shape[1] // p, crop.shape[2] // p)
        picture = lambda patches: mae_lib.unpatchify(patches, p, grid)  # noqa: E731
        return {
            "mae/crop_masked_reconstruction_pasted": [
                crop,
                picture(jnp.where(mask, 0.0, target)),
                picture(pred),
                picture(jnp.where(mask, pred, target)),
            ]
        }

    return images


def check_config(config: ml_collections.ConfigDict) -> None:
    """Start-up checks that would otherwise fail deep inside the step (or silently)."""
    from jssl import data

    mcfg = config.method
    if not models.is_vit(config.model):
        raise ValueError(
            f"model.trunk={config.model.trunk!r}: MAE masks a ViT's patches; use a ViT trunk "
            "(--config.model.trunk=vit_base or vit_large)."
        )
    if tuple(config.model.head_dims):
        raise ValueError(
            f"model.head_dims={tuple(config.model.head_dims)}: MAE trains no head (its decoder "
            "is method.decoder_*); set --config.model.head_dims='()'."
        )
    groups = data.crop_groups(config.data)
    if len({g.size for g in groups}) > 1:
        raise ValueError(
            f"data.augment.crop_sizes={tuple(config.data.augment.crop_sizes)}: MAE's crops "
            "must share one size (MAE: one 224 px crop per image)."
        )
    if not 0.0 < float(mcfg.mask_ratio) < 1.0:
        raise ValueError(f"method.mask_ratio={mcfg.mask_ratio} must lie in (0, 1) (MAE: 0.75).")
    p = int(config.model.patch_size)
    num_patches = (groups[0].size // p) ** 2
    visible = mae_lib.num_visible(num_patches, float(mcfg.mask_ratio))
    if not 0 < visible < num_patches:
        raise ValueError(
            f"method.mask_ratio={mcfg.mask_ratio} leaves {visible} of the {num_patches} "
            f"patches of a {groups[0].size} px crop visible; it must leave at least one and "
            "mask at least one (MAE: 0.75)."
        )
    for field in ("decoder_dim", "decoder_depth", "decoder_heads"):
        if int(mcfg[field]) < 1:
            raise ValueError(f"method.{field}={mcfg[field]} must be a positive integer.")
    if int(mcfg.decoder_dim) % 4 or int(mcfg.decoder_dim) % int(mcfg.decoder_heads):
        raise ValueError(
            f"method.decoder_dim={mcfg.decoder_dim} must be a multiple of 4 (its sin-cos "
            f"position embeddings) and of method.decoder_heads={mcfg.decoder_heads} "
            "(MAE: 512 and 16)."
        )
