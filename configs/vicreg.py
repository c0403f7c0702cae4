r"""VICReg pre-training (Bardes et al. 2022), following the paper (Sec. 4.1, Appendix C.1) and
its authors' code (facebookresearch/vicreg, main_vicreg.py, augmentations.py); VISSL has no
VICReg recipe.

  python launch.py --config=configs/vicreg.py --workdir=runs/vicreg \
      --config.data.source=tfds --config.data.name=imagenet2012      # ImageNet, 1000 epochs
  python launch.py --config=configs/vicreg.py:demo --workdir=runs/vicreg_demo   # CPU, minutes

Presets: "" / "imagenet" (the reference recipe), "demo" (small ResNet-18 on the built-in demo
data at 32 px; prints the kNN accuracy of learned vs random features), "test" (tiny).
"""

import ml_collections

from configs import base, recipes

PRESETS = ("", "imagenet", "demo", "test")


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_method_config("vicreg", preset, PRESETS)
    c.method.std_target = 1.0  # gamma of the variance hinge (Eq. 1)
    c.method.std_eps = 1e-4  # epsilon under its square root (Eq. 1; code: + 0.0001)
    # lambda, mu, nu (Sec. 4.1; code: --sim-coeff 25, --std-coeff 25, --cov-coeff 1).
    base.loss_terms(c, invariance=25.0, variance=25.0, covariance=1.0)

    # ResNet-50 (zero_init_residual=True in the code), expander 8192-8192-8192 (--mlp):
    # Linear-BN-ReLU, Linear-BN-ReLU, Linear; SyncBatchNorm; autocast AMP (here: bfloat16).
    c.model.trunk = "resnet50"
    c.model.zero_init_residual = True
    c.model.head_dims = (2048, 8192, 8192, 8192)
    c.model.head_bn = True
    c.model.head_last_bn = False
    c.model.head_bias = False  # the last Linear has none; the others are followed by BN
    c.model.sync_bn = True
    c.model.dtype = "bfloat16"

    # Batch 2048 (--batch-size); BYOL's augmentations (Appendix C.1, augmentations.py):
    # RandomResizedCrop 224 (0.08-1), flip 0.5, colour jitter p 0.8, grayscale p 0.2, blur p
    # [1.0, 0.1] sigma 0.1-2.0, solarisation p [0.0, 0.2]: per view, so two crop groups.
    recipes.imagenet_pretraining(c, batch_size=2048)
    recipes.byol_views(c)

    # LARS (eta 0.001, momentum 0.9; biases and norms neither decayed nor adapted:
    # exclude_bias_and_norm), weight decay 1e-6, base lr 0.2 per 256 (1.6 at 2048), 1000
    # epochs, linear warmup from 0 over 10 epochs, then cosine from the peak to 0.001 of it
    # (adjust_learning_rate: the cosine runs over the steps after the warmup).
    c.num_epochs = 1000
    recipes.lars(c, base_lr=0.2, weight_decay=1e-6, warmup_epochs=10, final_lr_fraction=0.001)
    c.checkpoint.every_steps = 3125  # every 5 epochs at 625 steps/epoch (the code: each epoch)
    c.log_every_steps = 10

    if preset in ("demo", "test"):
        _demo(c)
        if preset == "test":
            recipes.tiny(c)
            c.model.head_dims = (64, 32, 32)
    return c


def _demo(c: ml_collections.ConfigDict) -> None:
    """The demo data and network every method's demo uses; VICReg's loss; solo-learn's CIFAR
    LARS (``recipes.demo_lars``, scripts/pretrain/cifar/vicreg.yaml: lr 0.3 per 256, weight
    decay 1e-4; with plain SGD the variance term did not fall). The output is 64-d, below the
    batch of 128, as Barlow Twins' demo needs. Figures: docs/methods.md.
    """
    recipes.demo_data_and_model(c)
    c.model.dtype = "float32"
    c.model.zero_init_residual = False  # see recipes.demo_data_and_model
    c.num_epochs = 3
    c.model.head_dims = (128, 512, 512, 64)
    c.model.sync_bn = True
    recipes.demo_two_views(c)
    recipes.demo_lars(c, base_lr=0.3, weight_decay=1e-4)
