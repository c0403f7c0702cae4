"""Defaults shared by every jssl config; method configs start from ``get_base_config()``.

Each field has one comment where its meaning is not obvious. Values derived from others
(learning rate from batch size, steps from epochs) are computed in code at run time, so a
command-line override of one field follows through.
"""

import ml_collections
from ml_collections import config_dict


def get_base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.engine = "train"  # "train" | "extract_features" | "knn" | "linear_eval"
    c.seed = 0  # model init, dropout/shuffle-BN randomness and the data order all derive from it
    c.num_epochs = 1
    c.log_every_steps = 10
    c.test_every_epochs = 0  # >0: a test phase (validation loss, kNN monitor) every N epochs

    c.method = ml_collections.ConfigDict()
    c.method.name = "moco"

    c.model = ml_collections.ConfigDict()
    c.model.trunk = "resnet50"
    c.model.width_multiplier = 1.0
    c.model.cifar_stem = False  # 3x3 stride-1 stem without max-pool, for 32 px images
    c.model.zero_init_residual = False
    c.model.head_dims = (2048, 2048, 128)  # (trunk features, hidden..., embedding)
    c.model.head_bn = False
    c.model.head_bias = True  # biases on the head's Dense layers (VISSL mlp use_bias)
    c.model.head_last_bn = False  # affine-free BN on the head's output (MoCo v3 projector)
    c.model.sync_bn = False  # True: batch statistics over the global batch (VISSL SYNC_BN)
    c.model.dtype = "float32"  # "bfloat16": bf16 compute, float32 params/optimizer/BN/loss
    # ViT trunks (model.trunk="vit_tiny" | "vit_small" | "vit_base"): patch size, the
    # resolution the position embeddings are laid out for (other crop sizes resample them),
    # and the stochastic depth of the last block.
    c.model.patch_size = 16
    c.model.image_size = 224
    c.model.drop_path_rate = 0.0
    c.model.pos_embed_init = "learned"  # or "sincos": MoCo v3's fixed 2-D sin-cos values
    c.model.vit_depth = 0  # 0: the size's 12 blocks; fewer for tests and CPU demos

    c.data = ml_collections.ConfigDict()
    c.data.source = "demo"  # "demo" | "tfds" | "folder"
    c.data.name = ""  # TFDS name when source="tfds", e.g. "imagenet2012"
    c.data.data_dir = ml_collections.config_dict.placeholder(str)  # TFDS dir / folder root
    c.data.train_split = "train"
    c.data.test_split = "test"
    c.data.batch_size = 256  # global, over all devices and processes
    c.data.image_size = 224
    c.data.train_subset = -1  # >0: only the first N train examples (VISSL DATA_LIMIT)
    c.data.shuffle_buffer = 16384
    c.data.skip_corrupt = False  # True: replace unreadable images (counted per epoch), not fail
    c.data.cache = False  # keep decoded examples in memory (small datasets)
    c.data.augment = ml_collections.ConfigDict()
    a = c.data.augment
    # Crop groups (jssl/data/crops.py): crops per group, e.g. (2,) two views, (2, 6) SwAV's
    # multi-crop. crop_sizes: one side per group, () = data.image_size. crop_scale and the
    # probabilities: one value for every group, or one per group.
    a.num_crops = (2,)
    a.crop_sizes = ()
    a.crop_scale = (0.2, 1.0)  # (min, max) area fraction, or one pair per group
    a.crop_ratio = (3 / 4, 4 / 3)
    a.flip_prob = (0.5,)
    a.color_jitter_prob = (0.8,)
    a.color_strength = 0.5  # jitter (0.8s, 0.8s, 0.8s, 0.2s), VISSL ImgPilColorDistortion
    a.grayscale_prob = (0.2,)
    a.blur_prob = (0.5,)
    a.blur_sigma = (0.1, 2.0)
    a.solarize_prob = (0.0,)
    a.mean = (0.485, 0.456, 0.406)
    a.std = (0.229, 0.224, 0.225)
    a.on_device = False  # True: host crops + flips (uint8), the step does the rest (device_augment)

    c.optim = ml_collections.ConfigDict()
    o = c.optim
    o.name = "sgd"  # "sgd" | "larc" (SGD + apex LARC: VISSL use_larc) | "lars" | "adamw"
    o.base_lr = 0.1
    o.base_lr_batch_size = 256  # peak lr = base_lr * batch_size / this (see lr_scaling); <=0: off
    o.lr_scaling = "linear"  # "linear" | "sqrt" (of batch/base_lr_batch_size): VISSL scaling_type
    o.momentum = 0.9
    o.nesterov = False
    o.weight_decay = 1e-4
    o.weight_decay_schedule = "constant"  # "cosine": weight_decay -> weight_decay_end (DINO)
    o.weight_decay_end = 1e-4
    o.regularize_bn = True
    o.regularize_bias = True
    o.schedule = "cosine"  # "multistep" | "cosine" | "constant"
    o.milestones = (30, 60)  # epochs, for multistep
    o.gamma = 0.1
    o.final_lr_fraction = 0.0  # cosine ends at peak * this (VISSL: end_value / start_value)
    o.warmup_epochs = 0.0  # linear warmup to the peak (VISSL composite: lengths[0] * num_epochs)
    o.warmup_start_lr = 0.0  # where the warmup starts, unless warmup_start_nodes > 0
    # >0: VISSL auto-scaling's warmup start, base_lr * (batch_size / this) / base_lr_batch_size,
    # i.e. the base rate scaled linearly to one node's batch (8 in VISSL's 8-node recipes: 0.6 at
    # batch 4096). 1: VISSL drops a warmup that would not climb. A field, not the machine count.
    o.warmup_start_nodes = 0
    # How the cosine after the warmup reads the progress (VISSL interval_scaling of its 2nd part):
    # "rescaled" starts it from the peak when the warmup ends; "fixed" runs it on the global
    # progress, so the rate drops at the end of the warmup (VISSL's SimCLR/SwAV recipes).
    # Multistep milestones always count from the start of training.
    o.interval_scaling = "rescaled"
    o.update_interval = "step"  # "step" | "epoch" (VISSL param_schedulers update_interval)
    o.lars_eta = 0.001  # lars/larc trust coefficient (VISSL eta / larc_config.trust_coefficient)
    o.larc_clip = False  # larc: step min(ratio, lr) instead of ratio * lr (larc_config.clip)
    o.larc_eps = 1e-8  # larc: added to the trust ratio's denominator (larc_config.eps)
    # lars/larc: parameters whose step skips the trust ratio (still weight-decayed): "no_decay"
    # (those weight decay skips), "bias_and_norm" (1-D: VISSL LARS exclude_bias_and_norm), "none"
    # (every parameter: apex LARC, VISSL LARS default).
    o.trust_ratio_exclude = "no_decay"
    o.betas = (0.9, 0.999)
    o.grad_clip_norm = 0.0
    # Learning rates per parameter-path prefix (PyTorch parameter groups; VISSL's lr_head):
    # entries (prefix, lr_multiplier) or (prefix, lr_multiplier, "constant"), the longest
    # matching prefix wins, e.g. "(('head', 10.0),)"; "constant": multiplier x the peak rate at
    # every step (SimSiam's fixed predictor rate). () = one group at the schedule.
    o.param_groups = ()
    o.grad_clip_per_parameter = 0.0  # >0: each parameter's gradient norm clipped (DINO clip_grad)

    c.init = ml_collections.ConfigDict()
    # Weights to start from when the workdir has no checkpoint to resume (the workdir's own
    # checkpoint always wins): a jssl workdir, its checkpoints/ dir or one step dir, or a VISSL
    # .torch / torchvision .pth ResNet file. "" = from scratch. Training loads the trunk (it
    # must fit model.*), the heads where shapes fit, and the same weights into a momentum
    # encoder; evaluation engines load the trunk alone (it must fit model.*; the method's head
    # is not read, so any method's workdir evaluates) unless a layer asks for "head".
    c.init.checkpoint = ""
    # Parameter-path prefixes that keep their fresh init when training starts from
    # init.checkpoint, e.g. ("head",) or ("head", "trunk/layer4_1") (VISSL's
    # MODEL.WEIGHTS_INIT.SKIP_LAYERS).
    c.init.skip = ()

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 0  # >0: also save every N steps (always at the end of an epoch)
    c.checkpoint.max_to_keep = 3  # newest checkpoints kept; 0 keeps all (negative is an error)
    # Resuming a workdir under a config that differs from its first one (workdir/config.json)
    # in a field that changes the run (model, data, batch, optimizer, method ...) is refused;
    # True allows it and records the change.
    c.checkpoint.allow_config_change = False
    c.checkpoint.async_save = True

    c.knn = ml_collections.ConfigDict()
    c.knn.enabled = False  # kNN accuracy of trunk features at start, in test phases and at end
    c.knn.layer = "avgpool"
    c.knn.k = 200  # VISSL nearest-neighbour test: k=200, T=0.1 (Wu et al. 2018)
    c.knn.temperature = 0.1
    c.knn.train_split = "train"
    c.knn.test_split = "test"
    c.knn.batch_size = 256

    c.probe = ml_collections.ConfigDict()
    # Online linear probe on stop-gradient trunk (avgpool) features, trained in the step
    # with its own optimizer (BYOL App. C). num_classes=0 turns it off.
    c.probe.num_classes = 0
    c.probe.learning_rate = 1e-3  # Adam
    c.probe.weight_decay = 0.0

    c.loss = ml_collections.ConfigDict()
    # The method's named loss terms (its config declares them with loss_terms below): the loss
    # is sum(weight * term). weights.<term>: the weight, or where a ramp ends; ramps.<term>:
    # kind "constant" | "linear" | "cosine" from `initial` at `begin` to the weight at `end`
    # (unit "epochs" | "steps"). Every term is logged unweighted and weighted.
    c.loss.weights = ml_collections.ConfigDict()
    c.loss.ramps = ml_collections.ConfigDict()

    c.eval_outputs = True  # per-example test-split outputs in workdir/eval/epoch_<n>/

    # JAX's persistent compilation cache: compiled steps are kept here and reused by a later
    # launch with the same shapes (a resume, a rerun, an evaluation of the same model), which
    # then skips most of its compile time. "" leaves JAX's own setting (off unless
    # JAX_COMPILATION_CACHE_DIR is set); a directory JAX already uses wins over this one.
    c.compilation_cache_dir = "~/.cache/jssl/jax_compilation_cache"

    c.debug = ml_collections.ConfigDict()
    c.debug.nans = False  # jax_debug_nans: fail at the first op producing a NaN (slow)
    c.debug.profile = False  # write a profiler trace of a few steps to the workdir
    c.debug.max_steps = -1  # >0: stop after this many steps (smoke tests)
    return c


