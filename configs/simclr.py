r"""SimCLR pre-training (Chen et al. 2020), following VISSL's
configs/config/pretrain/simclr/simclr_8node_resnet.yaml.

  python launch.py --config=configs/simclr.py --workdir=runs/simclr \
      --config.data.source=tfds --config.data.name=imagenet2012      # ImageNet, 100 epochs
  python launch.py --config=configs/simclr.py:imagenet_8dev --workdir=runs/simclr \
      --config.data.source=tfds --config.data.name=imagenet2012      # the same on 8 devices
  python launch.py --config=configs/simclr.py:demo --workdir=runs/simclr_demo   # CPU, minutes

Presets: "" / "imagenet" (the reference recipe, batch 4096 on 64 GPUs), "imagenet_8dev" (that
recipe's batch of 4096 on 8 devices, by exact gradient accumulation), "demo" (small ResNet-18
on the built-in demo data at 32 px; prints the kNN accuracy of learned vs random features),
"test" (tiny).
"""

import ml_collections

from configs import base, recipes

PRESETS = ("", "imagenet", "imagenet_8dev", "demo", "test")


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_method_config("simclr", preset, PRESETS)
    c.method.temperature = 0.1  # SIMCLR_INFO_NCE_LOSS.TEMPERATURE
    base.loss_terms(c, info_nce=1.0)  # NT-Xent alone

    # TRUNK resnet DEPTH 50; HEAD mlp [2048, 2048] + relu, mlp [2048, 128] (VISSL's mlp has no
    # BN unless use_bn); CONVERT_BN_TO_SYNC_BN True.
    c.model.trunk = "resnet50"
    c.model.head_dims = (2048, 2048, 128)
    c.model.head_bn = False
    c.model.sync_bn = True

    # BATCHSIZE_PER_REPLICA 64 x 8 nodes x 8 GPUs; RandomResizedCrop 224, flip 0.5,
    # ImgPilColorDistortion strength 1.0, ImgPilGaussianBlur p 0.5 radius 0.1-2.0.
    recipes.imagenet_pretraining(c, batch_size=4096)
    c.data.augment.crop_scale = (0.08, 1.0)
    c.data.augment.color_strength = 1.0
    c.data.augment.blur_prob = (0.5,)
    c.data.augment.blur_sigma = (0.1, 2.0)

    # OPTIMIZER as recipes.vissl_8node_larc; num_epochs 100; lr linear 0.6 -> 4.8 over lengths[0] =
    # 0.1 of the run (10 epochs), then cosine 4.8 -> 0.
    c.num_epochs = 100
    recipes.vissl_8node_larc(c, warmup_epochs=10, final_fraction=0.0)
    c.checkpoint.every_steps = 1560  # VISSL CHECKPOINT_FREQUENCY 5 epochs at 312 steps/epoch
    c.log_every_steps = 10  # LOG_FREQUENCY

    if preset == "imagenet_8dev":
        _eight_devices(c)
    elif preset in ("demo", "test"):
        _demo(c)
        if preset == "test":
            recipes.tiny(c)
    return c


def _demo(c: ml_collections.ConfigDict) -> None:
    """The demo data and network every method's demo uses, SimCLR's loss and optimizer."""
    recipes.demo_data_and_model(c)
    c.num_epochs = 3  # 186 steps; a SimCLR step backpropagates both views (2x MoCo's work)
    c.model.head_dims = (128, 128, 64)
    c.model.sync_bn = True
    # Plain SGD, not LARC: at a demo's lr LARC barely moves (recipes.demo_sgd).
    recipes.demo_sgd(c, base_lr=0.12, warmup_epochs=1)  # 0.06 at batch 128
    c.method.temperature = 0.2


def _eight_devices(c: ml_collections.ConfigDict) -> None:
    """VISSL's recipe, batch 4096 included, on 8 devices: each device's 512 examples go
    through the step as 8 micro-batches of 64, VISSL's BATCHSIZE_PER_REPLICA
    (``optim.accumulation_steps``, jssl.training.accumulation). The loss is NT-Xent over the
    whole batch, 8190 negatives per view as on 64 GPUs, not over each micro-batch. What
    differs: batch norm normalises each micro-batch (512 images with ``sync_bn`` across the 8
    devices) where VISSL's SyncBN sees all 4096. The cost: one more forward pass per step."""
    c.optim.accumulation_steps = 8
