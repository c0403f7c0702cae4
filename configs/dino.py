r"""DINO pre-training of a ResNet-50 (Caron et al. 2021), following the DINO repository's
ResNet-50 recipe (README "ResNet-50 and other convnets trainings", main_dino.py defaults:
100 epochs, batch 512 on 8 GPUs, SGD) with VISSL's DINO loss, head and hooks
(vissl/losses/dino_loss.py, vissl/hooks/dino_hooks.py, vissl/models/heads/dino_head.py).

  python launch.py --config=configs/dino.py --workdir=runs/dino \
      --config.data.source=tfds --config.data.name=imagenet2012      # ImageNet, 100 epochs
  python launch.py --config=configs/dino.py:vissl --workdir=runs/dino_vissl \
      --config.data.source=tfds --config.data.name=imagenet2012      # VISSL's ResNet yaml
  python launch.py --config=configs/dino.py:demo --workdir=runs/dino_demo    # CPU, minutes
  python launch.py --config=configs/dino.py:demo_vit --workdir=runs/dino_vit_demo

Presets: "" / "imagenet" (the DINO repository's ResNet-50 recipe), "vissl" (VISSL's
configs/config/pretrain/dino/dino_1node_resnet.yaml: AdamW, cosine weight decay 0.04 -> 0.4,
teacher temperature 0.04 -> 0.07, 300 epochs), "demo" (small ResNet-18 on the built-in demo
data; prints the kNN accuracy of learned vs random features), "demo_vit" (DINO on a 4-block
ViT-Tiny with 8 px patches on the same data, AdamW), "vit_small" (the paper's ViT-S/16
recipe), "vit_large" (ViT-L/16 with the repository's ViT-B/16 recipe, its state split over the
devices and its blocks recomputed in the backward pass), "test" and "test_vit" (tiny).
"""

import ml_collections

from configs import base, recipes

PRESETS = (
    "",
    "imagenet",
    "vissl",
    "vit_small",
    "vit_large",
    "demo",
    "demo_vit",
    "test",
    "test_vit",
)


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_method_config("dino", preset, PRESETS)
    m = c.method
    # DINOHead: out_dim 65536, hidden 2048, bottleneck 256, 3 layers, use_bn_in_head False,
    # norm_last_layer True (main_dino.py defaults, kept by the README's ResNet-50 command).
    m.out_dim = 65536
    m.hidden_dim = 2048
    m.bottleneck_dim = 256
    m.num_layers = 3
    m.use_bn_in_head = False
    m.norm_last_layer = True  # last layer's weight norm fixed to 1 (VISSL normalize_last_layer)
    # DINOLoss: student_temp 0.1, center_momentum 0.9 (VISSL ema_center); teacher temperature
    # warmup_teacher_temp 0.04 -> teacher_temp 0.04 over warmup_teacher_temp_epochs 0.
    m.student_temp = 0.1
    m.teacher_temp = 0.04
    m.warmup_teacher_temp = 0.04
    m.warmup_teacher_temp_epochs = 0.0
    m.center_momentum = 0.9
    m.teacher_momentum = 0.996  # momentum_teacher, raised to 1 on a cosine over the run
    m.freeze_last_layer_epochs = 1.0  # freeze_last_layer 1
    m.teacher_crops = 2  # the two global crops (images[:2]; VISSL crops_for_teacher [0, 1])
    # DINO has no KoLeo term; --config.loss.weights.koleo=0.1 adds DINOv2's (jssl.methods.koleo)
    # over groups of koleo_group_size examples (DINOv2: each GPU's batch).
    m.koleo_group_size = 64
    base.loss_terms(c, cross_entropy=1.0, koleo=None)

    # arch resnet50 (torchvision); both networks converted to SyncBN; use_fp16 True (here:
    # bfloat16 compute, float32 parameters). The DINO head replaces the MLP head.
    c.model.trunk = "resnet50"
    c.model.head_dims = ()
    c.model.sync_bn = True
    c.model.dtype = "bfloat16"

    # batch_size_per_gpu 64 x 8 GPUs. DataAugmentationDINO: global crops at scale (0.14, 1)
    # (README command), local_crops_number 8 at 96 px.
    recipes.imagenet_pretraining(c, batch_size=512)
    recipes.dino_views(c, num_local=8, local_size=96, split=0.14)

    # optimizer sgd, momentum 0.9; lr 0.03 per 256 images (0.06 at 512), linear warmup from 0
    # over warmup_epochs 10, then cosine to min_lr 1e-6; weight_decay 1e-4 = weight_decay_end
    # (constant); biases and norm parameters not decayed (utils.get_params_groups);
    # clip_grad 3.0, each parameter's gradient separately (utils.clip_gradients).
    c.num_epochs = 100
    o = c.optim
    o.name = "sgd"
    o.base_lr = 0.03
    o.base_lr_batch_size = 256
    o.lr_scaling = "linear"
    o.momentum = 0.9
    o.nesterov = False
    o.schedule = "cosine"
    o.warmup_epochs = 10
    o.warmup_start_lr = 0.0
    o.interval_scaling = "rescaled"
    o.final_lr_fraction = 1e-6 / 0.06  # min_lr over the peak at batch 512
    o.weight_decay = 1e-4
    o.weight_decay_schedule = "constant"
    o.weight_decay_end = 1e-4
    o.regularize_bn = False
    o.regularize_bias = False
    o.grad_clip_per_parameter = 3.0
    c.checkpoint.every_steps = 2502  # every epoch (checkpoint.pth), 2502 steps at batch 512
    c.log_every_steps = 10

    if preset == "vissl":
        _vissl_resnet(c)
    elif preset == "vit_small":
        _vit_small(c)
    elif preset == "vit_large":
        _vit_small(c)
        _vit_large(c)
    elif preset == "test_vit":
        _demo(c)
        _vit_small(c)
        recipes.tiny_vit(c)
        # ``recipes.tiny_multicrop``'s sizes at the ViT recipe's scales.
        c.data.augment.num_crops = (1, 1, 2)
        c.data.augment.crop_sizes = (16, 16, 8)
        c.data.augment.solarize_prob = (0.0, 0.2, 0.0)
        c.model.dtype = "float32"
        recipes.tiny_dino_head(c)
    elif preset == "demo_vit":
        _demo(c)
        _demo_vit(c)
    elif preset in ("demo", "test"):
        _demo(c)
        if preset == "demo":
            _demo_local_crops(c)
        if preset == "test":
            recipes.tiny(c)
            recipes.tiny_multicrop(c)
            c.model.head_dims = ()
            recipes.tiny_dino_head(c)
            # No BN in the head: the 1 vs 4 device comparison (tests/step_parity.py) keeps BN
            # to the trunk, as the other methods' (BN over 4-row slices amplifies rounding).
            c.method.use_bn_in_head = False
    return c