def loss_terms(c: ml_collections.ConfigDict, **weights: float) -> None:
    """Declares the method's loss terms with their weights, each with a constant ramp that the
    command line can turn into one, e.g. ``--config.loss.ramps.variance.kind=linear
    --config.loss.ramps.variance.end=10`` (from 0 to the weight over the first 10 epochs).

    A method whose terms depend on the config (``terms(config)`` of its module: SwAV's per
    assignment crop, DINO's per teacher crop, the supervised method's per output) gets a field
    for each term of ``c`` as it stands, so call this after the method fields that name them
    (``method.crops_for_assign``, ``method.teacher_crops``, ``method.tap_classifiers``). The
    weights given here may name a family (``swapped_prediction=1.0``: it multiplies its parts);
    the parts not given are placeholders (None: their share of the family's mean), which
    ``--config.loss.weights.swapped_prediction_crop1=0`` sets.
    """
    c.loss.weights = ml_collections.ConfigDict({name: float(w) for name, w in weights.items()})
    names = list(weights)
    for term in _method_terms(c):
        if term.name not in weights:
            c.loss.weights[term.name] = config_dict.placeholder(float)
            names.append(term.name)
    c.loss.ramps = ml_collections.ConfigDict(
        {
            name: ml_collections.ConfigDict(
                dict(kind="constant", initial=0.0, begin=0.0, end=0.0, unit="epochs")
            )
            for name in names
        }
    )


