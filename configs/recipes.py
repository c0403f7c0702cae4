"""Recipes that several configs share: ImageNet from TFDS and the ImageNet pre-training frame,
the views of MoCo v2, BYOL and DINO and crop-and-flip ones, BYOL's LARS, VISSL's LARC, DINO's
ViT AdamW, the demo data, model, crops, heads and optimizers, the demo ViT trunk and the tiny
settings of the test presets. Each sets fields of a config made by ``base.get_base_config``."""

import ml_collections


def imagenet_data(c: ml_collections.ConfigDict) -> None:
    """ImageNet-1k from TFDS (``tfds build imagenet2012``): train, and the validation split as
    the test split."""
    c.data.source = "tfds"
    c.data.name = "imagenet2012"
    c.data.train_split = "train"
    c.data.test_split = "validation"


def imagenet_pretraining(
    c: ml_collections.ConfigDict, batch_size: int, image_size: int = 224
) -> None:
    """What every ImageNet pre-training recipe starts from: ``imagenet_data`` at ``batch_size``
    (global) and ``image_size`` px, and the online linear probe on ImageNet's 1000 labels
    (BYOL App. C: stop-gradient trunk features; monitoring only)."""
    imagenet_data(c)
    c.data.batch_size = batch_size
    c.data.image_size = image_size
    c.probe.num_classes = 1000


def mocov2_augment(c: ml_collections.ConfigDict) -> None:
    """MoCo v2's augmentation (Chen et al. 2020, "Improved Baselines with Momentum Contrastive
    Learning": aug+, SimCLR's at colour strength 0.5), which SimSiam and MSN reuse: flip 0.5,
    colour jitter (0.4, 0.4, 0.4, 0.1) p 0.8, grayscale p 0.2, Gaussian blur p 0.5 (sigma
    0.1-2.0), no solarisation, the same for every crop; the crops are each recipe's."""
    a = c.data.augment
    a.flip_prob = (0.5,)
    a.color_jitter_prob = (0.8,)
    a.color_strength = 0.5
    a.grayscale_prob = (0.2,)
    a.blur_prob = (0.5,)
    a.blur_sigma = (0.1, 2.0)
    a.solarize_prob = (0.0,)


def crop_and_flip(c: ml_collections.ConfigDict) -> None:
    """RandomResizedCrop and a horizontal flip (p 0.5) alone, no colour jitter, grayscale, blur
    or solarisation: MAE's pre-training views (main_pretrain.py ``transform_train``) and the
    fine-tuning recipes' (VISSL's, MAE's main_finetune.py before its RandAugment)."""
    a = c.data.augment
    a.flip_prob = (0.5,)
    a.color_jitter_prob = (0.0,)
    a.grayscale_prob = (0.0,)
    a.blur_prob = (0.0,)
    a.solarize_prob = (0.0,)


def byol_views(c: ml_collections.ConfigDict) -> None:
    """BYOL's asymmetric pair of views (Grill et al. 2020, App. B, Table 6), which Barlow Twins
    and VICReg reuse: RandomResizedCrop scale 0.08-1, flip 0.5, colour jitter p 0.8 at
    strength 0.5 (brightness/contrast/saturation 0.4, hue 0.1), grayscale p 0.2, Gaussian blur
    p 1.0 / 0.1 (sigma 0.1-2.0) and solarisation p 0.0 / 0.2 per view: two crop groups of one
    crop each, so each view has its own probabilities."""
    a = c.data.augment
    a.num_crops = (1, 1)
    a.crop_scale = (0.08, 1.0)
    a.flip_prob = (0.5,)
    a.color_jitter_prob = (0.8,)
    a.color_strength = 0.5
    a.grayscale_prob = (0.2,)
    a.blur_prob = (1.0, 0.1)
    a.blur_sigma = (0.1, 2.0)
    a.solarize_prob = (0.0, 0.2)


