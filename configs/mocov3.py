r"""MoCo v3 pre-training (Chen, Xie, He 2021, "An Empirical Study of Training Self-Supervised
Vision Transformers"), the recipes of facebookresearch/moco-v3 (CONFIG.md commands on top of
main_moco.py's defaults; moco/builder.py). VISSL has no MoCo v3.

  python launch.py --config=configs/mocov3.py --workdir=runs/mocov3 \
      --config.data.source=tfds --config.data.name=imagenet2012      # ViT-S/16, 300 epochs
  python launch.py --config=configs/mocov3.py:resnet50 --workdir=runs/mocov3_r50  # 100 epochs
  python launch.py --config=configs/mocov3.py:demo --workdir=runs/mocov3_demo   # CPU, minutes
  python launch.py --config=configs/mocov3.py:demo_vit --workdir=runs/mocov3_vit  # the same, ViT

Presets: "" / "imagenet" / "vit_small" (ViT-S/16, 300 epochs, AdamW: the paper's main recipe),
"vit_base" (ViT-B/16, same recipe), "resnet50" (ResNet-50, 100 epochs, LARS), "demo" (small
ResNet-18 on the built-in demo data at 32 px; prints the kNN accuracy of learned vs random
features), "demo_vit" (the demo on a 4-block ViT-Tiny with AdamW), "test" (tiny).
"""

import ml_collections

from configs import base, recipes

PRESETS = ("", "imagenet", "vit_small", "vit_base", "resnet50", "demo", "demo_vit", "test")
# ViT widths: the class token feeds the projector (vits.py vit_small / vit_base: embed_dim).
VIT_WIDTH = {"vit_small": 384, "vit_base": 768}


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_method_config("mocov3", preset, PRESETS)
    m = c.method
    # Momentum encoder: cosine from 0.99 to 1 over the run, per iteration (main_moco.py
    # --moco-m 0.99 with --moco-m-cos in every CONFIG.md command, adjust_moco_momentum).
    m.base_momentum = 0.99
    m.final_momentum = 1.0
    m.temperature = 0.2  # CONFIG.md ViT commands: --moco-t=.2 (ResNet: the default, 1.0)
    # Predictor _build_mlp(2, 256, 4096, 256): bias-free, BN after the hidden layer, and for
    # ViT an affine-free BN on the output (MoCo_ViT; MoCo_ResNet passes last_bn=False).
    m.predictor_dims = (256, 4096, 256)
    m.predictor_bn = True
    m.predictor_last_bn = True
    # --stop-grad-conv1 (CONFIG.md ViT commands; Sec. 4.2 "random patch projection"): the
    # ViT's patch projection keeps its random init. Only for ViT trunks.
    m.freeze_patch_embed = True
    base.loss_terms(c, info_nce=1.0)  # ctr(q1, k2) + ctr(q2, k1), each x 2T

    # ViT-S/16 (-a vit_small); drop path 0 (timm's default, main_moco.py sets none); projector
    # _build_mlp(3, 384, 4096, 256): bias-free, BN after the hidden layers, affine-free BN on
    # the output. Every BN converted to SyncBN; AMP autocast (here bf16 compute, float32
    # parameters).
    c.model.head_bn = True
    c.model.head_last_bn = True
    c.model.head_bias = False
    c.model.sync_bn = True
    c.model.dtype = "bfloat16"

    # BYOL's asymmetric views (main_moco.py augmentation1 / augmentation2; recipes.byol_views):
    # RandomResizedCrop 224 with --crop-min 0.08 (the default, which the ViT commands keep),
    # colour jitter (0.4, 0.4, 0.2, 0.1) p 0.8, grayscale p 0.2, blur p 1.0 / 0.1 (sigma
    # 0.1-2.0), solarisation p 0.0 / 0.2, flip. Batch 4096 (-b default, the published ViT
    # models, "Below are our pre-trained ViT models (batch 4096)").
    recipes.imagenet_pretraining(c, batch_size=4096)
    recipes.byol_views(c)
    c.data.augment.crop_scale = (0.08, 1.0)

    # --optimizer=adamw --lr=1.5e-4 --weight-decay=.1 --epochs=300 --warmup-epochs=40:
    # torch.optim.AdamW(model.parameters()) with its default betas (0.9, 0.999) and eps 1e-8,
    # decaying every parameter; lr = 1.5e-4 x batch / 256; per iteration a linear warmup from 0
    # over 40 epochs, then a half-cycle cosine to 0 (adjust_learning_rate).
    c.num_epochs = 300
    o = c.optim
    o.name = "adamw"
    o.base_lr = 1.5e-4
    o.base_lr_batch_size = 256
    o.lr_scaling = "linear"
    o.betas = (0.9, 0.999)
    o.weight_decay = 0.1
    o.regularize_bn = True
    o.regularize_bias = True
    o.schedule = "cosine"
    o.warmup_epochs = 40
    o.warmup_start_lr = 0.0
    o.interval_scaling = "rescaled"
    o.final_lr_fraction = 0.0
    o.update_interval = "step"
    c.checkpoint.every_steps = 3130  # 10 epochs at 313 steps/epoch (the reference: every epoch)
    c.log_every_steps = 10  # -p print frequency

    if preset in ("", "imagenet", "vit_small"):
        _vit(c, "vit_small")
    elif preset == "vit_base":
        _vit(c, "vit_base")  # -a vit_base; every other value as ViT-S (CONFIG.md)
    elif preset == "resnet50":
        _resnet50(c)
    elif preset in ("demo", "demo_vit", "test"):
        _resnet50(c)
        _demo(c)
        if preset == "demo_vit":
            _demo_vit(c)
        if preset == "test":
            recipes.tiny(c)
            c.method.predictor_dims = (16, 32, 16)
    return c


