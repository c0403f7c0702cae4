r"""Supervised training (the baseline of every SSL number) and VISSL's full fine-tuning
benchmark, following VISSL's configs/config/pretrain/supervised/supervised_8gpu_resnet.yaml and
configs/config/benchmark/semi_supervised/imagenet1k/eval_resnet_8gpu_transfer_in1k_semi_sup_fulltune.yaml.

  python launch.py --config=configs/supervised.py --workdir=runs/supervised \
      --config.data.data_dir=<TFDS dir>                     # ResNet-50 on ImageNet, 105 epochs
  python launch.py --config=configs/supervised.py:finetune_10pct --workdir=runs/ft10 \
      --config.init.checkpoint=runs/simclr                  # fine-tune on 10% of the labels
  python launch.py --config=configs/supervised.py:demo --workdir=runs/supervised_demo  # CPU
  python launch.py --config=configs/supervised.py:finetune_demo --workdir=runs/ft_demo \
      --config.init.checkpoint=runs/simclr_demo             # a demo SSL run, 10% of the labels
  python launch.py --config=configs/supervised.py:finetune_vit --workdir=runs/ft_vit \
      --config.init.checkpoint=runs/dino_vit_base \
      --config.data.data_dir=<TFDS dir>                     # MAE's ViT-B/16 fine-tuning recipe

Presets: "" / "imagenet" (VISSL's supervised ResNet-50 recipe), "finetune_full" (a pre-trained
trunk fine-tuned on all of ImageNet's labels, VISSL's fulltune benchmark with the head at weight
decay 1e-6 and the trunk at 1e-4), "finetune_1pct" /
"finetune_10pct" (a pre-trained trunk fine-tuned with a fresh classifier on TFDS
``imagenet2012_subset/1pct`` / ``10pct``, tested on the full validation set), "demo" (small
ResNet-18 on the built-in demo data; prints test top-1 and the kNN of learned vs random-init
features), "finetune_demo" (a demo workdir's trunk fine-tuned on 10% of the demo labels),
"finetune_vit" (a pre-trained ViT-B/16 fine-tuned end to end on ImageNet with MAE's recipe:
AdamW, layer-wise learning-rate decay, mixup, CutMix, label smoothing, drop path; see
``_finetune_vit``), "test" (tiny). Each test phase reports ``top1`` / ``top5`` (%) over the
whole test split.

Per-layer learning rates and weight decay: ``optim.param_groups`` (VISSL's
``head_optimizer_params`` + ``param_schedulers.lr_head``); the fine-tuning presets name the
head group with VISSL's values (the trunk's rate; the trunk's weight decay in the semi-supervised
ones, 1e-6 in "finetune_full"), so ``--config.optim.param_groups="(('head', 10.0),)"`` gives the
head ten times the trunk's rate and ``"(('head', 10.0, 0.0),)"`` also no weight decay.

Several outputs: ``--config.method.tap_classifiers="('res4',)"`` adds a linear classifier on the
res4 tap next to the head, trained on the same labels (VISSL's multiple-output cross-entropy:
the outputs' losses summed); each reports its own top-1 / top-5.
"""

import ml_collections

from configs import base, recipes

