r"""SwAV pre-training (Caron et al. 2020), following VISSL's
configs/config/pretrain/swav/swav_8node_resnet.yaml (400 epochs, batch 4096, multi-crop).

  python launch.py --config=configs/swav.py --workdir=runs/swav \
      --config.data.source=tfds --config.data.name=imagenet2012      # ImageNet, 400 epochs
  python launch.py --config=configs/swav.py:seer --workdir=runs/seer \
      --config.data.source=folder --config.data.data_dir=/data/uncurated     # SEER, RegNetY
  python launch.py --config=configs/swav.py:demo --workdir=runs/swav_demo    # CPU, minutes

Presets: "" / "imagenet" (the reference recipe), "seer" (SEER's SwAV on a RegNetY-128GF, its
state split over the devices), "demo" (small ResNet-18 on the built-in demo
data, 2x32 px + 2x16 px crops; prints the kNN accuracy of learned vs random features), "test"
(tiny). With small batches, SwAV's queue (``method.queue_length``, e.g. 3840 from epoch 15 at
batch 256 as in the SwAV repository's README) keeps the equipartition meaningful.
"""

import ml_collections

from configs import base, recipes

PRESETS = ("", "imagenet", "seer", "demo", "test")


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_method_config("swav", preset, PRESETS)
    m = c.method
    # LOSS.swav_loss: temperature 0.1, epsilon 0.05, num_iters 3, crops_for_assign [0, 1],
    # normalize_last_layer True, use_double_precision False, queue_length 0 / start_iter 0.
    m.temperature = 0.1
    m.epsilon = 0.05
    m.sinkhorn_iterations = 3
    m.crops_for_assign = (0, 1)
    m.num_prototypes = (3000,)  # swav_head num_clusters [3000]; several sets: (3000, 3000, ...)
    m.normalize_prototypes = True
    m.use_double_precision = False  # needs JAX_ENABLE_X64=1
    m.hard_assignment_iters = 0  # temp_hard_assignment_iters
    m.freeze_prototypes_iters = 313  # TEMP_FROZEN_PARAMS_ITER_MAP prototypes0: 313 (1 epoch)
    m.queue_length = 0  # 0: no queue; else a multiple of data.batch_size
    m.queue_start_epoch = 15.0  # the SwAV paper's epoch_queue_starts (used when the queue is on)
    base.loss_terms(c, swapped_prediction=1.0)  # mean over prototype sets of the swapped loss

    # TRUNK resnet 50; swav_head dims [2048, 2048, 128] use_bn True; CONVERT_BN_TO_SYNC_BN True;
    # AMP O1 (here: bfloat16 compute, float32 parameters).
    c.model.trunk = "resnet50"
    c.model.head_dims = (2048, 2048, 128)
    c.model.head_bn = True
    c.model.sync_bn = True
    c.model.dtype = "bfloat16"

    # BATCHSIZE_PER_REPLICA 64 x 64 GPUs; ImgPilToMultiCrop size_crops [224, 96], num_crops
    # [2, 6], crop_scales [[0.14, 1], [0.05, 0.14]]; flip 0.5; ImgPilColorDistortion strength
    # 1.0; ImgPilGaussianBlur p 0.5, radius 0.1-2.0.
    recipes.imagenet_pretraining(c, batch_size=4096)
    a = c.data.augment
    a.num_crops = (2, 6)
    a.crop_sizes = (224, 96)
    a.crop_scale = ((0.14, 1.0), (0.05, 0.14))
    a.flip_prob = (0.5,)
    a.color_strength = 1.0
    a.blur_prob = (0.5,)
    a.blur_sigma = (0.1, 2.0)

    # OPTIMIZER as recipes.vissl_8node_larc; num_epochs 400; lr linear 0.3 (rewritten to 0.6 by
    # auto-scaling) -> 4.8 over lengths[0] = 0.025 of the run (10 epochs), then cosine 4.8 ->
    # 0.0048 (0.001 of the peak).
    c.num_epochs = 400
    recipes.vissl_8node_larc(c, warmup_epochs=10, final_fraction=0.001)
    c.checkpoint.every_steps = 1560  # CHECKPOINT_FREQUENCY 5 epochs at 312 steps/epoch
    c.log_every_steps = 10  # LOG_FREQUENCY

    if preset == "seer":
        _seer(c)
    elif preset in ("demo", "test"):
        _demo(c)
        if preset == "test":
            recipes.tiny(c)
            c.data.augment.num_crops = (2, 4)
            c.data.augment.crop_sizes = (16, 8)
            # VISSL's epsilon: the demo's 0.02 sharpens the codes enough that float rounding
            # between 1 and 4 devices moves them measurably (tests/test_parallel.py).
            c.method.epsilon = 0.05
            c.method.temperature = 0.1  # VISSL's; the demo's 0.3 answers a demo-scale collapse
            c.method.num_prototypes = (8,)
            c.method.freeze_prototypes_iters = 2
            c.method.queue_length = 32  # two batches: full after step 2
            c.method.queue_start_epoch = 0.5  # step 2 of the 4 steps of an epoch
    return c


