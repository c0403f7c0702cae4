"""MSN (Assran et al. 2022, "Masked Siamese Networks for Label-Efficient Learning"), as
facebookresearch/msn trains it (``src/msn_train.py``, ``src/losses.py``, ``src/deit.py``,
``src/data_manager.py``, ``configs/pretrain/msn_vits16.yaml``).

Crop 0 is the target view, other crops of its size random-masked anchors (only some patches
through the ViT, ``keep=``, drawn per (step, crop, example index)), crops of other sizes focal
anchors. The target encoder, an EMA of the online trunk and head, embeds the target view
without gradient; both sides' projections are compared by cosine to learned prototypes
(``params["prototypes"]``), and ``jssl.losses.msn_terms`` gives ``cross_entropy`` (against
sharpened, Sinkhorn-balanced targets), ``me_max`` and ``entropy``. The target momentum and the
sharpening follow the reference's schedules over ``schedule_horizon`` times the run.

Recipe, demo and deliberate differences: docs/methods.md#msn.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from jssl import losses, models
from jssl.methods import Forward, Method, Objective, common, koleo
from jssl.models.resnet import batch_norm
from jssl.parallel import DATA_AXIS

TERMS = ("cross_entropy", "me_max", "entropy")
PROTOTYPES = "prototypes"  # the top-level parameter (K, d); its optimizer group skips decay


class MSNHead(nn.Module):
    """The reference's projection head (``init_model``'s ``fc``): Linear-BN-GELU-Linear-BN-GELU-
    Linear, in -> hidden -> hidden -> output, kernels N(0, 0.02) and zero biases
    (``trunc_normal_``), PyTorch BatchNorm1d (momentum 0.1, eps 1e-5). Layers ``fc{i}``,
    ``bn{i}``."""

    hidden_dim: int = 2048
    output_dim: int = 256
    use_bn: bool = True
    dtype: Any = jnp.float32
    bn_axis_name: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        norm = batch_norm(
            train=train, momentum=0.9, epsilon=1e-5, axis_name=self.bn_axis_name, dtype=self.dtype
        )
        dense = lambda n, name: nn.Dense(  # noqa: E731
            n,
            kernel_init=nn.initializers.normal(stddev=0.02),
            bias_init=nn.initializers.zeros,
            dtype=self.dtype,
            param_dtype=jnp.float32,
            name=name,
        )
        x = jnp.asarray(x, self.dtype)
        for i in range(2):
            x = dense(self.hidden_dim, f"fc{i}")(x)
            if self.use_bn:
                x = norm(name=f"bn{i}")(x)
            x = nn.gelu(x, approximate=False)
        return dense(self.output_dim, "fc2")(x)


def kept_patches(num_patches: int, patch_drop: float) -> int:
    """How many patches a random-masked view keeps: ``floor(P * (1 - patch_drop))`` (the
    reference's ``T_H``; 166 of 196 at 0.15)."""
    return int(math.floor(num_patches * (1.0 - patch_drop)))


def random_keep(keys: jax.Array, num_patches: int, keep: int) -> jax.Array:
    """(n, keep) int32 patch indices, per row ``keep`` of ``num_patches`` drawn without
    replacement from that row's key, in increasing order."""

    def one(key):
        return jnp.sort(jax.random.permutation(key, num_patches)[:keep])

    return jax.vmap(one)(keys).astype(jnp.int32)


def focal_keep(keys: jax.Array, grid: tuple[int, int], block: int) -> jax.Array:
    """(n, block * block) int32 indices of a row-major (h, w) patch grid: per row a
    ``block x block`` square of neighbouring patches at a position drawn from that row's key
    (focal masking, the paper's Fig. 2, on a view's own grid)."""
    h, w = grid
    if not 0 < block <= min(h, w):
        raise ValueError(f"a focal block of {block} patches does not fit a {h}x{w} patch grid")

    def one(key):
        top_key, left_key = jax.random.split(key)
        top = jax.random.randint(top_key, (), 0, h - block + 1)
        left = jax.random.randint(left_key, (), 0, w - block + 1)
        rows, cols = top + jnp.arange(block), left + jnp.arange(block)
        return (rows[:, None] * w + cols[None, :]).reshape(-1)

    return jax.vmap(one)(keys).astype(jnp.int32)


def linear_schedule(step: jax.Array, total_steps: int, start: float, end: float) -> jax.Array:
    """``start + (end - start) * step / total_steps``, held at ``end`` after (the reference's
    momentum and sharpening generators)."""
    progress = jnp.clip(jnp.asarray(step, jnp.float32) / max(total_steps, 1), 0.0, 1.0)
    return start + (end - start) * progress


def terms(config: ml_collections.ConfigDict) -> tuple[Any, ...]:
    """``TERMS``, and with ``loss.weights.koleo`` set DINOv2's ``koleo_crop<c>`` on each
    random-masked anchor c (jssl.methods.koleo; the online encoder's class token)."""
    if not koleo.enabled(config):
        return TERMS
    anchors = range(1, len(_target_size_crops(config)))
    if not anchors:  # raised here, before the check of loss.weights against the terms
        raise ValueError(
            f"loss.weights.koleo={config.loss.weights.koleo}: KoLeo spreads the class tokens "
            "of the random-masked anchors (the crops of the target's size after crop 0), "
            f"and data.augment.num_crops={tuple(config.data.augment.num_crops)} has none; "
            "use num_crops='(2, 10)' or unset the weight."
        )
    return TERMS + koleo.optional_terms(config, anchors)


def _target_size_crops(config: ml_collections.ConfigDict) -> list[int]:
    """The crops of the target's size (crop 0's): the target, then the random-masked anchors."""
    from jssl import data

    sizes = [g.size for g in data.crop_groups(config.data) for _ in range(g.num_crops)]
    return [i for i, s in enumerate(sizes) if s == sizes[0]]


def _anchor_groups(views: list[jax.Array]) -> list[tuple[int, list[jax.Array]]]:
    """The anchors (crops 1..) as runs of one size: ``[(first crop number, views)]``."""
    groups: list[tuple[int, list[jax.Array]]] = []
    for crop, view in enumerate(views[1:], start=1):
        if groups and groups[-1][1][0].shape[1:] == view.shape[1:]:
            groups[-1][1].append(view)
        else:
            groups.append((crop, [view]))
    return groups


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    mcfg = config.method
    bn_axis = DATA_AXIS if config.model.sync_bn else None
    head = MSNHead(
        hidden_dim=int(mcfg.hidden_dim),
        output_dim=int(mcfg.output_dim),
        use_bn=bool(mcfg.use_bn_in_head),
        dtype=jnp.bfloat16 if config.model.dtype == "bfloat16" else jnp.float32,
        bn_axis_name=bn_axis,
    )
    model = models.build_model(config.model, bn_axis_name=bn_axis).clone(head=head)
    target_model = common.without_drop_path(model)  # the reference's target: drop path 0
    patch = int(config.model.patch_size)
    num_prototypes, output_dim = int(mcfg.num_prototypes), int(mcfg.output_dim)
    focal_block = int(mcfg.focal_block)
    spread = koleo.enabled(config)
    # Without the epoch length (evaluation engines) the schedules read as finished.
    horizon = int(round(mcfg.schedule_horizon * (steps_per_epoch or 0) * config.num_epochs))

    def momentum_at(step):
        return linear_schedule(step, horizon, mcfg.target_momentum, mcfg.final_target_momentum)

    def sharpen_at(step):
        return linear_schedule(step, horizon, mcfg.sharpen, mcfg.final_sharpen)

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        model_rng, proto_rng = jax.random.split(rng)
        variables = model.init(model_rng, images, train=False)
        batch_stats = variables.get("batch_stats", {})
        bound = 1.0 / math.sqrt(output_dim)  # the reference's U(-1/sqrt(d), 1/sqrt(d))
        prototypes = jax.random.uniform(
            proto_rng, (num_prototypes, output_dim), jnp.float32, -bound, bound
        )
        return dict(
            params={**variables["params"], PROTOTYPES: prototypes},
            batch_stats=batch_stats,
            # The target encoder starts as a copy of the online one (trunk and head).
            ema_params=jax.tree.map(jnp.copy, variables["params"]),
            ema_batch_stats=jax.tree.map(jnp.copy, batch_stats),
            method_state={},
        )

    def keep_indices(rng, index, crop: int, size: int, target_size: int):
        """The patches an anchor of ``size`` px keeps (None: all)."""
        side = size // patch
        keys = common.example_keys(jax.random.fold_in(rng, common.MASK_STREAM), index, crop)
        if size == target_size:
            if mcfg.patch_drop <= 0:
                return None
            return random_keep(keys, side * side, kept_patches(side * side, mcfg.patch_drop))
        if 0 < focal_block < side:
            return focal_keep(keys, (side, side), focal_block)
        return None

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        model_params = {k: v for k, v in params.items() if k != PROTOTYPES}
        prototypes = losses.l2_normalize(params[PROTOTYPES].astype(jnp.float32))
        views = common.views(batch)
        target_size, index = views[0].shape[1], batch["index"]
        batch_stats, projections = state.batch_stats, []
        for first, group in _anchor_groups(views):
            keep = [
                keep_indices(rng, index, first + j, v.shape[1], target_size)
                for j, v in enumerate(group)
            ]
            kwargs = {} if keep[0] is None else {"keep": jnp.concatenate(keep)}
            row_keys = None
            if train and common.uses_drop_path(model):
                row_keys = common.drop_path_keys(rng, index, len(group), first)
            out, batch_stats = common.apply_model(
                model,
                model_params,
                batch_stats,
                jnp.concatenate(group),
                train,
                row_keys,
                **kwargs,
            )
            projections.append(out["head"].astype(jnp.float32))
            if spread and first == 1 and group[0].shape[1] == target_size:
                # KoLeo's input: the random-masked anchors' class tokens, (k, n, D).
                tokens = common.split_crops(out["avgpool"].astype(jnp.float32), len(group))
        z = losses.l2_normalize(jnp.concatenate(projections))  # (V * n, d), crop-major
        anchor = common.split_crops(z @ prototypes.T, len(views) - 1)  # (V, n, K)
        target_out, ema_batch_stats = common.apply_model(
            target_model, state.ema_params, state.ema_batch_stats, views[0], train
        )
        h = jax.lax.stop_gradient(target_out["head"].astype(jnp.float32))
        target = losses.l2_normalize(h) @ jax.lax.stop_gradient(prototypes).T  # (n, K)
        embeddings = {"anchor": anchor, "target": target[None]}
        if spread:
            embeddings["tokens"] = tokens
        return Forward(
            embeddings=embeddings,
            features=jax.lax.stop_gradient(target_out["avgpool"]),
            batch_stats=batch_stats,
            head=h,
            carry={"ema_batch_stats": common.mean_over_devices(ema_batch_stats)},
        )

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        sharpen = sharpen_at(state.step)
        terms, metrics = losses.msn_terms(
            embeddings["anchor"],
            embeddings["target"][0],
            temperature=mcfg.temperature,
            sharpen=sharpen,
            label_smoothing=mcfg.label_smoothing,
            use_sinkhorn=mcfg.use_sinkhorn,
            sinkhorn_iterations=int(mcfg.sinkhorn_iterations),
            axis_name=DATA_AXIS,
        )
        if spread:  # its gathers after the Sinkhorn loop's (parallel.after)
            spreads = koleo.crop_losses(
                embeddings["tokens"], int(mcfg.koleo_group_size), *terms.values()
            )
            terms = dict(terms, **{f"koleo_crop{c + 1}": v for c, v in enumerate(spreads)})
        metrics = dict(metrics, sharpen=sharpen, target_momentum=momentum_at(state.step))
        return Objective(terms=terms, metrics=metrics)

    def after_update(state, carry):
        # state.step counts this update already; the reference's EMA after iteration k uses
        # the k-th value of its momentum schedule.
        online = {k: v for k, v in state.params.items() if k != PROTOTYPES}
        return state.replace(
            ema_params=common.ema(online, state.ema_params, momentum_at(state.step - 1)),
            ema_batch_stats=carry["ema_batch_stats"],
        )

    return Method(
        init=init, forward=forward, objective=objective, after_update=after_update, model=model
    )


def check_config(config: ml_collections.ConfigDict) -> None:
    """Start-up checks that would otherwise fail deep inside the step (or silently)."""
    from jssl import data

    mcfg = config.method
    if not models.is_vit(config.model):
        raise ValueError(
            f"model.trunk={config.model.trunk!r}: MSN drops patches of its anchor views, which "
            "needs a ViT trunk (e.g. --config.model.trunk=vit_small)."
        )
    if tuple(config.model.head_dims):
        raise ValueError(
            f"model.head_dims={tuple(config.model.head_dims)}: MSN puts its own head on the "
            "trunk (method.hidden_dim, method.output_dim); set --config.model.head_dims='()'."
        )
    groups = data.crop_groups(config.data)
    sizes = [g.size for g in groups for _ in range(g.num_crops)]
    if len(sizes) < 2:
        raise ValueError(
            f"data.augment.num_crops={tuple(config.data.augment.num_crops)}: MSN needs a target "
            "view (crop 0) and at least one anchor view, e.g. num_crops='(2, 10)' with "
            "crop_sizes='(224, 96)'."
        )
    same = [i for i, s in enumerate(sizes) if s == sizes[0]]
    if same != list(range(len(same))):
        raise ValueError(
            f"data.augment.crop_sizes={tuple(config.data.augment.crop_sizes)}: the crops of the "
            "target's size (crop 0's) must come first, the focal crops after them, e.g. "
            "num_crops='(2, 10)', crop_sizes='(224, 96)'."
        )
    if koleo.enabled(config):
        koleo.check_group_size(config)
    side = sizes[0] // int(config.model.patch_size)
    if not 0.0 <= mcfg.patch_drop < 1.0 or kept_patches(side * side, mcfg.patch_drop) < 1:
        raise ValueError(
            f"method.patch_drop={mcfg.patch_drop} must lie in [0, 1) and keep at least one of "
            f"the {side * side} patches of a {sizes[0]} px view (MSN ViT-S/16: 0.15)."
        )
    focal_sides = {s // int(config.model.patch_size) for s in sizes[len(same) :]}
    if int(mcfg.focal_block) < 0 or any(int(mcfg.focal_block) > s for s in focal_sides):
        raise ValueError(
            f"method.focal_block={mcfg.focal_block} must be >= 0 (0: whole focal crops) and fit "
            f"the focal crops' patch grids ({sorted(focal_sides)} patches a side)."
        )
    for field in ("temperature", "sharpen", "final_sharpen"):
        if mcfg[field] <= 0:
            raise ValueError(
                f"method.{field}={mcfg[field]} must be positive (MSN: temperature 0.1, "
                "sharpen 0.25)."
            )
    if not 0.0 <= mcfg.label_smoothing < 1.0:
        raise ValueError(f"method.label_smoothing={mcfg.label_smoothing} must lie in [0, 1).")
    for field in ("target_momentum", "final_target_momentum"):
        if not 0.0 <= mcfg[field] <= 1.0:
            raise ValueError(f"method.{field}={mcfg[field]} must lie in [0, 1].")
    if mcfg.schedule_horizon <= 0:
        raise ValueError(
            f"method.schedule_horizon={mcfg.schedule_horizon} must be positive (the reference: "
            "1.25 times the run)."
        )
    for field in ("num_prototypes", "output_dim", "hidden_dim", "sinkhorn_iterations"):
        if int(mcfg[field]) < 1:
            raise ValueError(f"method.{field}={mcfg[field]} must be a positive integer.")
