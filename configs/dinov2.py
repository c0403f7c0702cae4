r"""DINOv2 pre-training (Oquab et al. 2023), the recipes of facebookresearch/dinov2
(dinov2/configs/ssl_default_config.yaml with train/vitl14.yaml, vitl16_short.yaml and
vitg14.yaml; the README's training commands).

  python launch.py --config=configs/dinov2.py --workdir=runs/dinov2 \
      --config.data.source=tfds --config.data.name=imagenet2012      # ViT-L/14 (vitl14.yaml)
  python launch.py --config=configs/dinov2.py:vitl16_short --workdir=runs/dinov2_l16
  python launch.py --config=configs/dinov2.py:demo --workdir=runs/dinov2_demo  # CPU, minutes

Presets: "" / "vitl14" (ViT-L/14, SwiGLU, Sinkhorn-Knopp centring, separate heads of 131072
prototypes; the recipe's 625k iterations at batch 3072), "vitl16_short" (ViT-L/16 on
ImageNet-1k, the README's "fast setup": 125k iterations at batch 2048, EMA centring, one
head), "vitg14" (ViT-g/14: vit_giant2 with SwiGLU), "demo" (the demo ViT of DINO's
``demo_vit`` on the built-in demo data; prints learned vs random kNN accuracy), "test" (tiny).
The large presets split their state over the devices (``parallel.shard_params``) and
recompute their blocks in the backward pass (``model.remat``), in bfloat16.

DINOv2 counts epochs of 1250 iterations (``train.OFFICIAL_EPOCH_LENGTH``) whatever the data;
jssl's epochs are passes over the data, so every epoch field here is DINOv2's iterations on
ImageNet-1k (``_dinov2_epochs``). vitl14.yaml and vitg14.yaml train on ImageNet-22k: with an
image folder of it, scale ``num_epochs`` and the warmups by ImageNet-1k's size over its size.
"""

import ml_collections

from configs import base, recipes

PRESETS = ("", "vitl14", "vitl16_short", "vitg14", "demo", "test")
OFFICIAL_EPOCH_LENGTH = 1250  # iterations per DINOv2 epoch (ssl_default_config.yaml)
IMAGENET_TRAIN = 1_281_167  # images in ImageNet-1k's train split


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_method_config("dinov2", preset, PRESETS)
    m = c.method
    # dino: head_n_prototypes 131072, head_bottleneck_dim 384 (vitl14.yaml), hidden 2048, 3
    # layers; ibot: separate_head true, head_n_prototypes 131072, bottleneck 256, hidden 2048,
    # 3 layers. DINOHead's weight_g is learned (no norm_last_layer); no BN.
    m.out_dim = 131072
    m.hidden_dim = 2048
    m.bottleneck_dim = 384
    m.num_layers = 3
    m.separate_head = True
    m.patch_out_dim = 131072
    m.patch_hidden_dim = 2048
    m.patch_bottleneck_dim = 256
    m.patch_num_layers = 3
    m.norm_last_layer = False
    # DINOLoss / iBOTPatchLoss: student 0.1; teacher 0.04 -> 0.07 over 30 epochs, [CLS] and
    # patches alike; train.centering sinkhorn_knopp (3 iterations), or "centering" with
    # momentum 0.9 for both centres.
    m.student_temp = 0.1
    m.warmup_teacher_temp = 0.04
    m.teacher_temp = 0.07
    m.warmup_teacher_temp_epochs = 30.0  # DINOv2 epochs here; _dinov2_epochs converts
    m.centering = "sinkhorn_knopp"
    m.sinkhorn_iterations = 3
    m.center_momentum = 0.9
    m.teacher_momentum = 0.994  # momentum_teacher 0.994 -> final_momentum_teacher 1, cosine
    m.freeze_last_layer_epochs = 1.0
    m.teacher_crops = 2  # the two global crops, masked for the student
    m.mask_ratio_min_max = (0.1, 0.5)
    m.mask_sample_probability = 0.5
    m.koleo_group_size = 32  # DINOv2's KoLeo runs on each GPU's batch: batch_size_per_gpu
    base.loss_terms(c, dino=1.0, ibot=1.0, koleo=0.1)  # loss_weight 1, 1; koleo_loss_weight

    # student: vit_large, patch 14, drop_path_rate 0.4, layerscale 1e-5, ffn_layer swiglufused,
    # no registers; the teacher without drop path; fp16 (bf16 here), FSDP (shard_params).
    c.model.trunk = "vit_large"
    c.model.patch_size = 14
    c.model.image_size = 224
    c.model.drop_path_rate = 0.4
    c.model.drop_path_uniform = True  # ssl_default_config.yaml: every block at the rate
    c.model.layerscale = 1e-5
    c.model.ffn = "swiglu"
    c.model.head_dims = ()
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.parallel.shard_params = True

    # batch_size_per_gpu 32 x 96 GPUs (README: 12 nodes). DataAugmentationDINO: global crops at
    # scale (0.32, 1), 8 local crops at 98 px (vitl14.yaml).
    recipes.imagenet_pretraining(c, batch_size=3072)
    recipes.dino_views(c, num_local=8, local_size=98, split=0.32)

    # AdamW (0.9, 0.999), base_lr 2e-4 per 1024 with sqrt scaling (scaling_rule
    # sqrt_wrt_1024), linear warmup from 0 over 80 epochs, cosine to min_lr 1e-6; weight decay
    # cosine 0.04 -> 0.2, none on biases and norms; clip_grad 3.0; layerwise_decay 1.0; the
    # patch embedding at 0.2 x the rate (patch_embed_lr_mult); 500 epochs.
    o = c.optim
    o.name = "adamw"
    o.betas = (0.9, 0.999)
    o.base_lr = 2e-4
    o.base_lr_batch_size = 1024
    o.lr_scaling = "sqrt"
    o.schedule = "cosine"
    o.warmup_start_lr = 0.0
    o.weight_decay = 0.04
    o.weight_decay_schedule = "cosine"
    o.weight_decay_end = 0.2
    o.regularize_bn = False
    o.regularize_bias = False
    o.grad_clip_norm = 3.0
    o.layer_decay = 1.0
    o.param_groups = (("trunk/patch_embed", 0.2),)
    c.log_every_steps = 10
    _dinov2_epochs(c, epochs=500, warmup=80)

    if preset == "vitl16_short":
        _vitl16_short(c)
    elif preset == "vitg14":
        # vit_giant2 (width 1536, 24 heads, 40 blocks); batch_size_per_gpu 12, the GPU count
        # unnamed: the global batch stays ViT-L/14's 3072, KoLeo's groups the per-GPU 12.
        c.model.trunk = "vit_giant2"
        c.method.koleo_group_size = 12
    elif preset in ("demo", "test"):
        _demo(c)
        if preset == "test":
            _test(c)
    return c