def dino_views(c: ml_collections.ConfigDict, num_local: int, local_size: int, split: float) -> None:
    """DINO's multi-crop (Caron et al. 2021, main_dino.py's DataAugmentationDINO), which iBOT and
    DINOv2 reuse with their own numbers: two global crops at 224 px of scale (split, 1) and
    ``num_local`` local crops at ``local_size`` px of scale (0.05, split); flip 0.5; colour
    jitter p 0.8 (0.4, 0.4, 0.2, 0.1) at strength 0.5, whose saturation is 0.4 (jssl's jitter
    has one strength); grayscale 0.2; blur (sigma 0.1-2.0) p 1.0 on the first global crop, 0.1
    on the second, 0.5 on the local ones; solarisation p 0.2 on the second global crop."""
    a = c.data.augment
    a.num_crops = (1, 1, num_local)
    a.crop_sizes = (224, 224, local_size)
    a.crop_scale = ((split, 1.0), (split, 1.0), (0.05, split))
    a.flip_prob = (0.5,)
    a.color_jitter_prob = (0.8,)
    a.color_strength = 0.5
    a.grayscale_prob = (0.2,)
    a.blur_prob = (1.0, 0.1, 0.5)
    a.blur_sigma = (0.1, 2.0)
    a.solarize_prob = (0.0, 0.2, 0.0)


def demo_two_views(c: ml_collections.ConfigDict) -> None:
    """``byol_views`` at the demo's 32 px: no blur (see ``demo_data_and_model``)."""
    a = c.data.augment
    a.num_crops = (1, 1)
    a.blur_prob = (0.0,)
    a.solarize_prob = (0.0, 0.2)


def dino_demo_crops(c: ml_collections.ConfigDict) -> None:
    """DINO's two global crops at the demo's 32 px (configs/dino.py's demo; the iBOT and DINOv2
    demos reuse them): scale 0.3-1, since the demo's classes are shapes and a small crop must
    still hold part of the shape; no blur (it destroys 32 px shapes, as in every demo);
    solarisation p 0.2 on the second crop."""
    a = c.data.augment
    a.num_crops = (1, 1)
    a.crop_sizes = (32, 32)
    a.crop_scale = ((0.3, 1.0), (0.3, 1.0))
    a.blur_prob = (0.0,)
    a.solarize_prob = (0.0, 0.2)


def dino_demo_head(c: ml_collections.ConfigDict) -> None:
    """The DINO demo's head and teacher (configs/dino.py's demo; the iBOT and DINOv2 demos reuse
    them): 256 prototypes, hidden 256, bottleneck 64; a sharp teacher, temperature 0.02 from
    the start (with ImageNet's 0.04 the teacher went uniform); the last layer frozen for half
    an epoch."""
    m = c.method
    m.out_dim = 256
    m.hidden_dim = 256
    m.bottleneck_dim = 64
    m.warmup_teacher_temp = 0.02
    m.teacher_temp = 0.02
    m.warmup_teacher_temp_epochs = 0.0
    m.freeze_last_layer_epochs = 0.5


def tiny_dino_head(c: ml_collections.ConfigDict) -> None:
    """The test presets' DINO head (DINO, iBOT, DINOv2): 32 prototypes, hidden 32, bottleneck
    16, the teacher temperature warming up from 0.04 to 0.07 over the first epoch and the last
    layer frozen for half of it, so both schedules move within a test's steps."""
    m = c.method
    m.out_dim = 32
    m.hidden_dim = 32
    m.bottleneck_dim = 16
    m.warmup_teacher_temp = 0.04
    m.teacher_temp = 0.07
    m.warmup_teacher_temp_epochs = 1.0
    m.freeze_last_layer_epochs = 0.5


