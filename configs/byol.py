r"""BYOL pre-training (Grill et al. 2020, "Bootstrap Your Own Latent"), the paper's recipe
(Sec. 3.3, App. B-C) and DeepMind's reference implementation
(github.com/deepmind/deepmind-research/tree/master/byol), 300 epochs at batch 4096. VISSL's main
branch has no BYOL training code. The learning rate, weight decay and target momentum are the
paper's 1000-epoch values; DeepMind's 300-epoch values are --config.optim.base_lr=0.3
--config.optim.weight_decay=1e-6 --config.method.base_momentum=0.99 (docs/methods.md).

  python launch.py --config=configs/byol.py --workdir=runs/byol \
      --config.data.source=tfds --config.data.name=imagenet2012      # ImageNet, 300 epochs
  python launch.py --config=configs/byol.py:demo --workdir=runs/byol_demo    # CPU, minutes

Presets: "" / "imagenet" (the reference recipe), "demo" (small ResNet-18 on the built-in demo
data at 32 px; prints the kNN accuracy of learned vs random features), "test" (tiny).
"""

import ml_collections

from configs import base, recipes

PRESETS = ("", "imagenet", "demo", "test")


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_method_config("byol", preset, PRESETS)
    m = c.method
    # The target's EMA momentum, cosine from base to final over the run (Sec. 3.2: tau_base
    # 0.996; DeepMind's base_target_ema for 1000 epochs).
    m.base_momentum = 0.996
    m.final_momentum = 1.0
    # The predictor q_theta: same shape as the projector, 256-4096-256, BN after the hidden
    # layer (Sec. 3.3; the reference code's predictor_hidden_size 4096).
    m.predictor_dims = (256, 4096, 256)
    m.predictor_bn = True
    base.loss_terms(c, regression=1.0)  # 2 - 2 cos, both directions summed (L + L~)

    # ResNet-50 with each block's last BN scale zero-initialised (haiku's ResNet, which the
    # reference code uses); projector 2048-4096-256 with BN after the hidden layer (Sec. 3.3);
    # BN statistics over the whole batch (the reference code's cross_replica_axis).
    c.model.trunk = "resnet50"
    c.model.zero_init_residual = True
    c.model.head_dims = (2048, 4096, 256)
    c.model.head_bn = True
    c.model.head_last_bn = False
    c.model.sync_bn = True

    # Asymmetric views (Table 6 of App. B): one crop per group, blur p (1.0, 0.1),
    # solarisation p (0.0, 0.2); RandomResizedCrop 224 scale 0.08-1, flip 0.5, colour jitter
    # p 0.8 with strength 0.5 (brightness/contrast/saturation 0.4, hue 0.1; the paper's
    # saturation is 0.2), grayscale p 0.2, blur sigma 0.1-2.0. Batch 4096 (Sec. 3.3).
    recipes.imagenet_pretraining(c, batch_size=4096)
    recipes.byol_views(c)

    # LARS (trust coefficient 1e-3, momentum 0.9), biases and BN parameters excluded from both
    # the trust ratio and weight decay (Sec. 3.3); base lr 0.2 per 256 (3.2 at 4096) and
    # weight decay 1.5e-6, the 1000-epoch values (DeepMind's config for 300 epochs: 0.3 and
    # 1e-6); linear warmup from 0 over 10 epochs, then cosine to 0.
    c.num_epochs = 300
    recipes.lars(c, base_lr=0.2, weight_decay=1.5e-6, warmup_epochs=10)
    c.checkpoint.every_steps = 3130  # every 10 epochs at 313 steps/epoch
    c.log_every_steps = 200

    if preset in ("demo", "test"):
        _demo(c)
        if preset == "test":
            recipes.tiny(c)
            c.method.predictor_dims = (16, 32, 16)
    return c


def _demo(c: ml_collections.ConfigDict) -> None:
    """The demo data and network every method's demo uses, BYOL's asymmetric views, LARS as
    solo-learn trains BYOL on CIFAR (scripts/pretrain/cifar/byol.yaml: eta 0.02 without biases
    and norms, tau_base 0.99) at a quarter of its rate and ten times its weight decay (0.25 per
    256 and 1e-4; solo-learn's own swung from epoch to epoch; at 0.5 one seed's outputs
    partially collapsed, below random-init features), and a predictor that learns 10x faster
    than the rest (BYOL App. F; Tian et al. 2021: the predictor must keep up with the encoder).
    Figures: docs/methods.md.
    """
    recipes.demo_data_and_model(c)
    c.num_epochs = 4  # 3 epochs (186 steps) at lr 0.5: 59.5%, barely above random init
    c.test_every_epochs = 0  # the kNN test at the end only: a mid-run test costs 12 s of the 5 min
    c.model.head_dims = (128, 256, 64)
    c.model.head_last_bn = True  # batch-standardised targets (measured with SGD: slows collapse)
    c.model.sync_bn = True
    c.method.predictor_dims = (64, 256, 64)
    c.method.base_momentum = 0.99  # solo-learn's CIFAR tau_base (0.996 is for 300 ImageNet epochs)
    recipes.demo_two_views(c)
    recipes.demo_lars(c, base_lr=0.25, weight_decay=1e-4)
    c.optim.param_groups = (("predictor", 10.0),)
