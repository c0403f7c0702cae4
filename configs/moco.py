r"""MoCo v2 pre-training (Chen et al. 2020, "Improved Baselines with Momentum Contrastive
Learning"), following VISSL's configs/config/pretrain/moco/moco_1node_resnet.yaml.

  python launch.py --config=configs/moco.py --workdir=runs/moco \
      --config.data.source=tfds --config.data.name=imagenet2012      # ImageNet, 200 epochs
  python launch.py --config=configs/moco.py:demo --workdir=runs/demo   # CPU, minutes, offline

Presets: "" / "imagenet" (the reference recipe), "demo" (small ResNet-18 on the built-in
demo data at 32 px; prints the kNN accuracy of learned vs random features), "test" (tiny,
for the test suite).
"""

import ml_collections

from configs import base, recipes

PRESETS = ("", "imagenet", "demo", "test")


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_method_config("moco", preset, PRESETS)
    # VISSL moco_loss defaults (vissl/losses/moco_loss.py): queue 65536, momentum 0.999, T 0.2.
    c.method.queue_size = 65536
    c.method.momentum = 0.999
    c.method.temperature = 0.2
    # MoCo's shuffle-BN (He et al. 2020, Sec. 3.3; VISSL shuffle_batch) against BN cheating
    # across the per-device batches; irrelevant (and skipped) when model.sync_bn is on.
    c.method.shuffle_bn = True
    base.loss_terms(c, info_nce=1.0)  # the loss is InfoNCE alone

    # VISSL: RESNETS.DEPTH 50, ZERO_INIT_RESIDUAL True, heads mlp [2048, 2048] + relu,
    # mlp [2048, 128]; CONVERT_BN_TO_SYNC_BN False (shuffle-BN instead).
    c.model.trunk = "resnet50"
    c.model.zero_init_residual = True
    c.model.head_dims = (2048, 2048, 128)
    c.model.sync_bn = False

    # VISSL: imagenet1k folder, 32 per GPU x 8 GPUs = 256, RandomResizedCrop 224,
    # ImgPilColorDistortion strength 0.5, ImgPilGaussianBlur p 0.5 radius 0.1-2.0, flip 0.5.
    recipes.imagenet_pretraining(c, batch_size=256)
    c.data.augment.crop_scale = (0.08, 1.0)  # torchvision RandomResizedCrop default, as VISSL
    recipes.mocov2_augment(c)

    # VISSL: sgd, momentum 0.9, nesterov, weight_decay 1e-4, regularize_bn/bias True,
    # multistep lr [0.03, 0.003, 0.0003] at epochs [120, 160], update_interval epoch, 200 epochs.
    c.num_epochs = 200
    c.optim.name = "sgd"
    c.optim.base_lr = 0.03
    c.optim.base_lr_batch_size = 256
    c.optim.momentum = 0.9
    c.optim.nesterov = True
    c.optim.weight_decay = 1e-4
    c.optim.schedule = "multistep"
    c.optim.milestones = (120, 160)
    c.optim.gamma = 0.1
    c.optim.update_interval = "epoch"
    c.log_every_steps = 50
    c.checkpoint.every_steps = 5000

    if preset == "demo":
        _demo(c)
    elif preset == "test":
        _demo(c)
        _tiny(c)
    return c


def _demo(c: ml_collections.ConfigDict) -> None:
    """Small ResNet-18 on the built-in demo data at 32 px, 2 CPU cores, a few minutes."""
    recipes.demo_data_and_model(c)
    c.model.head_dims = (128, 128, 64)
    # MoCo v3's projector (Chen, Xie, He 2021, Sec. 2): BN after the hidden layer and an
    # affine-free BN on the output. In a few hundred steps the v2 head's embeddings collapse onto
    # one rotating direction; batch-centred outputs cannot share one (docs/methods.md).
    c.model.head_bn = True
    c.model.head_last_bn = True
    # A run of 372 steps needs a key encoder that keeps up and a queue of fresh keys (m 0.99
    # and 1024 keys barely moved the pretext task); twice this lr stalled some seeds and T 0.1
    # collapsed. Seeds 0-2, both BN modes: learned 86.8-91.0% vs random 48.9-57.6%.
    c.method.queue_size = 256
    c.method.momentum = 0.9
    c.method.temperature = 0.3
    c.num_epochs = 6  # 372 steps: about 4.5 min on 2 CPU cores with the kNN evaluations
    c.optim.base_lr = 0.03  # 0.015 at batch 128
    c.optim.base_lr_batch_size = 256
    c.optim.warmup_epochs = 1
    c.optim.schedule = "cosine"
    c.optim.update_interval = "step"
    c.optim.weight_decay = 5e-4


def _tiny(c: ml_collections.ConfigDict) -> None:
    """Seconds-long runs for the test suite."""
    recipes.tiny(c)
    c.method.queue_size = 64
