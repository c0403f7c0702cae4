r"""SimSiam pre-training (Chen & He 2021), the paper's ImageNet recipe (Sec. 3, App. A) and its
official code (facebookresearch/simsiam main_simsiam.py, simsiam/builder.py); VISSL has none.

  python launch.py --config=configs/simsiam.py --workdir=runs/simsiam \
      --config.data.source=tfds --config.data.name=imagenet2012      # ImageNet, 100 epochs
  python launch.py --config=configs/simsiam.py:demo --workdir=runs/simsiam_demo  # CPU, minutes

Presets: "" / "imagenet" (the reference recipe), "demo" (small ResNet-18 on the built-in demo
data at 32 px; prints the kNN accuracy of learned vs random features), "test" (tiny).
"""

import ml_collections

from configs import base, recipes

PRESETS = ("", "imagenet", "demo", "test")


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_method_config("simsiam", preset, PRESETS)
    m = c.method
    # The predictor h: 2048-512-2048 bottleneck, BN on the hidden layer only (Sec. 3; the
    # code's --pred-dim 512). Its learning rate is not fixed here (see jssl/methods/simsiam.py).
    m.predictor_dims = (2048, 512, 2048)
    m.predictor_bn = True
    base.loss_terms(c, negative_cosine=1.0)  # D(p1, sg z2) / 2 + D(p2, sg z1) / 2

    # ResNet-50 (zero_init_residual=True in builder.py); projector 2048-2048-2048 with BN on
    # every layer, the output BN without affine parameters (--dim 2048); SyncBN.
    c.model.trunk = "resnet50"
    c.model.zero_init_residual = True
    c.model.head_dims = (2048, 2048, 2048, 2048)
    c.model.head_bn = True
    c.model.head_last_bn = True
    c.model.sync_bn = True

    # main_simsiam.py: RandomResizedCrop 224 scale (0.2, 1), ColorJitter(0.4, 0.4, 0.4, 0.1)
    # p 0.8 (strength 0.5), grayscale p 0.2, Gaussian blur sigma 0.1-2.0 p 0.5, flip 0.5;
    # batch 512.
    recipes.imagenet_pretraining(c, batch_size=512)
    c.data.augment.num_crops = (2,)
    c.data.augment.crop_scale = (0.2, 1.0)
    recipes.mocov2_augment(c)

    # SGD momentum 0.9, lr 0.05 * batch / 256 (0.1 at 512), weight decay 1e-4 on every
    # parameter (torch SGD's weight_decay), cosine to 0 without warmup, set once per epoch
    # (adjust_learning_rate), 100 epochs.
    c.num_epochs = 100
    o = c.optim
    o.name = "sgd"
    o.base_lr = 0.05
    o.base_lr_batch_size = 256
    o.lr_scaling = "linear"
    o.momentum = 0.9
    o.nesterov = False
    o.weight_decay = 1e-4
    o.regularize_bn = True
    o.regularize_bias = True
    o.schedule = "cosine"
    o.warmup_epochs = 0
    o.final_lr_fraction = 0.0
    o.update_interval = "epoch"
    c.checkpoint.every_steps = 2500  # the code saves every epoch (2502 steps at batch 512)
    c.log_every_steps = 10  # --print-freq

    if preset in ("demo", "test"):
        _demo(c)
        if preset == "test":
            recipes.tiny(c)
            c.model.head_dims = (64, 32, 32, 16)  # three layers, as SimSiam's projector
            c.method.predictor_dims = (16, 8, 16)
            # The test preset keeps the rates its tests were written with (LARS 0.3 per 256).
            c.optim.base_lr = 0.3
            c.optim.weight_decay = 1e-4
    return c


def _demo(c: ml_collections.ConfigDict) -> None:
    """The demo data and network every method's demo uses, with BYOL's demo recipe without
    its EMA target (SimSiam is BYOL without the momentum encoder, Chen & He 2021 Sec. 5): LARS
    as solo-learn's CIFAR recipes, the predictor at 10x the rate, projector 128-256-64 and
    predictor 64-256-64, at 0.15 per 256 with SimSiam's CIFAR weight decay 5e-4. At
    BYOL's 0.5, or at 0.3, the outputs partially collapse (the features' effective rank falls
    to a few dimensions), below random-init features on some machines. Figures:
    docs/methods.md.
    """
    recipes.demo_data_and_model(c)
    c.num_epochs = 4
    c.test_every_epochs = 2
    c.model.head_dims = (128, 256, 64)
    c.model.sync_bn = True
    c.method.predictor_dims = (64, 256, 64)
    recipes.demo_lars(c, base_lr=0.15, weight_decay=5e-4)
    c.optim.param_groups = (("predictor", 10.0),)
