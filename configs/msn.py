r"""MSN pre-training of a ViT-S/16 (Assran et al. 2022, "Masked Siamese Networks for
Label-Efficient Learning"), following facebookresearch/msn ``configs/pretrain/msn_vits16.yaml``
with ``src/msn_train.py``, ``src/data_manager.py`` and ``src/losses.py``.

  python launch.py --config=configs/msn.py --workdir=runs/msn \
      --config.data.source=tfds --config.data.name=imagenet2012      # ImageNet, 800 epochs
  python launch.py --config=configs/msn.py:demo --workdir=runs/msn_demo    # CPU, minutes

Presets: "" / "vit_small" (the repository's ViT-S/16 recipe), "demo" (MSN on the 4-block
ViT-Tiny/8 of DINO's ``demo_vit`` on the built-in demo data; prints the kNN accuracy of learned
vs random features), "test" (tiny). The views are crop groups: crop 0 the target, the other
crops of its size random-masked anchors, smaller crops focal anchors (jssl.methods.msn).
"""

import ml_collections

from configs import base, recipes

PRESETS = ("", "vit_small", "demo", "test")


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_method_config("msn", preset, PRESETS)
    m = c.method
    # meta: hidden_dim 2048, output_dim 256, use_bn true (the projection head's two BNs).
    m.hidden_dim = 2048
    m.output_dim = 256
    m.use_bn_in_head = True
    # criterion: num_proto 1024, temperature 0.1, start_sharpen = final_sharpen 0.25,
    # use_sinkhorn true (3 iterations, distributed_sinkhorn), me_max true, memax_weight 1.0,
    # use_ent true with ent_weight 0.0; data.label_smoothing 0.0.
    m.num_prototypes = 1024
    m.temperature = 0.1
    m.sharpen = 0.25
    m.final_sharpen = 0.25
    m.use_sinkhorn = True
    m.sinkhorn_iterations = 3
    m.label_smoothing = 0.0
    # data.patch_drop 0.15: the random-masked anchor keeps floor(196 * 0.85) = 166 patches.
    m.patch_drop = 0.15
    m.focal_block = 0  # 0: focal anchors are the whole 96 px crops (the reference)
    # Target encoder momentum 0.996 -> 1 (linear) and the sharpening schedule, both over 1.25
    # times the run (msn_train.py: ``ipe * num_epochs * 1.25``).
    m.target_momentum = 0.996
    m.final_target_momentum = 1.0
    m.schedule_horizon = 1.25
    # MSN has no KoLeo term; --config.loss.weights.koleo=0.1 adds DINOv2's on the random-masked
    # anchors (jssl.methods.koleo) over groups of koleo_group_size examples (a GPU's batch).
    m.koleo_group_size = 64
    base.loss_terms(c, cross_entropy=1.0, me_max=1.0, entropy=0.0, koleo=None)

    # meta.model_name deit_small, drop_path_rate 0.0, use_fp16 false; SyncBN (world size > 1).
    c.model.trunk = "vit_small"
    c.model.patch_size = 16
    c.model.image_size = 224
    c.model.drop_path_rate = 0.0
    c.model.head_dims = ()
    c.model.sync_bn = True
    c.model.dtype = "float32"

    # criterion.batch_size 64 per GPU x 16 GPUs (README). make_transforms: rand_views 1 + the
    # target at 224 px, scale (0.3, 1); focal_views 10 at 96 px, scale (0.05, 0.3); flip 0.5,
    # colour jitter p 0.8 at strength 0.5 ((0.4, 0.4, 0.4, 0.1)), grayscale 0.2, blur p 0.5
    # (radius 0.1-2.0), no solarisation; ImageNet mean/std.
    recipes.imagenet_pretraining(c, batch_size=1024)
    a = c.data.augment
    a.num_crops = (2, 10)
    a.crop_sizes = (224, 96)
    a.crop_scale = ((0.3, 1.0), (0.05, 0.3))
    recipes.mocov2_augment(c)

    # optimization: AdamW (torch defaults), lr 2e-4 -> 1e-3 over warmup 15 epochs, then cosine
    # to final_lr 1e-6, not scaled by the batch; weight decay cosine 0.04 -> 0.4 on weights
    # only (no biases, BN or 1-D parameters) and none on the prototypes; clip_grad 3.0 (global
    # norm); 800 epochs.
    c.num_epochs = 800
    o = c.optim
    o.name = "adamw"
    o.betas = (0.9, 0.999)
    o.base_lr = 1e-3
    o.base_lr_batch_size = 0  # the reference's lr is absolute
    o.schedule = "cosine"
    o.warmup_epochs = 15
    o.warmup_start_lr = 2e-4
    o.interval_scaling = "rescaled"
    o.final_lr_fraction = 1e-6 / 1e-3
    o.weight_decay = 0.04
    o.weight_decay_schedule = "cosine"
    o.weight_decay_end = 0.4
    o.regularize_bn = False
    o.regularize_bias = False
    o.grad_clip_norm = 3.0
    o.param_groups = (("prototypes", 1.0, 0.0),)  # the prototypes: the schedule, no decay
    c.checkpoint.every_steps = 1251  # every epoch at batch 1024
    c.log_every_steps = 10

    if preset in ("demo", "test"):
        _demo(c)
        if preset == "test":
            _test(c)
    return c