def _seer(c: ml_collections.ConfigDict) -> None:
    """SEER (Goyal et al. 2021, "Self-supervised Pretraining of Visual Features in the Wild") on
    its RegNetY-128GF (645M parameters): VISSL's swav_8node_resnet.yaml with the trunk of
    models/regnet128Gf.yaml and the head of heads/d7392_d8192_d8192_d256_proto16k.yaml (MLP
    7392-8192-8192-256 without BN, 16000 prototypes); the optimisation of
    projects/SEER/MODEL_DOCUMENTATION.md (batch 8192, lr 0.3 per 256 = 9.6, linear warmup then
    cosine, weight decay 1e-5, mixed precision; the paper's 2 x 224 + 4 x 96 px crops). SEER
    trained one epoch over a billion images; ``num_epochs`` and the data are the user's. The
    state is split over the devices (``parallel.shard_params``, VISSL's FSDP trunk) and every
    block recomputed in the backward pass (SEER's activation checkpointing)."""
    c.model.trunk = "regnet_y_128gf"
    c.model.head_dims = (7392, 8192, 8192, 256)
    c.model.head_bn = False
    c.model.remat = "full"
    c.parallel.shard_params = True
    c.method.num_prototypes = (16000,)
    c.data.batch_size = 8192
    c.data.augment.num_crops = (2, 4)
    c.data.augment.crop_sizes = (224, 96)
    c.optim.weight_decay = 1e-5


def _demo(c: ml_collections.ConfigDict) -> None:
    """The demo data and network every method's demo uses; SwAV's multi-crop at demo sizes
    (2x32 + 2x16 px, 3 epochs: 3-4 minutes on 2 cores), 30 prototypes, epsilon 0.02 (with ImageNet's
    0.05, the demo's small crops and strong colour distortion the codes collapse to uniform)
    and temperature 0.3 (VISSL: 0.1). At 0.1 the views' codes disagree under the colour
    distortion, the confidently wrong predictions make uniform ones the quickest way down, and
    the head collapsed (rank 4 of 64 by step 40, loss at ln K: 61.6% vs 57.6% at random init);
    at 0.3 it keeps rank 12-14. 3 epochs: after 2, one of six runs (seed 2 on 2 devices) had
    learned 8.5 points, 31.9 after 3. Figures: docs/methods.md.
    """
    recipes.demo_data_and_model(c)
    c.model.dtype = "float32"
    c.num_epochs = 3
    c.model.head_dims = (128, 128, 64)
    c.model.sync_bn = True
    a = c.data.augment
    a.num_crops = (2, 2)
    a.crop_sizes = (32, 16)
    # The demo's classes are shapes: a small crop must still hold part of the shape.
    a.crop_scale = ((0.3, 1.0), (0.2, 0.5))
    m = c.method
    m.num_prototypes = (30,)  # 3 per demo class, as 3000 is 3 per ImageNet class
    m.epsilon = 0.02  # sharper codes than ImageNet's 0.05, which collapsed to uniform
    m.temperature = 0.3  # softer predictions than VISSL's 0.1, at which the head collapsed
    m.freeze_prototypes_iters = 31  # half a demo epoch (VISSL: 313, one ImageNet epoch)
    m.queue_length = 0
    recipes.demo_sgd(c, base_lr=0.3, warmup_epochs=1)  # 0.15 at batch 128