def _vit(c: ml_collections.ConfigDict, trunk: str) -> None:
    width = VIT_WIDTH[trunk]
    c.model.trunk = trunk
    c.model.patch_size = 16
    c.model.drop_path_rate = 0.0
    c.model.pos_embed_init = "sincos"  # vits.py build_2d_sincos_position_embedding, fixed
    c.model.zero_init_residual = False
    c.model.head_dims = (width, 4096, 4096, 256)


def _resnet50(c: ml_collections.ConfigDict) -> None:
    """CONFIG.md "ResNet-50, 100-epoch pre-training": ``--moco-m-cos --crop-min=.2`` on top of
    main_moco.py's defaults (MoCo_ResNet; the published 68.9% linear accuracy)."""
    c.model.trunk = "resnet50"
    c.model.zero_init_residual = True  # torchvision resnet50(zero_init_residual=True)
    c.model.head_dims = (2048, 4096, 256)  # _build_mlp(2, 2048, 4096, 256), last BN affine-free
    c.model.dtype = "bfloat16"
    m = c.method
    m.temperature = 1.0  # --moco-t default
    m.predictor_last_bn = False  # MoCo_ResNet: _build_mlp(2, 256, 4096, 256, False)
    m.freeze_patch_embed = False
    c.data.augment.crop_scale = (0.2, 1.0)  # --crop-min=.2
    # LARS (moco/optimizer.py): trust coefficient 0.001, momentum 0.9; parameters of <= 1
    # dimension (biases, BN) get neither weight decay nor the trust ratio; --lr 0.6 x batch /
    # 256 (9.6 at 4096), --wd 1e-6; warmup 10 epochs from 0, then cosine to 0; 100 epochs.
    c.num_epochs = 100
    recipes.lars(c, base_lr=0.6, weight_decay=1e-6, warmup_epochs=10)
    c.checkpoint.every_steps = 3130


def _demo(c: ml_collections.ConfigDict) -> None:
    """The demo data and network every method's demo uses, MoCo v3's ResNet recipe with
    solo-learn's CIFAR optimizer (vturrisi/solo-learn scripts/pretrain/cifar/mocov3.yaml: LARS
    eta 0.02 without biases and norms, lr 0.3 per 256, weight decay 1e-6, T 0.2) and a momentum
    encoder that keeps up within a few hundred steps (tau_base 0.95; solo-learn's 0.99 learned
    less). Figures: docs/methods.md.
    """
    recipes.demo_data_and_model(c)
    c.model.dtype = "float32"
    c.num_epochs = 3
    c.model.head_dims = (128, 256, 64)
    c.model.sync_bn = True
    c.method.predictor_dims = (64, 256, 64)
    c.method.temperature = 0.2
    c.method.base_momentum = 0.95
    recipes.demo_two_views(c)
    recipes.demo_lars(c, base_lr=0.3, weight_decay=1e-6)


def _demo_vit(c: ml_collections.ConfigDict) -> None:
    """The demo (data, views, projector and predictor widths, T 0.2, tau 0.95) on the ViT of
    the DINO ViT demo (``recipes.demo_vit_trunk``) with MoCo v3's fixed 2-D sin-cos position
    embeddings and the paper's ViT optimizer, AdamW, at a demo's rate: 3e-3 per 256 (the
    paper: 1.5e-4, for 300 epochs), weight decay 0.05 (the paper: 0.1), 6 epochs (5 left three
    of six seed and device runs 7.0-9.6 points over random init), 1-epoch warmup. Deliberate
    difference from the paper's ViT recipe: the patch projection trains (a frozen one learned
    less in a few hundred steps; docs/methods.md).
    """
    recipes.demo_vit_trunk(c, pos_embed_init="sincos")
    c.model.zero_init_residual = False
    c.model.head_dims = (192, 256, 64)
    c.method.freeze_patch_embed = False  # the patch projection trains (see the docstring)
    c.num_epochs = 6
    o = c.optim
    o.name = "adamw"
    o.betas = (0.9, 0.999)
    o.base_lr = 3e-3
    o.weight_decay = 0.05
