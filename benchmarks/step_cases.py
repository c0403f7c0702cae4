"""The train-step benchmark's cases: each case's model, crops and batch, and each method's
preset adapted to it (benchmarks/train_step.py; the case names are listed there).

Each method starts from its default preset (its published recipe) and takes the case's trunk,
crop size, batch and dtype; ``case_config`` says, method by method, what else it changes. The
newer methods:
- MAE (ViT cases): one view, 75% of the patches masked, ``norm_pix_loss``; its decoder (ViT-L's
  512 wide, 8 blocks of 16 heads) scaled with the encoder's width as from ViT-B/16 (768) to the
  case's ViT: 8 blocks of ``width * 2 / 3`` with heads of 32 channels (ViT-Tiny: 128 wide, 4
  heads), so that the decoder's share of the step is that of ``mae_vit_base_patch16_dec512d8b``.
- iBOT and DINOv2 (ViT cases): 2 global + 6 local crops as DINO's row (the recipes' 10 and 8),
  their own heads at the recipes' widths (iBOT one shared 8192-wide head for [CLS] and
  patches; DINOv2 separate 131072-wide [CLS] and patch heads, Sinkhorn-Knopp centring, KoLeo)
  and their masks. DINOv2's ViT-L/14 recipe otherwise: LayerScale 1e-5 and uniform drop path
  0.4 kept; the GELU MLP instead of SwiGLU (DINOv2's ViT-S/B use the MLP, SwiGLU is its
  ViT-L/g's); no registers (the recipe has none); no rematerialisation and no split of the
  state (a ViT-Tiny fits; they trade time for memory on ViT-L). Its patch heads dominate:
  jssl gives every global crop slots for half its patches, so at batch 64 they compute 4096
  rows of 131072 logits (18.7 GiB peak on CPU in float32, DINO's row 7.1 GiB).
- MSN (ViT cases): the target and one random-masked anchor (15% of the patches dropped) at the
  case's size and 6 focal anchors at the small size (the recipe's 10: the 8 crops of DINO's
  row), its 2048-2048-256 head with BN and 1024 prototypes.
- DeepCluster-v2 (ResNet cases): VISSL's 2 crops at the case's size, the 2048-128 MLP head,
  three heads of 3000 clusters, and a memory bank of ``DEEPCLUSTER_BANK_ROWS`` = 50,000 rows
  (CIFAR-10's train split; 2 x 50,000 x 128 float32, 49 MiB) instead of ImageNet's 1.28M: the
  preset sizes the bank by the train split, which a synthetic benchmark does not read.
  The timed steps fall in epoch 0's memory pass (parameters held fixed, the same forward and
  backward) and skip k-means, which runs once an epoch (every 1000 steps here) inside the step.
"""

import importlib

_R18 = dict(trunk="resnet18", cifar_stem=True, image_size=32, small=16, head=512)
_R50 = dict(trunk="resnet50", cifar_stem=False, head=2048)
_VIT_S16 = dict(trunk="vit_small", patch=16, image_size=224, small=96, head=384)
CASES = {
    "r18_32": dict(_R18, batch=256),
    "r18_32_b64": dict(_R18, batch=64),
    "r50_96": dict(_R50, image_size=96, small=48, batch=32),
    "r50_224": dict(_R50, image_size=224, small=96, batch=32),
    "vit_t_32": dict(trunk="vit_tiny", patch=4, image_size=32, small=16, batch=64, head=192),
    "vit_s16_224": dict(trunk="vit_small", patch=16, image_size=224, small=96, batch=32, head=384),
    # GPU-sized cases: the per-device batch of a GPU run, DINO's 2 + 10 crops on the ViTs.
    "r50_224_b256": dict(_R50, image_size=224, small=96, batch=256),
    "vit_s16_224_b128": dict(_VIT_S16, batch=128, local_crops=10),
    "vit_b16_224_b64": dict(_VIT_S16, trunk="vit_base", head=768, batch=64, local_crops=10),
}
# --compare_torch's default cases, (case, dtype), and MoCo's queue on both sides.
TORCH_CASES = (
    ("r18_32_b64", "float32"),
    ("r18_32", "float32"),
    ("r50_96", "float32"),
    ("r18_32_b64", "bfloat16"),
    ("r50_96", "bfloat16"),
)
TORCH_QUEUE = 4096
# DeepCluster-v2's memory bank rows (method.num_examples): CIFAR-10's train split.
DEEPCLUSTER_BANK_ROWS = 50_000
# The methods that put their own heads (or MAE's decoder) on a ViT: model.head_dims stays ().
_OWN_HEADS = ("dino", "mae", "ibot", "dinov2", "msn")