def demo_lars(c: ml_collections.ConfigDict, base_lr: float, weight_decay: float) -> None:
    """``lars`` as solo-learn trains the non-contrastive methods on CIFAR at 32 px
    (vturrisi/solo-learn scripts/pretrain/cifar/{vicreg,barlow,byol,dino}.yaml): trust
    coefficient eta 0.02, not the ImageNet recipes' 0.001, biases and norms neither decayed nor
    adapted, ``base_lr`` per 256 images, one warmup epoch then cosine to 0. Plain SGD at a
    demo's learning rate left VICReg and Barlow Twins below random-init features in 186 steps;
    this learns
    (see their demo presets). Deliberate difference: solo-learn also clips each layer's rate
    at the global one (``clip_lr``); optax's LARS does not."""
    lars(c, base_lr=base_lr, weight_decay=weight_decay, warmup_epochs=1, eta=0.02)


def lars(
    c: ml_collections.ConfigDict,
    base_lr: float,
    weight_decay: float,
    warmup_epochs: float,
    final_lr_fraction: float = 0.0,
    eta: float = 0.001,
) -> None:
    """LARS as BYOL trains with it (Grill et al. 2020, Sec. 3.3), which VICReg, MoCo v3's
    ResNet-50 and solo-learn's CIFAR recipes reuse: trust coefficient ``eta``, momentum 0.9
    without Nesterov, biases and norms neither decayed nor adapted (exclude_bias_and_norm),
    ``base_lr`` per 256 images (linear scaling), a linear warmup from 0 over ``warmup_epochs``,
    then cosine to ``final_lr_fraction`` of the peak, per step."""
    o = c.optim
    o.name = "lars"
    o.lars_eta = eta
    o.trust_ratio_exclude = "bias_and_norm"
    o.regularize_bn = False
    o.regularize_bias = False
    o.base_lr = base_lr
    o.base_lr_batch_size = 256
    o.lr_scaling = "linear"
    o.weight_decay = weight_decay
    o.momentum = 0.9
    o.nesterov = False
    o.schedule = "cosine"
    o.warmup_epochs = warmup_epochs
    o.warmup_start_lr = 0.0
    o.warmup_start_nodes = 0
    o.interval_scaling = "rescaled"
    o.final_lr_fraction = final_lr_fraction
    o.update_interval = "step"


def vissl_8node_larc(c: ml_collections.ConfigDict, warmup_epochs: float, final_fraction: float):
    """The optimizer VISSL's 8-node SimCLR and SwAV recipes share (simclr_8node_resnet.yaml,
    swav_8node_resnet.yaml): ``vissl_larc`` with weight_decay 1e-6, regularize_bn/bias True and
    auto_lr_scaling base_value 0.3 per 256 (4.8 at 4096), which rewrites the warmup start to the
    base rate at one node's batch (0.6 at 512). Warmup length and the cosine's end differ per
    recipe."""
    vissl_larc(
        c,
        base_lr=0.3,
        weight_decay=1e-6,
        warmup_epochs=warmup_epochs,
        final_fraction=final_fraction,
        nodes=8,
        regularize_bn_and_bias=True,
    )


def vissl_larc(
    c: ml_collections.ConfigDict,
    base_lr: float,
    weight_decay: float,
    warmup_epochs: float,
    final_fraction: float,
    nodes: int,
    regularize_bn_and_bias: bool,
) -> None:
    """VISSL's LARC pre-training optimizer (its SimCLR, SwAV and Barlow Twins yamls): sgd +
    use_larc (clip False, trust_coefficient 0.001, eps 1e-8; apex LARC adapts every
    parameter), momentum 0.9, nesterov False; lr composite of a linear warmup then cosine with
    interval_scaling [rescaled, fixed], auto_lr_scaling ``base_lr`` per 256, the warmup starting
    at the base rate scaled to one of ``nodes`` nodes' batch (VISSL's resolve_linear_schedule),
    the cosine ending at ``final_fraction`` of the peak; update_interval step."""
    o = c.optim
    o.name = "larc"
    o.larc_clip = False
    o.lars_eta = 0.001
    o.larc_eps = 1e-8
    o.trust_ratio_exclude = "none"
    o.weight_decay = weight_decay
    o.momentum = 0.9
    o.nesterov = False
    o.regularize_bn = regularize_bn_and_bias
    o.regularize_bias = regularize_bn_and_bias
    o.base_lr = base_lr
    o.base_lr_batch_size = 256
    o.lr_scaling = "linear"
    o.schedule = "cosine"
    o.warmup_epochs = warmup_epochs
    o.warmup_start_nodes = nodes
    o.interval_scaling = "fixed"
    o.final_lr_fraction = final_fraction
    o.update_interval = "step"