def _dinov2_epochs(c: ml_collections.ConfigDict, epochs: float, warmup: float) -> None:
    """DINOv2's epochs (1250 iterations each) as passes over ImageNet-1k at ``data.batch_size``:
    the run, the learning-rate warmup, the teacher-temperature warmup (30) and the last
    layer's freeze (1)."""
    scale = OFFICIAL_EPOCH_LENGTH * c.data.batch_size / IMAGENET_TRAIN
    c.num_epochs = int(round(epochs * scale))
    c.optim.warmup_epochs = warmup * scale
    c.optim.final_lr_fraction = 1e-6 / (c.optim.base_lr * (c.data.batch_size / 1024) ** 0.5)
    c.method.warmup_teacher_temp_epochs = 30 * scale
    c.method.freeze_last_layer_epochs = 1 * scale
    c.checkpoint.every_steps = 3 * OFFICIAL_EPOCH_LENGTH  # periodic_checkpointer period


def _vitl16_short(c: ml_collections.ConfigDict) -> None:
    """vitl16_short.yaml = ssl_default_config.yaml: ViT-L/16 on ImageNet-1k, 4 nodes x 8 GPUs
    x 64, MLP feed-forward, drop path 0.3, EMA centring, one head of 65536 prototypes
    (bottleneck 256) for [CLS] and patches, teacher momentum 0.992, base_lr 0.004 per 1024
    (sqrt), 10 warmup epochs, weight decay 0.04 -> 0.4, layer-wise decay 0.9, 8 local crops at
    96 px, 100 DINOv2 epochs."""
    c.model.patch_size = 16
    c.model.drop_path_rate = 0.3
    c.model.ffn = "mlp"
    m = c.method
    m.out_dim = m.patch_out_dim = 65536
    m.bottleneck_dim = 256
    m.separate_head = False
    m.centering = "centering"
    m.teacher_momentum = 0.992
    m.koleo_group_size = 64
    c.data.batch_size = 2048
    c.data.augment.crop_sizes = (224, 224, 96)
    c.optim.base_lr = 0.004
    c.optim.weight_decay_end = 0.4
    c.optim.layer_decay = 0.9
    _dinov2_epochs(c, epochs=100, warmup=10)


def _demo(c: ml_collections.ConfigDict) -> None:
    """DINOv2 on DINO's demo ViT (``recipes.demo_vit_trunk``: ViT-Tiny cut to 4 blocks, 8 px
    patches) without LayerScale, the demo data, two global crops at 32 px, small heads, DINO's
    demo teacher temperature 0.02, float32, state not split. Why each choice (LayerScale 1e-5
    kept the [CLS] targets uniform for the whole demo): docs/methods.md."""
    recipes.demo_data_and_model(c)
    recipes.demo_vit_trunk(c, pos_embed_init="learned")
    c.model.layerscale = 0.0
    c.model.dtype = "float32"
    c.model.remat = "none"
    c.model.ffn = "mlp"
    c.parallel.shard_params = False
    c.num_epochs = 4
    recipes.dino_demo_crops(c)
    recipes.dino_demo_head(c)
    m = c.method
    m.patch_out_dim, m.patch_hidden_dim, m.patch_bottleneck_dim = 256, 256, 64
    m.teacher_momentum = 0.996
    m.koleo_group_size = 64
    o = c.optim
    o.base_lr = 1e-3
    o.base_lr_batch_size = 256
    o.lr_scaling = "linear"
    o.warmup_epochs = 0.5
    o.final_lr_fraction = 0.0
    o.weight_decay_end = 0.4
    c.checkpoint.every_steps = 0
    c.log_every_steps = 20


def _test(c: ml_collections.ConfigDict) -> None:
    """Seconds-long runs: a 2-block ViT-Tiny with 4 px patches on 16 px crops (a 4 x 4 grid)
    and 8 px local crops, separate tiny heads, Sinkhorn centring, KoLeo over groups of 8."""
    recipes.tiny_vit(c)
    recipes.tiny_multicrop(c)
    c.model.drop_path_rate = 0.1
    # LayerScale at 0.1, not 1e-5: at 1e-5 an untrained trunk gives every image nearly the
    # same class token, and KoLeo's distances between them, differences of nearly equal
    # floats, change with the float rounding of any other batch layout (1 vs 4 devices).
    c.model.layerscale = 0.1
    recipes.tiny_dino_head(c)
    m = c.method
    m.patch_out_dim, m.patch_hidden_dim, m.patch_bottleneck_dim = 32, 32, 16
    m.koleo_group_size = 8
    c.optim.warmup_epochs = 0