def _vit_small(c: ml_collections.ConfigDict) -> None:
    """DINO's ViT-S/16 recipe (main_dino.py defaults with ``--arch vit_small``; the paper's
    Sec. 3 / App. and README): drop path 0.1 on the student only, no BN anywhere (the head's
    use_bn_in_head False), AdamW at 5e-4 x batch / 256 (batch 1024 = 64 x 16 GPUs) with a
    10-epoch linear warmup then cosine to 1e-6, weight decay cosine 0.04 -> 0.4 on weights
    only (not biases or norms), per-parameter gradient clipping 3.0, teacher momentum 0.996
    -> 1, teacher temperature 0.04 -> 0.07 over 30 epochs (the README's best ViT-S run),
    2 x 224 px global crops at scale (0.4, 1) and 10 x 96 px local crops at (0.05, 0.4), 100
    epochs, mixed precision (bf16 here)."""
    c.model.trunk = "vit_small"
    c.model.patch_size = 16
    c.model.image_size = 224
    c.model.drop_path_rate = 0.1
    c.model.head_dims = ()
    c.model.sync_bn = True  # no BN in this network; kept for any the user adds
    m = c.method
    m.use_bn_in_head = False
    m.norm_last_layer = True
    m.warmup_teacher_temp = 0.04
    m.teacher_temp = 0.07
    m.warmup_teacher_temp_epochs = 30.0
    m.teacher_momentum = 0.996
    c.data.batch_size = 1024
    a = c.data.augment
    a.num_crops = (1, 1, 10)
    a.crop_sizes = (224, 224, 96)
    a.crop_scale = ((0.4, 1.0), (0.4, 1.0), (0.05, 0.4))
    c.num_epochs = 100
    peak = 5e-4 * 1024 / 256  # the final rate is min_lr 1e-6
    recipes.dino_vit_adamw(c, base_lr=5e-4, warmup_epochs=10, final_lr_fraction=1e-6 / peak)
    c.checkpoint.every_steps = 1251  # every epoch at batch 1024