def demo_sgd(c: ml_collections.ConfigDict, base_lr: float, warmup_epochs: float) -> None:
    """Plain SGD in place of ``vissl_8node_larc`` in the SimCLR, SwAV and DeepCluster-v2 demos:
    LARC's step is lr x trust_coefficient x |w| per layer, made for lr 4.8 at batch 4096; at a
    demo's rate it barely moves (SimCLR's demo: kNN below random init after 6 epochs).
    ``base_lr`` per 256 images, a linear warmup from 0, cosine to 0, weight decay 5e-4 (a few
    hundred steps on 8000 images: the MoCo demo's value)."""
    o = c.optim
    o.name = "sgd"
    o.base_lr = base_lr
    o.warmup_epochs = warmup_epochs
    o.warmup_start_nodes = 0
    o.warmup_start_lr = 0.0
    o.interval_scaling = "rescaled"
    o.final_lr_fraction = 0.0
    o.weight_decay = 5e-4


def dino_vit_adamw(
    c: ml_collections.ConfigDict, base_lr: float, warmup_epochs: float, final_lr_fraction: float
) -> None:
    """DINO's ViT optimizer (Caron et al. 2021, main_dino.py with ``--arch vit_small``), which
    iBOT reuses (main_ibot.py): AdamW with torch's betas (0.9, 0.999) at ``base_lr`` per 256
    images, a linear warmup from 0 over ``warmup_epochs``, then cosine to ``final_lr_fraction``
    of the peak; weight decay cosine 0.04 -> 0.4 on weights only, not biases or norms
    (utils.get_params_groups); each parameter's gradient clipped at 3.0 (utils.clip_gradients)."""
    o = c.optim
    o.name = "adamw"
    o.betas = (0.9, 0.999)
    o.base_lr = base_lr
    o.base_lr_batch_size = 256
    o.lr_scaling = "linear"
    o.schedule = "cosine"
    o.warmup_epochs = warmup_epochs
    o.warmup_start_lr = 0.0
    o.final_lr_fraction = final_lr_fraction
    o.weight_decay = 0.04
    o.weight_decay_schedule = "cosine"
    o.weight_decay_end = 0.4
    o.regularize_bn = False
    o.regularize_bias = False
    o.grad_clip_per_parameter = 3.0


def demo_vit_trunk(c: ml_collections.ConfigDict, pos_embed_init: str) -> None:
    """The ViT demos' trunk (DINO's and MoCo v3's ``demo_vit``): ViT-Tiny (width 192) cut to
    4 blocks, 8 px patches on the demo's 32 px images (a 4 x 4 grid: a step about 4x cheaper
    than 4 px patches), no drop path (a few hundred steps: nothing to regularise)."""
    m = c.model
    m.trunk = "vit_tiny"
    m.vit_depth = 4
    m.patch_size = 8
    m.image_size = 32
    m.drop_path_rate = 0.0
    m.pos_embed_init = pos_embed_init


def demo_data(c: ml_collections.ConfigDict) -> None:
    """The built-in demo data at 32 px (no download), batches of 128."""
    c.data.source = "demo"
    c.data.name = ""
    c.data.train_split = "train"
    c.data.test_split = "test"
    c.data.image_size = 32
    c.data.batch_size = 128
    c.data.cache = True


def demo_resnet(c: ml_collections.ConfigDict) -> None:
    """The demos' ResNet-18 at a quarter of the width with a CIFAR stem (2 CPU cores, minutes).
    Zero-init residuals make each block start as the identity; on a tiny net and a few hundred
    steps that delay costs the whole run (measured: no learning in 6 epochs)."""
    c.model.zero_init_residual = False
    c.model.trunk = "resnet18"
    c.model.width_multiplier = 0.25
    c.model.cifar_stem = True