PRESETS = (
    "",
    "imagenet",
    "finetune_full",
    "finetune_1pct",
    "finetune_10pct",
    "demo",
    "finetune_demo",
    "finetune_vit",
    "test",
)


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_method_config("supervised", preset, PRESETS)
    m = c.method
    # LOSS cross_entropy_multiple_output_single_target: label_smoothing 0.0, temperature 1.0,
    # normalize_output False (its defaults).
    m.label_smoothing = 0.0
    m.temperature = 1.0  # the logits are divided by it
    m.normalize_output = False  # L2-normalise the logits first
    # Trunk taps with their own linear classifier, trained on the same labels next to the head
    # (VISSL's multiple outputs), e.g. ('res4', 'res5'): terms cross_entropy_<tap>, summed.
    m.tap_classifiers = ()
    # True: refuse to start without init.checkpoint (the fine-tuning presets).
    m.require_init_checkpoint = False
    # Mixup / CutMix of adjacent training examples (timm's Mixup; jssl.losses.mixing), trained
    # with the soft-target cross-entropy, label_smoothing applied to the mixed targets. Alphas
    # 0 = off; MAE's ViT fine-tuning: 0.8, 1.0, mix_prob 1.0, switch_prob 0.5.
    m.mixup_alpha = 0.0
    m.cutmix_alpha = 0.0
    m.mix_prob = 1.0  # probability that a pair is mixed at all
    m.switch_prob = 0.5  # CutMix rather than mixup, when both are on
    # The tap the classifier reads: "avgpool" (ResNet: pooled features; ViT: the class token)
    # or, on a ViT, "patch_avg" (the mean of the patch tokens: MAE's global_pool).
    m.head_input = "avgpool"

    # TRUNK resnet DEPTH 50 (ZERO_INIT_RESIDUAL False); HEAD mlp dims [2048, 1000], one linear
    # layer giving the class logits; no SyncBN.
    c.model.trunk = "resnet50"
    c.model.zero_init_residual = False
    c.model.head_dims = (2048, 1000)
    c.model.head_bn = False
    c.model.sync_bn = False

    # BATCHSIZE_PER_REPLICA 32 x 8 GPUs; RandomResizedCrop 224, RandomHorizontalFlip,
    # ColorJitter(0.4, 0.4, 0.4, 0.4); test: Resize 256, CenterCrop 224.
    recipes.imagenet_data(c)
    c.data.batch_size = 256
    c.data.image_size = 224
    a = c.data.augment
    a.num_crops = (1,)
    a.crop_scale = (0.08, 1.0)
    a.flip_prob = (0.5,)
    # jssl's jitter at strength s is (0.8s, 0.8s, 0.8s, 0.2s): 0.5 gives VISSL's 0.4 for
    # brightness, contrast and saturation; hue is 0.1 instead of 0.4 (jssl.methods.supervised).
    a.color_jitter_prob = (1.0,)
    a.color_strength = 0.5
    a.grayscale_prob = (0.0,)
    a.blur_prob = (0.0,)
    a.solarize_prob = (0.0,)

    # OPTIMIZER sgd, momentum 0.9, nesterov True, weight_decay 1e-4, regularize_bn False,
    # regularize_bias True; lr auto-scaled 0.1 per 256, multistep x0.1 at epochs 30, 60, 90,
    # 100 (values 0.1 ... 1e-5), update_interval epoch; num_epochs 105.
    o = c.optim
    o.name = "sgd"
    o.momentum = 0.9
    o.nesterov = True
    o.weight_decay = 1e-4
    o.regularize_bn = False
    o.regularize_bias = True
    o.base_lr = 0.1
    o.base_lr_batch_size = 256
    o.lr_scaling = "linear"
    o.schedule = "multistep"
    o.milestones = (30, 60, 90, 100)
    o.gamma = 0.1
    o.warmup_epochs = 0.0
    o.update_interval = "epoch"
    c.num_epochs = 105
    c.test_every_epochs = 1  # TEST_EVERY_NUM_EPOCH 1 (top-1 / top-5 on the validation set)
    c.log_every_steps = 100  # LOG_FREQUENCY
    c.probe.num_classes = 0  # the model's own classifier is trained; no online probe
    c.seed = 0  # SEED_VALUE

    if preset == "finetune_full":
        _finetune_full(c)
    elif preset == "finetune_1pct":
        _finetune(c, "imagenet2012_subset/1pct")
    elif preset == "finetune_10pct":
        _finetune(c, "imagenet2012_subset/10pct")
    elif preset in ("demo", "test"):
        _demo(c)
        if preset == "test":
            recipes.tiny(c)
            c.model.head_dims = (64, 10)  # tiny's trunk has 64 features; 10 demo classes
            c.test_every_epochs = 1
    elif preset == "finetune_demo":
        _finetune_demo(c)
    elif preset == "finetune_vit":
        _finetune_vit(c)
    # After the presets: one weight field per output (cross_entropy, cross_entropy_<tap>).
    base.loss_terms(c, cross_entropy=1.0)
    return c


def _pretrained_trunk(c: ml_collections.ConfigDict) -> None:
    """What every fine-tuning preset starts from (VISSL's WEIGHTS_INIT with APPEND_PREFIX trunk.):
    the trunk of ``init.checkpoint``, required, with its workdir's ``model.*`` fields, and a
    fresh classifier whatever the checkpoint's head holds."""
    c.method.require_init_checkpoint = True
    c.init.trunk_from_checkpoint = True
    c.init.skip = ("head",)


