r"""iBOT pre-training (Zhou et al. 2022, "iBOT: Image BERT Pre-Training with Online Tokenizer"),
the ViT-S/16 recipe of bytedance/ibot (README "iBOT Pre-Training with ViTs": 800 epochs,
16 GPUs x 64, on top of main_ibot.py's defaults), with VISSL's loss port
(vissl/losses/ibot_loss.py).

  python launch.py --config=configs/ibot.py --workdir=runs/ibot \
      --config.data.source=tfds --config.data.name=imagenet2012      # ViT-S/16, 800 epochs
  python launch.py --config=configs/ibot.py:demo --workdir=runs/ibot_demo     # CPU, minutes

Presets: "" / "imagenet" / "vit_small" (the README's ViT-S/16 command), "demo" (a 4-block
ViT-Tiny with 8 px patches on the built-in demo data at 32 px, DINO's ``demo_vit`` trunk;
prints the kNN accuracy of learned vs random features), "test" (tiny).
"""

import ml_collections

from configs import base, recipes

PRESETS = ("", "imagenet", "vit_small", "demo", "test")


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_method_config("ibot", preset, PRESETS)
    m = c.method
    # iBOTHead: out_dim 8192 for [CLS], patch_out_dim 8192, hidden 2048, bottleneck 256, 3
    # layers, no norm in the head, GELU; the README's --shared_head true (one last layer for
    # [CLS] and patches; main_ibot.py's default is false), the teacher's shared too
    # (--shared_head_teacher true); --norm_last_layer false (weight norm's g is learned).
    m.out_dim = 8192
    m.patch_out_dim = 8192
    m.hidden_dim = 2048
    m.bottleneck_dim = 256
    m.num_layers = 3
    m.norm_last_layer = False
    m.use_bn_in_head = False  # --norm_in_head None ('bn': BN, made SyncBN by main_ibot.py)
    m.shared_head = True
    m.shared_head_teacher = True
    # iBOTLoss: student 0.1; teacher 0.04 -> 0.07 over 30 epochs for [CLS] (--teacher_temp
    # 0.07 --warmup_teacher_temp_epochs 30) and for patches (teacher_patch_temp 0.07); centres
    # with momentum 0.9 each (center_momentum, center_momentum2).
    m.student_temp = 0.1
    m.warmup_teacher_temp = 0.04
    m.teacher_temp = 0.07
    m.warmup_teacher_patch_temp = 0.04
    m.teacher_patch_temp = 0.07
    m.warmup_teacher_temp_epochs = 30.0
    m.center_momentum = 0.9
    m.patch_center_momentum = 0.9
    m.teacher_momentum = 0.996  # --momentum_teacher, to 1 on a cosine
    m.freeze_last_layer_epochs = 1.0
    m.teacher_crops = 2  # --global_crops_number 2: the masked crops, the teacher's crops
    # Masks (ImageFolderMask): --pred_ratio 0 0.3 --pred_ratio_var 0 0.2, i.e. per crop no
    # mask or a ratio in (0.1, 0.5), each with probability 1/2; blocks (--pred_shape block)
    # of aspect 0.3 to 1/0.3; from epoch 0 (--pred_start_epoch).
    m.pred_ratio = (0.0, 0.3)
    m.pred_ratio_var = (0.0, 0.2)
    m.pred_shape = "block"
    m.pred_start_epoch = 0.0
    # iBOT has no KoLeo term; --config.loss.weights.koleo=0.1 adds DINOv2's (jssl.methods.koleo)
    # over groups of koleo_group_size examples (DINOv2: each GPU's batch).
    m.koleo_group_size = 64
    base.loss_terms(c, cls=1.0, patch=1.0, koleo=None)  # --lambda1 1 --lambda2 1

    # vit_small/16, drop path 0.1 on the student; --use_fp16 true (bf16 here); no BN anywhere.
    c.model.trunk = "vit_small"
    c.model.patch_size = 16
    c.model.image_size = 224
    c.model.drop_path_rate = 0.1
    c.model.head_dims = ()
    c.model.dtype = "bfloat16"

    # DataAugmentationiBOT (DINO's): global crops at scale (0.25, 1) (README), 10 local crops
    # at 96 px.
    recipes.imagenet_pretraining(c, batch_size=1024)  # --batch_size_per_gpu 64 x 16 GPUs
    recipes.dino_views(c, num_local=10, local_size=96, split=0.25)

    # AdamW at 5e-4 per 256 (--lr, linear scaling), 10 warmup epochs, cosine to 1e-6; weight
    # decay cosine 0.04 -> 0.4, not on biases and norms (utils.get_params_groups); each
    # parameter's gradient clipped at 3.0 (utils.clip_gradients); 800 epochs.
    c.num_epochs = 800
    peak = 5e-4 * 1024 / 256  # the final rate is min_lr 1e-6
    recipes.dino_vit_adamw(c, base_lr=5e-4, warmup_epochs=10, final_lr_fraction=1e-6 / peak)
    c.checkpoint.every_steps = 1251  # every epoch at batch 1024
    c.log_every_steps = 10

    if preset in ("demo", "test"):
        _demo(c)
    if preset == "test":
        _test(c)
    return c


def _demo(c: ml_collections.ConfigDict) -> None:
    """iBOT on DINO's demo ViT (``recipes.demo_vit_trunk``: ViT-Tiny cut to 4 blocks, 8 px
    patches, a 4 x 4 grid at 32 px) and the demo data: two global crops, no local ones, DINO's
    ViT optimizer at twice its rate, small heads, and DINOv2's KoLeo term (a deliberate
    difference from iBOT). Why each choice: docs/methods.md."""
    recipes.demo_data_and_model(c)
    recipes.demo_vit_trunk(c, pos_embed_init="learned")
    c.model.dtype = "float32"
    c.model.head_dims = ()
    c.num_epochs = 4
    recipes.dino_demo_crops(c)
    recipes.dino_demo_head(c)
    m = c.method
    m.patch_out_dim = 256
    m.warmup_teacher_patch_temp = m.teacher_patch_temp = 0.02
    m.teacher_momentum = 0.996
    # DINOv2's KoLeo term (not iBOT's) over groups of 64: without it the class tokens of the
    # demo images stay alike and kNN learns 5.3-10.0 points over seeds (docs/methods.md).
    c.loss.weights.koleo = 0.1
    m.koleo_group_size = 64
    o = c.optim
    o.base_lr = 1e-3
    o.warmup_epochs = 0.5
    o.final_lr_fraction = 0.0
    c.checkpoint.every_steps = 0


def _test(c: ml_collections.ConfigDict) -> None:
    """Seconds-long runs: a 2-block ViT-Tiny with 4 px patches on 16 px crops (a 4 x 4 grid)
    and 8 px local crops, tiny heads, the temperature warming up over the first epoch."""
    recipes.tiny_vit(c)
    recipes.tiny_multicrop(c)
    c.model.drop_path_rate = 0.1
    recipes.tiny_dino_head(c)
    m = c.method
    m.patch_out_dim = 32
    m.shared_head = False  # main_ibot.py's default: the patch path's own last layer
    m.warmup_teacher_patch_temp, m.teacher_patch_temp = 0.04, 0.07
    c.loss.weights.koleo = None  # iBOT's own terms (the demo's KoLeo: test_koleo_option.py)
    c.optim.warmup_epochs = 0