def _demo(c: ml_collections.ConfigDict) -> None:
    """MSN on the demo data at 32 px with the ViT of DINO's ``demo_vit`` (ViT-Tiny cut to 4
    blocks, 8 px patches: a 4x4 grid): target + random-masked anchor at 32 px, 2 focal crops at
    24 px, a smaller head, 32 prototypes (3 per demo class, SwAV's demo ratio), the anchors'
    entropy weighed 0.5 (the recipe's 0 let the predictions go uniform), target momentum 0.99,
    the reference's optimizer at its own rate, and DINOv2's KoLeo term on the random-masked
    anchor (a deliberate difference from MSN); the runs behind each choice: docs/methods.md."""
    recipes.demo_data_and_model(c)
    recipes.demo_vit_trunk(c, pos_embed_init="learned")
    c.model.head_dims = ()
    c.model.sync_bn = True
    c.num_epochs = 4
    a = c.data.augment
    a.num_crops = (2, 2)
    a.crop_sizes = (32, 24)
    # The demo's classes are shapes: a crop must still hold part of the shape.
    a.crop_scale = ((0.3, 1.0), (0.2, 0.6))
    a.blur_prob = (0.0,)  # blur destroys 32 px shapes (as every demo)
    a.solarize_prob = (0.0,)
    m = c.method
    m.hidden_dim = 512
    m.output_dim = 64
    m.num_prototypes = 32
    m.target_momentum = 0.99  # catches up with the online network within the run
    # DINOv2's KoLeo term (not MSN's) over groups of 64: without it the features' rank stays
    # near 7 and kNN learns 2.5-6.1 points over seeds (docs/methods.md).
    m.koleo_group_size = 64
    base.loss_terms(c, cross_entropy=1.0, me_max=1.0, entropy=0.5, koleo=0.1)
    o = c.optim
    o.warmup_epochs = 0.5
    o.warmup_start_lr = 0.0
    o.final_lr_fraction = 0.0
    c.checkpoint.every_steps = 0


def _test(c: ml_collections.ConfigDict) -> None:
    """Seconds-long runs for the test suite: a 2-block ViT-Tiny with 4 px patches on 16 px
    crops (16 patches; the anchor keeps 12) and 8 px focal crops."""
    recipes.tiny_vit(c)
    a = c.data.augment
    a.num_crops = (2, 2)
    a.crop_sizes = (16, 8)
    a.crop_scale = ((0.3, 1.0), (0.2, 0.5))
    m = c.method
    m.hidden_dim = 32
    m.output_dim = 16
    m.num_prototypes = 32
    m.patch_drop = 0.25
    c.loss.weights.koleo = None  # MSN's own terms (the demo's KoLeo: test_koleo_option.py)