def _vit_large(c: ml_collections.ConfigDict) -> None:
    """A ViT-L/16 (304M parameters) trained with the DINO repository's largest published
    recipe, ViT-B/16's (its args.txt: batch 1024, lr 7.5e-4 per 256, min_lr 2e-6, 400 epochs,
    teacher temperature 0.04 -> 0.07 over 50 epochs, gradient clipping 0.3, the last layer
    frozen for 3 epochs, global crops at scale (0.25, 1), 10 local crops at (0.05, 0.25), drop
    path 0.1); DINO published no ViT-L. To fit a large model and its teacher: the parameters,
    the teacher and the optimizer state split over the devices (``parallel.shard_params``,
    FSDP), every block recomputed in the backward pass (``model.remat``), bfloat16 compute.
    With fewer or smaller devices add ``--config.optim.accumulation_steps=k`` (the same
    loss, centre and teacher over the whole batch)."""
    c.model.trunk = "vit_large"
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.parallel.shard_params = True
    m = c.method
    m.warmup_teacher_temp_epochs = 50.0
    m.freeze_last_layer_epochs = 3.0
    a = c.data.augment
    a.crop_scale = ((0.25, 1.0), (0.25, 1.0), (0.05, 0.25))
    c.num_epochs = 400
    o = c.optim
    o.base_lr = 7.5e-4
    o.final_lr_fraction = 2e-6 / (7.5e-4 * 1024 / 256)  # min_lr over the peak at batch 1024
    o.grad_clip_per_parameter = 0.3


def _vissl_resnet(c: ml_collections.ConfigDict) -> None:
    """VISSL's configs/config/pretrain/dino/dino_1node_resnet.yaml. Its iteration counts
    (teacher_temp_warmup_iters 37530, the head frozen for 1251 iterations) are 30 epochs and 1
    epoch at 1251 iterations per epoch, i.e. batch 1024 (the 16-GPU ViT recipe it copies);
    here they are epochs, whatever the batch."""
    m = c.method
    # dino_head num_clusters [65536], normalize_last_layer false; LOSS.dino_loss: momentum
    # 0.996, teacher_temp_min 0.04 -> teacher_temp_max 0.07 over 30 epochs, ema_center 0.9.
    m.norm_last_layer = False
    m.warmup_teacher_temp = 0.04
    m.teacher_temp = 0.07
    m.warmup_teacher_temp_epochs = 30.0
    m.freeze_last_layer_epochs = 1.0  # TEMP_FROZEN_PARAMS_ITER_MAP prototypes0 1251
    # BATCHSIZE_PER_REPLICA 64 x 8 GPUs; ImgPilToMultiCrop size_crops [224, 96], num_crops
    # [2, 8], crop_scales [[0.3, 1], [0.05, 0.3]]; colour distortion strength 0.5; blur prob
    # [1., 0.1, 0.5 ...], solarize prob [0., 0.2, 0 ...].
    c.data.batch_size = 512
    c.data.augment.crop_scale = ((0.3, 1.0), (0.3, 1.0), (0.05, 0.3))
    # OPTIMIZER adamw, num_epochs 300, param_group_constructor dino (no decay on biases and
    # norms: regularize_bn/bias False); lr composite linear 4e-5 -> 1e-3 over lengths[0] =
    # 0.0333 (10 epochs), cosine 1e-3 -> 4e-5 with interval_scaling [rescaled, fixed];
    # weight_decay cosine 0.04 -> 0.4; update_interval epoch; no auto-scaling; no clipping.
    c.num_epochs = 300
    o = c.optim
    o.name = "adamw"
    o.betas = (0.9, 0.999)
    o.base_lr = 1e-3
    o.base_lr_batch_size = 0
    o.schedule = "cosine"
    o.warmup_epochs = 0.0333 * 300
    o.warmup_start_lr = 4e-5
    o.interval_scaling = "fixed"
    o.final_lr_fraction = 0.04
    o.update_interval = "epoch"
    o.weight_decay = 0.04
    o.weight_decay_schedule = "cosine"
    o.weight_decay_end = 0.4
    o.grad_clip_per_parameter = 0.0
    c.checkpoint.every_steps = 5 * 2502  # CHECKPOINT_FREQUENCY 5 epochs