def _method_terms(c: ml_collections.ConfigDict) -> tuple:
    """The terms of ``c.method.name`` under ``c`` (jssl.methods.loss_terms); none for a name
    jssl does not know (the base config alone)."""
    from jssl import methods  # imported here: only configs that declare loss terms need it

    if c.method.get("name") not in methods.METHODS:
        return ()
    return methods.loss_terms(c)


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


def demo_two_views(c: ml_collections.ConfigDict) -> None:
    """``byol_views`` at the demo's 32 px: no blur (see ``demo_data_and_model``)."""
    a = c.data.augment
    a.num_crops = (1, 1)
    a.blur_prob = (0.0,)
    a.solarize_prob = (0.0, 0.2)


def demo_lars(c: ml_collections.ConfigDict, base_lr: float, weight_decay: float) -> None:
    """LARS as solo-learn trains the non-contrastive methods on CIFAR at 32 px
    (vturrisi/solo-learn scripts/pretrain/cifar/{vicreg,barlow,byol,dino}.yaml): trust
    coefficient eta 0.02, not the ImageNet recipes' 0.001, biases and norms neither decayed nor
    adapted, ``base_lr`` per 256 images, warmup then cosine. Plain SGD at a demo's learning
    rate left VICReg and Barlow Twins below random-init features in 186 steps; this learns
    (see their demo presets). Deliberate difference: solo-learn also clips each layer's rate
    at the global one (``clip_lr``); optax's LARS does not."""
    o = c.optim
    o.name = "lars"
    o.lars_eta = 0.02
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
    o.warmup_epochs = 1
    o.warmup_start_lr = 0.0
    o.warmup_start_nodes = 0
    o.interval_scaling = "rescaled"
    o.final_lr_fraction = 0.0
    o.update_interval = "step"


