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
(``method.label_smoothing``: targets ``(1 - s) one_hot + s / K``). The loss term is
``cross_entropy``. Top-1 and top-5 accuracy (%) are logged per training batch and, in the test
phase, counted per example over the real rows of the whole test split (``test/top1``,
``test/top5``), as VISSL's meters count the test set. No momentum encoder, no state to update.

Deliberate differences from VISSL:
- No ``ignore_index``: every training row has a label (the data pipeline drops the last
  partial batch; padding rows exist only in evaluation, where the mask removes them).
- Per-device batch-norm running statistics (``model.sync_bn=False``, as VISSL's recipe) are
  averaged over devices after each step; PyTorch DDP broadcasts rank 0's buffers.
- Colour jitter: VISSL's supervised recipe jitters brightness, contrast, saturation and hue
  by 0.4; jssl's jitter ties them as (0.8s, 0.8s, 0.8s, 0.2s), so the recipe's strength 0.5
  gives 0.4 for the first three and hue 0.1.
- One output and one target: VISSL's criterion also sums the losses of several heads
  (``multiple_output``), which no jssl recipe uses.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jssl import losses, models
from jssl.methods import LossOutput, Method, common
from jssl.parallel import DATA_AXIS

TERMS = ("cross_entropy",)
TOP_K = (1, 5)  # VISSL accuracy_list_meter topk_values


def make(config: ml_collections.ConfigDict, steps_per_epoch: int | None = None) -> Method:
    smoothing = float(config.method.label_smoothing)
    model = models.build_model(
        config.model, bn_axis_name=DATA_AXIS if config.model.sync_bn else None
    )
    weights_at = common.loss_weights(config, TERMS, steps_per_epoch)

    def init(rng: jax.Array, images: jax.Array) -> dict[str, Any]:
        variables = model.init(rng, images, train=False)
        return dict(params=variables["params"], batch_stats=variables["batch_stats"])

    def loss(params, state, batch, rng, train: bool = True):
        (images,) = common.views(batch)
        out, batch_stats = common.apply_model(model, params, state.batch_stats, images, train)
        logits = out["head"].astype(jnp.float32)
        labels = batch["label"]
        terms = {"cross_entropy": losses.cross_entropy(logits, labels, smoothing)}
        value, per_example, term_metrics = common.weighted_loss(terms, weights_at(state.step))
        hits = {
            f"top{k}": 100.0 * hit for k, hit in losses.top_k_hits(logits, labels, TOP_K).items()
        }
        return value, LossOutput(
            metrics={**term_metrics, **{name: jnp.mean(h) for name, h in hits.items()}},
            batch_stats=batch_stats,
            features=out["avgpool"],
            embeddings=logits,
            per_example_loss=per_example,
            terms=terms,
            per_example_metrics=hits,
        )

    return Method(init=init, loss=loss, after_update=None, model=model)


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
    """Classes of the train and test splits' labels (TFDS metadata, or an image folder's
    class folders); None when the data does not say."""
    from jssl.data import sources

    found = []
    for split in (data_config.train_split, data_config.test_split):
        source = sources.resolve_split(data_config, split)
        if source.kind == "folder":
            found.append(int(source.labels.max()) + 1)
        elif source.builder is not None:
            label = source.builder.info.features["label"]
            found.append(getattr(label, "num_classes", None))
    found = [n for n in found if n is not None]
    return max(found) if found else None