def demo_data_and_model(c: ml_collections.ConfigDict) -> None:
    """What every method's ``demo`` preset shares: the demo data and ResNet, augmentations for
    32 px, and the kNN monitor printing learned vs random."""
    demo_data(c)
    c.data.augment.crop_scale = (0.2, 1.0)
    c.data.augment.blur_prob = (0.0,)  # blur destroys 32 px shapes (SimCLR drops it on CIFAR)
    # The demo's nuisance is colour: strong distortion (SimCLR's s=1, Chen et al. 2020 Sec. 3)
    # and frequent grayscale keep the method from matching views by colour.
    c.data.augment.color_strength = 1.0
    c.data.augment.grayscale_prob = (0.5,)
    demo_resnet(c)
    c.log_every_steps = 20
    c.checkpoint.every_steps = 0
    c.test_every_epochs = 0
    c.probe.num_classes = 10
    c.probe.learning_rate = 1e-2  # a few hundred steps: a zero-init probe needs larger steps
    c.knn.enabled = True
    c.knn.k = 20
    c.knn.temperature = 0.07
    c.knn.batch_size = 500


def evaluation(c: ml_collections.ConfigDict, engine: str, preset: str) -> None:
    """What the evaluation presets (knn, linear_eval, extract_features) start from: the data and
    trunk of ``preset``, "" / "imagenet" (ImageNet at 224 px, ResNet-50: the model of a PyTorch
    file), "demo" (the demo data and ResNet) or "test" (their tiny version). A jssl workdir's
    own ``model.*`` fields replace these (jssl.checkpoints.source_model), and a layer that reads
    the method's head takes the method from the evaluated workdir, so no method is set here."""
    c.engine = engine
    c.method.name = ""
    if preset in ("", "imagenet"):
        imagenet_data(c)
        c.data.batch_size = 256
        c.data.image_size = 224
        c.model.trunk = "resnet50"
        c.log_every_steps = 50
    elif preset in ("demo", "test"):
        demo_data(c)
        demo_resnet(c)
        c.log_every_steps = 20
        if preset == "test":
            tiny(c)
    else:
        raise ValueError(
            f"Unknown preset {preset!r} of configs/{engine}.py: use '', 'imagenet', 'demo' or "
            "'test'."
        )


def tiny(c: ml_collections.ConfigDict) -> None:
    """Seconds-long runs for the test suite (on top of a demo preset)."""
    c.data.image_size = 16
    c.data.batch_size = 16
    c.data.train_subset = 64
    c.model.width_multiplier = 0.125
    c.model.head_dims = (64, 32, 16)
    c.num_epochs = 2
    c.optim.warmup_epochs = 0  # tests also run single epochs
    c.log_every_steps = 2
    c.knn.enabled = False
    c.knn.batch_size = 100


def tiny_vit(c: ml_collections.ConfigDict) -> None:
    """``tiny`` with the test suite's ViT: 2 blocks of ViT-Tiny, 4 px patches on 16 px crops (a
    4 x 4 grid), no projector MLP (the ViT methods' heads are their own)."""
    tiny(c)
    c.model.trunk = "vit_tiny"
    c.model.vit_depth = 2  # seconds to compile; the published ViTs have 12 blocks and more
    c.model.patch_size = 4
    c.model.image_size = 16
    c.model.head_dims = ()


def tiny_multicrop(c: ml_collections.ConfigDict) -> None:
    """``dino_views`` at the test size: two 16 px global crops and two 8 px local ones, so the
    local crops' path runs."""
    a = c.data.augment
    a.num_crops = (1, 1, 2)
    a.crop_sizes = (16, 16, 8)
    a.crop_scale = ((0.3, 1.0), (0.3, 1.0), (0.2, 0.5))
    a.solarize_prob = (0.0, 0.2, 0.0)