def _demo(c: ml_collections.ConfigDict) -> None:
    """The demo data and network every method's demo uses, with DINO's two global crops at
    32 px (the ResNet demo adds two local crops: ``_demo_local_crops``), a small head with BN,
    a sharp teacher (temperature 0.02) that follows the student within a few hundred steps
    (momentum 0.99 -> 1), and LARS as the other non-contrastive demos (``recipes.demo_lars``,
    solo-learn's CIFAR DINO at twice its rate). Why each choice: docs/methods.md.
    """
    recipes.demo_data_and_model(c)
    c.model.dtype = "float32"
    c.model.head_dims = ()
    c.model.sync_bn = True
    c.num_epochs = 4  # 3 drift back to a uniform teacher
    # The two global crops; ``_demo_local_crops`` adds two 16 px ones to the ResNet demo.
    recipes.dino_demo_crops(c)
    recipes.dino_demo_head(c)  # teacher temperature 0.02: with ImageNet's 0.04 it went uniform
    m = c.method
    # BN in the head keeps the outputs of different images apart at the start; without it the
    # centred teacher was uniform within 60 steps.
    m.use_bn_in_head = True
    m.teacher_momentum = 0.99  # 0.9 collapsed, 0.9995 (solo-learn's 1000 epochs) did not move
    recipes.demo_lars(c, base_lr=0.6, weight_decay=1e-6)
    o = c.optim
    o.warmup_epochs = 0.5
    o.weight_decay_schedule = "constant"
    o.weight_decay_end = 1e-6
    o.grad_clip_per_parameter = 3.0  # DINO's clip_grad 3.0, as the recipes
    c.checkpoint.every_steps = 0


def _demo_local_crops(c: ml_collections.ConfigDict) -> None:
    """The ResNet demo's multi-crop, on top of ``_demo``: two 16 px local crops at scale 0.2-0.5,
    seen by the student only (DINO's 8 local crops of 96 px at 0.05-0.14, at a demo's size).
    With the global crops alone the teacher drifted to near-uniform targets after some 80 steps
    (per-image entropy 4.4 of ln 256 = 5.5), the features' RankMe fell to 8-12 and the demo
    learned 65.1% against 62.9% at random init (seed 0). With the local crops the teacher stays
    sharper (entropy 3.1-4.2 at the end) and the demo learned 12-21 points over random init on
    seeds 0-2 and on 2 devices, in 4 min 46 s on 2 nearly idle cores (a step costs 25% more).
    Figures: docs/methods.md.
    """
    a = c.data.augment
    a.num_crops = (1, 1, 2)
    a.crop_sizes = (32, 32, 16)
    a.crop_scale = ((0.3, 1.0), (0.3, 1.0), (0.2, 0.5))
    a.solarize_prob = (0.0, 0.2, 0.0)


def _demo_vit(c: ml_collections.ConfigDict) -> None:
    """DINO on a small ViT on the demo data, on top of ``_demo`` (data, crops, head sizes,
    BN in the head, teacher temperature 0.02): ViT-Tiny cut to 4 blocks, 8 px patches
    (``recipes.demo_vit_trunk``), learned position embeddings, and DINO's ViT optimizer (AdamW,
    weight decay cosine 0.04 -> 0.4, per-parameter clipping 3.0) at twice its base rate;
    teacher momentum 0.996 -> 1, no local crops, 4 epochs, DINOv2's KoLeo term at 0.1.
    Deliberate differences from DINO's ViT recipe (BN in the head, no local crops, KoLeo) and
    the runs behind them: docs/methods.md.
    """
    c.num_epochs = 4  # 248 steps: as much as 5 epochs learned, under 5 minutes
    # DINOv2's KoLeo term (not DINO's) over groups of 64: without it the class tokens of the
    # demo images stay alike and kNN learns 8.6-12.0 points over seeds (docs/methods.md).
    c.loss.weights.koleo = 0.1
    c.method.koleo_group_size = 64
    # ``_demo``'s two global crops, no local ones.
    c.method.teacher_momentum = 0.996  # DINO's momentum_teacher: a slower drift than 0.99
    recipes.demo_vit_trunk(c, pos_embed_init="learned")
    # Per 256 images: twice main_dino.py's --lr 5e-4, which learned less.
    recipes.dino_vit_adamw(c, base_lr=1e-3, warmup_epochs=0.5, final_lr_fraction=0.0)
