"""Supervised training of the trunk and a linear classifier: the baseline every SSL number is
compared with, and, from pre-trained weights (``init.checkpoint``), VISSL's fine-tuning
benchmarks and MAE's ViT fine-tuning. Follows VISSL's
configs/config/pretrain/supervised/supervised_8gpu_resnet.yaml,
vissl/losses/cross_entropy_multiple_output_single_target.py and
vissl/meters/accuracy_list_meter.py, and MAE's ``main_finetune.py`` with timm's mixup.

Per step: one crop of each image through the trunk and head, and the cross-entropy of the
(optionally smoothed) labels, logits divided by ``method.temperature``; term
``cross_entropy``. Top-1 / top-5 are logged per batch and, in the test phase, counted over the
real rows of the split. ``method.tap_classifiers`` adds a linear classifier per trunk tap, each
its own term; ``mixup_alpha`` / ``cutmix_alpha`` mix pairs of examples (jssl.losses.mixing).
Recipes and deliberate differences: docs/methods.md#supervised (ViT fine-tuning:
docs/methods.md#fine-tuning-a-vit-finetune_vit).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from jssl import losses, models
from jssl.methods import Forward, Method, Objective, common, single_network
from jssl.models.resnet import torch_linear_bias_init, torch_linear_kernel_init

TOP_K = (1, 5)  # VISSL accuracy_list_meter topk_values
CLASSIFIERS = "tap_classifiers"  # their parameters: params["tap_classifiers"]["<tap>"]
HEAD_INPUTS = ("avgpool", "patch_avg")  # the ViT's class token, or its patch tokens' mean
MIX_STREAM = 0x313C  # common.example_keys stream of the mixup / CutMix draws
MIX_TARGETS = "mix_targets"  # Forward.embeddings: (1, n, K) soft targets of the mixed images


def term_name(output: str) -> str:
    """The loss term of an output: ``cross_entropy`` for the model's head (the name it had
    alone), ``cross_entropy_<tap>`` for the classifier on a trunk tap."""
    return "cross_entropy" if output == "head" else f"cross_entropy_{output}"


def terms(config: ml_collections.ConfigDict) -> tuple[common.LossTerm, ...]:
    """One cross-entropy term per output, each its own (weight 1: VISSL sums the outputs)."""
    names = [term_name(o) for o in ("head", *config.method.get("tap_classifiers", ()))]
    return common.as_loss_terms(names)


class TapClassifiers(nn.Module):
    """A linear classifier on each named trunk tap (VISSL's ``mlp`` head with dims [C, K],
    PyTorch's Linear init); a spatial tap (n, H, W, C) is averaged over H and W first."""

    taps: tuple[str, ...]
    num_classes: int

    @nn.compact
    def __call__(self, taps: dict[str, jax.Array]) -> dict[str, jax.Array]:
        logits = {}
        for tap in self.taps:
            x = jnp.asarray(taps[tap], jnp.float32)
            x = jnp.mean(x, axis=(1, 2)) if x.ndim == 4 else x.reshape(x.shape[0], -1)
            logits[tap] = nn.Dense(
                self.num_classes,
                kernel_init=torch_linear_kernel_init,
                bias_init=torch_linear_bias_init(x.shape[-1]),
                name=tap,
            )(x)
        return logits


def mix_settings(method_config: ml_collections.ConfigDict) -> losses.MixSettings:
    """The method's mixup / CutMix fields (off where a workdir's older config lacks them)."""
    return losses.MixSettings(
        mixup_alpha=float(method_config.get("mixup_alpha", 0.0)),
        cutmix_alpha=float(method_config.get("cutmix_alpha", 0.0)),
        mix_prob=float(method_config.get("mix_prob", 1.0)),
        switch_prob=float(method_config.get("switch_prob", 0.5)),
    )


def mix_batch(
    images: jax.Array,
    labels: jax.Array,
    index: jax.Array,
    rng: jax.Array,
    settings: losses.MixSettings,
    num_classes: int,
    label_smoothing: float,
) -> tuple[jax.Array, jax.Array]:
    """``(mixed images, (n, K) soft targets)`` of a training batch: rows (2j, 2j + 1) are
    partners, their draw keyed by the step key ``rng`` and the dataset index of row 2j."""
    pair_keys = common.example_keys(rng, index[0::2], MIX_STREAM)
    mixes = losses.draw_mixes(pair_keys, images.shape[1], images.shape[2], settings)
    targets = losses.mixed_targets(labels, mixes.lam, num_classes, label_smoothing)
    return losses.mix_images(images, mixes), targets


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    mcfg = config.method
    smoothing = float(mcfg.label_smoothing)
    # Fields added with the multi-output loss; a workdir's older config lacks them.
    temperature = float(mcfg.get("temperature", 1.0))
    normalize_output = bool(mcfg.get("normalize_output", False))
    taps = tuple(str(t) for t in mcfg.get("tap_classifiers", ()))
    mixing = mix_settings(mcfg)
    num_classes = int(config.model.head_dims[-1])
    model = single_network.build_model(config)
    head_input = str(mcfg.get("head_input", "avgpool"))
    if head_input != model.head_input:
        model = model.clone(head_input=head_input)
    classifiers = TapClassifiers(taps, num_classes)

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        model_rng, classifier_rng = jax.random.split(rng)
        variables = model.init(model_rng if taps else rng, images, train=False)
        params = variables["params"]
        if taps:
            tapped = model.apply(variables, images, train=False)
            missing = [t for t in taps if t not in tapped or t == "head"]
            if missing:
                raise ValueError(
                    f"method.tap_classifiers names {missing}, which the trunk does not tap; "
                    f"its taps are {sorted(t for t in tapped if t != 'head')}."
                )
            params = {**params, CLASSIFIERS: classifiers.init(classifier_rng, tapped)["params"]}
        return dict(params=params, batch_stats=variables.get("batch_stats", {}))

    def forward(params, state, batch, rng, train: bool = True) -> Forward:
        (images,) = common.views(batch)
        targets = None
        if train and mixing.enabled:
            images, targets = mix_batch(
                images, batch["label"], batch["index"], rng, mixing, num_classes, smoothing
            )
        model_params = {k: v for k, v in params.items() if k != CLASSIFIERS}
        drop_keys = common.view_drop_keys(model, rng, batch, 0, train)
        out, batch_stats = common.apply_model(
            model, model_params, state.batch_stats, images, train, drop_keys
        )
        outputs = {"head": out["head"].astype(jnp.float32)}
        if taps:
            outputs.update(classifiers.apply({"params": params[CLASSIFIERS]}, out))
        if targets is not None:
            outputs[MIX_TARGETS] = jax.lax.stop_gradient(targets)
        return Forward(
            embeddings={name: logits[None] for name, logits in outputs.items()},  # (1, n, K)
            features=out["avgpool"],
            batch_stats=batch_stats,
            head=outputs["head"],
        )

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        outputs = {name: embeddings[name][0] for name in ("head", *taps)}
        labels = batch["label"]
        if train and MIX_TARGETS in embeddings:
            targets = embeddings[MIX_TARGETS][0]
            per_output = {
                name: losses.soft_target_cross_entropy(
                    logits, targets, temperature, normalize_output
                )
                for name, logits in outputs.items()
            }
            labels = losses.dominant_labels(labels, targets)
        else:
            _, per_output = losses.multi_output_cross_entropy(
                outputs, labels, smoothing, temperature, normalize_output
            )
        hits = {}
        for output, logits in outputs.items():
            suffix = "" if output == "head" else f"_{output}"
            for k, hit in losses.top_k_hits(logits, labels, TOP_K).items():
                hits[f"top{k}{suffix}"] = 100.0 * hit
        return Objective(
            terms={term_name(o): ce for o, ce in per_output.items()},
            metrics={name: jnp.mean(h) for name, h in hits.items()},
            per_example_metrics=hits,
        )

    return Method(init=init, forward=forward, objective=objective, model=model)


def check_config(config: ml_collections.ConfigDict) -> None:
    """Start-up checks that would otherwise fail deep inside the step, or silently (a label
    past the classifier's outputs gives a finite but meaningless loss)."""
    crops = tuple(config.data.augment.num_crops)
    if crops != (1,):
        raise ValueError(
            f"data.augment.num_crops={crops}: supervised training takes one crop of each image "
            "(VISSL's RandomResizedCrop + flip); set --config.data.augment.num_crops='(1,)'."
        )
    smoothing = config.method.label_smoothing
    temperature = config.method.get("temperature", 1.0)
    if temperature <= 0:
        raise ValueError(
            f"method.temperature={temperature} must be positive (VISSL's default 1.0: the "
            "logits as they are)."
        )
    taps = tuple(config.method.get("tap_classifiers", ()))
    if len(set(taps)) < len(taps) or "head" in taps or not all(isinstance(t, str) for t in taps):
        raise ValueError(
            f"method.tap_classifiers={taps} must list distinct trunk tap names (not 'head', "
            "the model's own classifier), e.g. --config.method.tap_classifiers=\"('res4',)\"."
        )
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(
            f"method.label_smoothing={smoothing} must lie in [0, 1) (0: plain cross-entropy; "
            "0.1 is the usual value)."
        )
    _check_mixing(config)
    head_input = config.method.get("head_input", "avgpool")
    vit_only = head_input != "avgpool" and not models.is_vit(config.model)
    if head_input not in HEAD_INPUTS or vit_only:
        raise ValueError(
            f"method.head_input={head_input!r}: the classifier reads 'avgpool' (a ResNet's "
            "pooled features, a ViT's class token) or, on a ViT, 'patch_avg' (the mean of its "
            "patch tokens, MAE's global_pool); set --config.method.head_input=avgpool."
        )
    head = tuple(config.model.head_dims)
    if len(head) < 2:
        raise ValueError(
            f"model.head_dims={head}: the supervised classifier is the model's head, (trunk "
            "features, ..., num_classes); set e.g. --config.model.head_dims='(2048, 1000)' "
            "for ResNet-50 on ImageNet (VISSL's mlp head dims [2048, 1000])."
        )
    if config.method.require_init_checkpoint and not config.init.checkpoint:
        raise ValueError(
            "This preset fine-tunes pre-trained weights, but init.checkpoint is empty: set "
            "--config.init.checkpoint=<a jssl workdir or a VISSL .torch file> (e.g. the "
            "workdir of a demo run), or --config.method.require_init_checkpoint=False to train "
            "from scratch on the same labels."
        )
    classes = _num_classes(config.data)
    if classes is not None and classes > head[-1]:
        raise ValueError(
            f"The data has {classes} classes but the classifier (model.head_dims={head}) has "
            f"{head[-1]} outputs: set --config.model.head_dims='{(*head[:-1], classes)}'."
        )


def _check_mixing(config: ml_collections.ConfigDict) -> None:
    """Mixup / CutMix fields in range, and pairs that stay on one device and micro-batch."""
    settings = mix_settings(config.method)
    for name in ("mixup_alpha", "cutmix_alpha"):
        if getattr(settings, name) < 0:
            raise ValueError(
                f"method.{name}={getattr(settings, name)} must be >= 0 (0: off; MAE's "
                "fine-tuning: mixup_alpha 0.8, cutmix_alpha 1.0)."
            )
    for name in ("mix_prob", "switch_prob"):
        if not 0.0 <= getattr(settings, name) <= 1.0:
            raise ValueError(
                f"method.{name}={getattr(settings, name)} is a probability: set it in [0, 1]."
            )
    if not settings.enabled:
        return
    steps = int(config.optim.get("accumulation_steps", 1))
    micro = config.data.batch_size // jax.device_count() // max(steps, 1)
    if micro % 2:
        raise ValueError(
            f"Mixup / CutMix pair adjacent examples, which must share a device and a "
            f"micro-batch, but data.batch_size={config.data.batch_size} over "
            f"{jax.device_count()} devices and optim.accumulation_steps={steps} leaves {micro} "
            "examples (odd): pick a batch size that leaves an even number, or set "
            "--config.method.mixup_alpha=0 --config.method.cutmix_alpha=0."
        )


def _num_classes(data_config: ml_collections.ConfigDict) -> int | None:
    """Classes of the train and test splits' labels (TFDS metadata, an image folder's class
    folders, the demo set's); None when the data does not say."""
    from jssl.data import sources

    found = [
        sources.resolve_split(data_config, split).num_classes
        for split in (data_config.train_split, data_config.test_split)
    ]
    found = [n for n in found if n is not None]
    return max(found) if found else None