def _finetune(c: ml_collections.ConfigDict, dataset: str) -> None:
    """VISSL's semi-supervised full fine-tuning on ImageNet (semi_supervised/imagenet1k/
    eval_resnet_8gpu_transfer_in1k_semi_sup_fulltune.yaml with dataset/simclr_in1k_per01.yaml
    or per10.yaml; SimCLR's 1% / 10% subsets, which TFDS ships as imagenet2012_subset)."""
    _pretrained_trunk(c)
    c.data.name = dataset
    c.data.test_split = "validation"  # the full ImageNet validation set
    c.data.batch_size = 256  # BATCHSIZE_PER_REPLICA 32 x 8 GPUs, DROP_LAST True
    recipes.crop_and_flip(c)  # RandomResizedCrop 224 + RandomHorizontalFlip only
    # OPTIMIZER sgd, momentum 0.9, nesterov True, weight_decay 0.0, regularize_bn False,
    # regularize_bias True; lr auto-scaled 0.05 per 256, multistep [0.05, 0.005] at epoch 30,
    # update_interval epoch; num_epochs 70; SEED_VALUE 1.
    o = c.optim
    o.weight_decay = 0.0
    o.base_lr = 0.05
    o.milestones = (30,)
    o.gamma = 0.1
    c.num_epochs = 70
    c.seed = 1
    # lr_head: the recipe leaves head_optimizer_params.use_different_lr and use_different_wd
    # False, i.e. the head at the trunk's rate and weight decay (vissl/config/defaults.yaml;
    # no semi-supervised yaml sets either); the group is named so the command line can change
    # them, e.g. --config.optim.param_groups="(('head', 10.0, 1e-6),)".
    o.param_groups = (("head", 1.0),)


def _finetune_full(c: ml_collections.ConfigDict) -> None:
    """VISSL's full fine-tuning on all of ImageNet's labels
    (benchmark/fulltune/imagenet1k/eval_resnet_8gpu_transfer_in1k_fulltune.yaml) with its
    optimization/different_lr_trunk_head.yaml, the VISSL recipe that gives the head its own
    weight decay: trunk 1e-4, head 1e-6 (head_optimizer_params use_different_wd True,
    weight_decay 0.000001), the head at the trunk's schedule (lr_head = lr)."""
    _pretrained_trunk(c)
    c.data.test_split = "validation"
    c.data.batch_size = 256  # BATCHSIZE_PER_REPLICA 32 x 8 GPUs
    recipes.crop_and_flip(c)  # RandomResizedCrop 224 + RandomHorizontalFlip only
    # OPTIMIZER sgd, momentum 0.9, nesterov True, weight_decay 0.0001, regularize_bn False,
    # regularize_bias True; lr (and lr_head) auto-scaled 0.1 per 256, multistep x0.1 at 30, 60,
    # 90, 100, update_interval epoch; num_epochs 105; SEED_VALUE 1.
    o = c.optim
    o.weight_decay = 1e-4
    o.base_lr = 0.1
    o.milestones = (30, 60, 90, 100)
    o.gamma = 0.1
    c.num_epochs = 105
    c.seed = 1
    o.param_groups = (("head", 1.0, 1e-6),)


def _demo(c: ml_collections.ConfigDict) -> None:
    """Supervised on the demo data with the network every demo uses: one crop (scale 0.2-1)
    and flip, no colour distortion (labels, not views, say what to learn), SGD 0.1 at batch
    128 with a cosine decay, a test phase after each epoch. Its kNN accuracy (99.0% vs 62.9%
    random init) is the ceiling the SSL demos approach (docs/methods.md).
    """
    recipes.demo_data_and_model(c)
    c.model.head_dims = (128, 10)  # ResNet-18 x0.25 has 128 features; 10 demo classes
    c.probe.num_classes = 0
    c.data.augment.num_crops = (1,)
    c.data.augment.crop_scale = (0.2, 1.0)
    recipes.crop_and_flip(c)
    c.num_epochs = 3
    c.test_every_epochs = 1
    o = c.optim
    o.base_lr = 0.2  # 0.1 at batch 128
    o.schedule = "cosine"
    o.update_interval = "step"
    o.weight_decay = 5e-4


def _finetune_demo(c: ml_collections.ConfigDict) -> None:
    """A demo SSL run's trunk fine-tuned on 10% of the demo labels (the first 800 training
    images, 80 per class; ``data.train_subset``), tested on the whole demo test split: VISSL's
    fine-tuning recipe at demo scale (fresh classifier, crop + flip, no weight decay, the head
    group at the trunk's rate), 10 epochs of 12 steps at batch 64, SGD 0.05 with a cosine decay.
    From the SimCLR demo's workdir it beats the same 800 labels from scratch (docs/methods.md).
    """
    _demo(c)
    _pretrained_trunk(c)
    c.data.train_subset = 800
    c.data.batch_size = 64
    c.num_epochs = 10
    c.test_every_epochs = 10
    o = c.optim
    o.base_lr = 0.2
    o.weight_decay = 0.0
    o.param_groups = (("head", 1.0),)


