"""Supervised training of the trunk and a linear classifier, the baseline every SSL number is
compared with, and, started from pre-trained weights (``init.checkpoint``), VISSL's full
fine-tuning benchmark (semi-supervised on 1% / 10% of ImageNet's labels).

As VISSL trains it: configs/config/pretrain/supervised/supervised_8gpu_resnet.yaml (and the
1-GPU example), configs/config/benchmark/semi_supervised/imagenet1k/
eval_resnet_8gpu_transfer_in1k_semi_sup_fulltune.yaml, the loss of
vissl/losses/cross_entropy_multiple_output_single_target.py and the ``accuracy_list_meter``
(top-1 and top-5) of vissl/meters/accuracy_list_meter.py.

Per step: one augmented crop of each image through the trunk and the head, whose output is the
class logits (VISSL's head ``["mlp", {"dims": [2048, 1000]}]``: ``model.head_dims=(2048,
1000)``, one linear layer), and the cross-entropy of the labels, optionally label-smoothed
(``method.label_smoothing``: targets ``(1 - s) one_hot + s / K``), with the logits divided by
``method.temperature`` (and L2-normalised first with ``method.normalize_output``), as VISSL's
criterion has them. The loss term is ``cross_entropy``. Top-1 and top-5 accuracy (%) are logged
per training batch and, in the test phase, counted per example over the real rows of the whole
test split (``test/top1``, ``test/top5``), as VISSL's meters count the test set. No momentum
encoder, no state to update.

Several outputs (VISSL's multiple-output loss, a list of heads against the same target):
``method.tap_classifiers`` names trunk taps (``('res4', 'res5')`` on a ResNet, ``('block11',)``
on a ViT), each with its own linear classifier (``params["tap_classifiers"][tap]``; a spatial
tap is averaged over its positions first). Every output is its own term, ``cross_entropy`` for
the head and ``cross_entropy_<tap>`` for the others, and the loss is their sum (VISSL sums, weight
1 each; ``--config.loss.weights.cross_entropy_res4=0.3`` weighs one down, its gradient reaching
the trunk through that tap). Each output reports its own top-1 / top-5 (``top1_<tap>``), in the
test phase too.

Deliberate differences from VISSL:
- No ``ignore_index``: every training row has a label (the data pipeline drops the last
  partial batch; padding rows exist only in evaluation, where the mask removes them).
- Per-device batch-norm running statistics (``model.sync_bn=False``, as VISSL's recipe) are
  averaged over devices after each step; PyTorch DDP broadcasts rank 0's buffers.
- Colour jitter: VISSL's supervised recipe jitters brightness, contrast, saturation and hue
  by 0.4; jssl's jitter ties them as (0.8s, 0.8s, 0.8s, 0.2s), so the recipe's strength 0.5
  gives 0.4 for the first three and hue 0.1.
- Extra outputs are linear classifiers on trunk taps built by the method; VISSL takes whatever
  list of heads ``MODEL.HEAD.PARAMS`` builds (its ``EnsembleOutput`` is not offered).
- A weight field per output exists where the config declared it (``base.loss_terms`` after
  ``method.tap_classifiers``); taps added on the command line weigh 1, as in VISSL.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from jssl import losses, models
from jssl.methods import Forward, Method, Objective, common
from jssl.models.resnet import torch_linear_bias_init, torch_linear_kernel_init
from jssl.parallel import DATA_AXIS

TOP_K = (1, 5)  # VISSL accuracy_list_meter topk_values
CLASSIFIERS = "tap_classifiers"  # their parameters: params["tap_classifiers"]["<tap>"]


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


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    mcfg = config.method
    smoothing = float(mcfg.label_smoothing)
    # Fields added with the multi-output loss; a workdir's older config lacks them.
    temperature = float(mcfg.get("temperature", 1.0))
    normalize_output = bool(mcfg.get("normalize_output", False))
    taps = tuple(str(t) for t in mcfg.get("tap_classifiers", ()))
    model = models.build_model(
        config.model, bn_axis_name=DATA_AXIS if config.model.sync_bn else None
    )
    classifiers = TapClassifiers(taps, int(config.model.head_dims[-1]))

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
        model_params = {k: v for k, v in params.items() if k != CLASSIFIERS}
        drop_keys = common.view_drop_keys(model, rng, batch, 0, train)
        out, batch_stats = common.apply_model(
            model, model_params, state.batch_stats, images, train, drop_keys
        )
        outputs = {"head": out["head"].astype(jnp.float32)}
        if taps:
            outputs.update(classifiers.apply({"params": params[CLASSIFIERS]}, out))
        return Forward(
            embeddings={name: logits[None] for name, logits in outputs.items()},  # (1, n, K)
            features=out["avgpool"],
            batch_stats=batch_stats,
            head=outputs["head"],
        )

    def objective(embeddings, state, batch, train: bool = True) -> Objective:
        outputs = {name: embeddings[name][0] for name in ("head", *taps)}
        labels = batch["label"]
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
