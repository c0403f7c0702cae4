r"""Barlow Twins pre-training (Zbontar et al. 2021), following VISSL's
configs/config/pretrain/barlow_twins/barlow_twins_4node_resnet.yaml (1000 epochs, batch 2048).

  python launch.py --config=configs/barlow_twins.py --workdir=runs/barlow_twins \
      --config.data.source=tfds --config.data.name=imagenet2012      # ImageNet, 1000 epochs
  python launch.py --config=configs/barlow_twins.py:demo --workdir=runs/bt_demo   # CPU, minutes

Presets: "" / "imagenet" (the reference recipe), "demo" (small ResNet-18 on the built-in demo
data at 32 px; prints the kNN accuracy of learned vs random features), "test" (tiny).

The loss weights carry VISSL's two constants (jssl/methods/barlow_twins.py): invariance
scale_loss = 0.024, redundancy_reduction scale_loss * lambda_ = 0.024 * 0.0051.
"""

import ml_collections

from configs import base, recipes

SCALE_LOSS = 0.024  # LOSS.barlow_twins_loss.scale_loss
LAMBDA = 0.0051  # LOSS.barlow_twins_loss.lambda_

PRESETS = ("", "imagenet", "demo", "test")


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_method_config("barlow_twins", preset, PRESETS)
    # VISSL's SyncNormalizeFunction standardises both copies together (eps 1e-5); False: one
    # set of statistics per view, as the paper's code (BatchNorm1d(affine=False) per view).
    c.method.normalize_jointly = True
    base.loss_terms(c, invariance=SCALE_LOSS, redundancy_reduction=SCALE_LOSS * LAMBDA)

    # TRUNK resnet DEPTH 50; HEAD mlp [2048, 8192] relu bn, mlp [8192, 8192] relu bn,
    # mlp [8192, 8192], all use_bias False (embedding_dim 8192); CONVERT_BN_TO_SYNC_BN True;
    # AMP (here: bfloat16 compute, float32 parameters).
    c.model.trunk = "resnet50"
    c.model.head_dims = (2048, 8192, 8192, 8192)
    c.model.head_bn = True
    c.model.head_last_bn = False  # the loss standardises the output itself
    c.model.head_bias = False
    c.model.sync_bn = True
    c.model.dtype = "bfloat16"

    # BATCHSIZE_PER_REPLICA 64 x 4 nodes x 8 GPUs; ImgReplicatePil 2 copies, RandomResizedCrop
    # 128 (scale 0.08-1, torchvision's default), flip 0.5, ImgPilColorDistortion strength 0.5
    # (jitter p 0.8, grayscale p 0.2), Gaussian blur p [1.0, 0.1] radius 0.1-2.0, solarize
    # p [0.0, 0.2]: per-copy probabilities, so two crop groups of one crop each.
    recipes.imagenet_pretraining(c, batch_size=2048, image_size=128)
    recipes.byol_views(c)

    # OPTIMIZER sgd + use_larc (clip False, trust_coefficient 0.001, eps 1e-8), weight_decay
    # 1.5e-6, momentum 0.9, nesterov False, regularize_bn/bias False, num_epochs 1000; lr
    # composite with auto_lr_scaling base 0.2 per 256 (1.6 at 2048): linear from 0.4 (the base
    # rate at one node's 512 images, VISSL's resolve_linear_schedule) to 1.6 over lengths[0] =
    # 0.01 of the run (10 epochs), then cosine 1.6 -> 0.016 (end_value 0.002 / 0.2 of the
    # peak), interval_scaling [rescaled, fixed]; update_interval step.
    c.num_epochs = 1000
    recipes.vissl_larc(
        c,
        base_lr=0.2,
        weight_decay=1.5e-6,
        warmup_epochs=10,
        final_fraction=0.01,
        nodes=4,  # DISTRIBUTED.NUM_NODES
        regularize_bn_and_bias=False,
    )
    c.checkpoint.every_steps = 3125  # CHECKPOINT_FREQUENCY 5 epochs at 625 steps/epoch
    c.log_every_steps = 10  # LOG_FREQUENCY

    if preset in ("demo", "test"):
        _demo(c)
        if preset == "test":
            recipes.tiny(c)
            c.model.head_dims = (64, 32, 32)
    return c


def _demo(c: ml_collections.ConfigDict) -> None:
    """The demo data and network every method's demo uses; Barlow Twins' loss; solo-learn's
    CIFAR LARS (``recipes.demo_lars``, scripts/pretrain/cifar/barlow.yaml: lr 0.3 per 256,
    weight decay 1e-4). The output is 64-d, below the batch of 128: the cross-correlation of N
    images has rank < N, so a wider output cannot be decorrelated. Figures: docs/methods.md.
    """
    recipes.demo_data_and_model(c)
    c.model.dtype = "float32"
    c.num_epochs = 3
    # Output width below the batch (see above); hidden layers wider, as in the recipe.
    c.model.head_dims = (128, 512, 512, 64)
    c.model.sync_bn = True
    # scale_loss 1 (Barlow Twins' later code drops it; under LARS a common factor of both
    # terms hardly matters), lambda_ 0.0051.
    c.loss.weights.invariance = 1.0
    c.loss.weights.redundancy_reduction = LAMBDA
    recipes.demo_two_views(c)
    recipes.demo_lars(c, base_lr=0.3, weight_decay=1e-4)