def _finetune_vit(c: ml_collections.ConfigDict) -> None:
    """MAE's end-to-end fine-tuning of a pre-trained ViT-B/16 on ImageNet (FINETUNE.md's
    ViT-Base command with main_finetune.py's defaults; He et al. 2022, App. A.3, Table 9): batch
    1024, AdamW (0.9, 0.999) at 5e-4 x batch / 256 with layer-wise decay 0.65, a 5-epoch warmup
    then a cosine to 1e-6, weight decay 0.05 (none on biases, norms, the position embeddings
    and the class token), 100 epochs, drop path 0.1, label smoothing 0.1, mixup 0.8, CutMix
    1.0, RandAugment (9, 0.5), random erasing 0.25, the classifier on the average of the patch
    tokens (``global_pool``; ``--config.method.head_input=avgpool`` is ``--cls_token``), a fresh
    classifier, tested on the validation set after each epoch.

    Any jssl ViT workdir is a starting point (DINO's, MoCo v3's, MAE's): its trunk's
    ``model.*`` fields come from its config.json (``init.trunk_from_checkpoint``) and the
    classifier's input width follows, so a DINO ViT-S/16 fine-tunes as a ViT-S/16. MAE's
    ViT-L/16 recipe: layer_decay 0.75, base_lr 1e-3, drop path 0.2, 50 epochs."""
    _pretrained_trunk(c)
    m = c.method
    m.head_input = "patch_avg"  # main_finetune.py: global_pool True by default
    m.label_smoothing = 0.1  # --smoothing
    m.mixup_alpha = 0.8  # --mixup
    m.cutmix_alpha = 1.0  # --cutmix
    m.mix_prob = 1.0  # --mixup_prob
    m.switch_prob = 0.5  # --mixup_switch_prob
    c.model.trunk = "vit_base"  # vit_base_patch16
    c.model.patch_size = 16
    c.model.image_size = 224
    c.model.vit_depth = 0
    c.model.head_dims = (768, 1000)
    c.model.drop_path_rate = 0.1  # --drop_path
    c.model.dtype = "bfloat16"  # torch.cuda.amp in MAE's runs
    c.data.test_split = "validation"
    c.data.batch_size = 1024  # 32 per GPU x 32 GPUs (or x 8 with accum_iter 4)
    # timm's create_transform for training: RandomResizedCrop 224 (scale 0.08-1), flip,
    # RandAugment rand-m9-mstd0.5-inc1, no colour jitter, random erasing 0.25 ("pixel" mode).
    recipes.crop_and_flip(c)
    a = c.data.augment
    a.crop_scale = (0.08, 1.0)
    a.randaugment_ops = 2  # rand-m9-mstd0.5: two ops, magnitude 9 with noise of std 0.5
    a.randaugment_magnitude = 9.0
    a.randaugment_magnitude_std = 0.5
    a.random_erasing_prob = 0.25  # --reprob 0.25 --remode pixel --recount 1
    o = c.optim
    o.name = "adamw"
    o.betas = (0.9, 0.999)
    o.base_lr = 5e-4  # --blr
    o.base_lr_batch_size = 256
    o.lr_scaling = "linear"
    o.schedule = "cosine"  # util/lr_sched.py: half-cycle cosine after the warmup, per step
    o.update_interval = "step"
    o.warmup_epochs = 5.0
    o.warmup_start_lr = 0.0
    o.final_lr_fraction = 1e-6 / (5e-4 * 1024 / 256)  # --min_lr over the peak at batch 1024
    o.weight_decay = 0.05
    o.regularize_bn = False  # util/lr_decay.py: no decay on 1-D parameters
    o.regularize_bias = False
    o.layer_decay = 0.65  # --layer_decay (ViT-B)
    # models_vit.py's no_weight_decay(): the position embeddings and the class token.
    o.param_groups = (("trunk/pos_embed", 1.0, 0.0), ("trunk/cls_token", 1.0, 0.0))
    o.grad_clip_norm = 0.0  # --clip_grad None
    c.num_epochs = 100
    c.test_every_epochs = 1
    c.checkpoint.every_steps = 1251  # every epoch at batch 1024
    c.log_every_steps = 20  # print_freq
    c.seed = 0