def case_config(method_name: str, spec: dict, dtype: str, queue_size: int, on_device: bool = False):
    """The method's preset with the case's model, crops and batch."""
    vit = spec["trunk"].startswith("vit")
    # MoCo v3's default preset is ViT-S/16, DINO's a ResNet-50: pick the one of the trunk.
    # The newer ViT methods' default presets are ViTs already (MAE ViT-L/16, iBOT and MSN
    # ViT-S/16, DINOv2 ViT-L/14): the case replaces the trunk below.
    presets = {"mocov3": "" if vit else "resnet50", "dino": "vit_small" if vit else ""}
    config = importlib.import_module(f"configs.{method_name}").get_config(
        presets.get(method_name, "")
    )
    config.model.trunk = spec["trunk"]
    if vit:
        config.model.patch_size = spec["patch"]
        config.model.image_size = spec["image_size"]  # the position-embedding grid
    else:
        config.model.cifar_stem = spec["cifar_stem"]
    config.model.head_dims = (spec["head"], 2048, 128)
    if method_name == "supervised":
        config.model.head_dims = (spec["head"], 1000)  # the linear classifier
    if method_name in ("barlow_twins", "vicreg"):  # their 8192-8192-8192 projector is the cost
        config.model.head_dims = (spec["head"], 8192, 8192, 8192)
    if method_name in _OWN_HEADS:  # their own heads (method.*), no projector MLP
        config.model.head_dims = ()
    config.model.dtype = dtype
    config.data.image_size = spec["image_size"]
    config.data.batch_size = spec["batch"]
    config.data.augment.on_device = on_device
    if method_name == "moco":
        config.method.queue_size = queue_size
    if method_name == "swav":
        config.data.augment.crop_sizes = (spec["image_size"], spec["small"])
    if method_name in ("byol", "simsiam", "mocov3"):  # the predictor's ratio of each paper
        config.method.predictor_dims = (128, 32 if method_name == "simsiam" else 2048, 128)
    if method_name == "mocov3" and vit:  # the ViT recipe's 4096-4096-256 MLPs (vits.py)
        config.model.head_dims = (spec["head"], 4096, 4096, 256)
        config.method.predictor_dims = (256, 4096, 256)
    if method_name in ("dino", "ibot", "dinov2"):  # 2 global + 6 local crops, as SwAV's
        config.data.augment.num_crops = (1, 1, spec.get("local_crops", 6))
        config.data.augment.crop_sizes = (spec["image_size"], spec["image_size"], spec["small"])
    _adapt_newer(method_name, config, spec)
    return config


def _adapt_newer(method_name: str, config, spec: dict) -> None:
    """MAE's, DINOv2's, MSN's and DeepCluster-v2's presets on the case (the module docstring
    says what changes and why); iBOT needs only the trunk and DINO's crops."""
    if method_name == "mae":  # one view at the case's size (the preset's crop_sizes are ())
        # Decoder width scaled as from ViT-B/16's 768 to the case's width (``head``: the
        # trunk's), 8 blocks, heads of 32 channels: ViT-Tiny 128 wide, 4 heads.
        config.method.decoder_dim = spec["head"] * 2 // 3
        config.method.decoder_heads = config.method.decoder_dim // 32
    if method_name == "dinov2":
        config.model.ffn = "mlp"  # DINOv2's ViT-S/B feed-forward; SwiGLU is its ViT-L/g's
        config.model.remat = "none"  # ViT-L's memory savers, not needed on a ViT-Tiny
        config.parallel.shard_params = False
    if method_name == "msn":  # target + random-masked anchor, 6 focal anchors (recipe: 10)
        config.data.augment.num_crops = (2, 6)
        config.data.augment.crop_sizes = (spec["image_size"], spec["small"])
    if method_name == "deepclusterv2":  # VISSL's 2 crops at the case's size; a CIFAR-10 bank
        config.data.augment.crop_sizes = (spec["image_size"],)
        config.method.num_examples = DEEPCLUSTER_BANK_ROWS


def engine_step(config, make_state, mesh):
    """(state, step) as the train engine builds them for ``config`` (its augmentation,
    accumulation and the state's layout; no online probe). ``make_state`` is
    ``train.init_state`` (arrays) or ``train.abstract_state`` (shapes, for compiling only)."""
    from jssl import methods
    from jssl.data import device_augment
    from jssl.engines import train
    from jssl.training.state import specs_of
    from jssl.training.step import make_train_step

    method = methods.get(config, steps_per_epoch=1000)
    tx, schedule = train.make_optimizer(config, method, steps_per_epoch=1000)
    state = make_state(config, method, tx, mesh)
    step = make_train_step(
        method,
        tx,
        schedule,
        mesh,
        augment=device_augment.make_batch_augment(config.data),
        accumulation_steps=config.optim.accumulation_steps,
        state_specs=specs_of(state),
    )
    return state, step