def vissl_8node_larc(c: ml_collections.ConfigDict, warmup_epochs: float, final_fraction: float):
    """The optimizer VISSL's 8-node SimCLR and SwAV recipes share (simclr_8node_resnet.yaml,
    swav_8node_resnet.yaml): sgd + use_larc (clip False, trust_coefficient 0.001, eps 1e-8),
    weight_decay 1e-6, momentum 0.9, nesterov False, regularize_bn/bias True; lr composite of
    linear warmup then cosine with interval_scaling [rescaled, fixed], auto_lr_scaling
    base_value 0.3 per 256 (4.8 at 4096), which rewrites the warmup start to the base rate at
    one node's batch (0.6 at 512); update_interval step. Warmup length and the cosine's end
    differ per recipe."""
    o = c.optim
    o.name = "larc"
    o.larc_clip = False
    o.lars_eta = 0.001
    o.larc_eps = 1e-8
    o.trust_ratio_exclude = "none"
    o.weight_decay = 1e-6
    o.momentum = 0.9
    o.nesterov = False
    o.regularize_bn = True
    o.regularize_bias = True
    o.base_lr = 0.3
    o.base_lr_batch_size = 256
    o.lr_scaling = "linear"
    o.schedule = "cosine"
    o.warmup_epochs = warmup_epochs
    o.warmup_start_nodes = 8
    o.interval_scaling = "fixed"
    o.final_lr_fraction = final_fraction
    o.update_interval = "step"


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


def demo_data_and_model(c: ml_collections.ConfigDict) -> None:
    """What every method's ``demo`` preset shares: the built-in demo data at 32 px, a small
    ResNet-18 (2 CPU cores, a few minutes), and the kNN monitor printing learned vs random."""
    c.data.source = "demo"
    c.data.name = ""
    c.data.train_split = "train"
    c.data.test_split = "test"
    c.data.image_size = 32
    c.data.batch_size = 128
    c.data.cache = True
    c.data.augment.crop_scale = (0.2, 1.0)
    c.data.augment.blur_prob = (0.0,)  # blur destroys 32 px shapes (SimCLR drops it on CIFAR)
    # The demo's nuisance is colour: strong distortion (SimCLR's s=1, Chen et al. 2020 Sec. 3)
    # and frequent grayscale keep the method from matching views by colour.
    c.data.augment.color_strength = 1.0
    c.data.augment.grayscale_prob = (0.5,)
    # Zero-init residuals make each block start as the identity; on a tiny net and a
    # few hundred steps that delay costs the whole run (measured: no learning in 6 epochs).
    c.model.zero_init_residual = False
    c.model.trunk = "resnet18"
    c.model.width_multiplier = 0.25
    c.model.cifar_stem = True
    c.log_every_steps = 20
    c.checkpoint.every_steps = 0
    c.test_every_epochs = 0
    c.probe.num_classes = 10
    c.probe.learning_rate = 1e-2  # a few hundred steps: a zero-init probe needs larger steps
    c.knn.enabled = True
    c.knn.k = 20
    c.knn.temperature = 0.07
    c.knn.batch_size = 500


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
