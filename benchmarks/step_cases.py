"""The train-step benchmark's cases: each case's model, crops and batch, and each method's
preset adapted to it (benchmarks/train_step.py; the case names are listed there)."""

import importlib

_R18 = dict(trunk="resnet18", cifar_stem=True, image_size=32, small=16, head=512)
_R50 = dict(trunk="resnet50", cifar_stem=False, head=2048)
CASES = {
    "r18_32": dict(_R18, batch=256),
    "r18_32_b64": dict(_R18, batch=64),
    "r50_96": dict(_R50, image_size=96, small=48, batch=32),
    "r50_224": dict(_R50, image_size=224, small=96, batch=32),
    "vit_t_32": dict(trunk="vit_tiny", patch=4, image_size=32, small=16, batch=64, head=192),
    "vit_s16_224": dict(trunk="vit_small", patch=16, image_size=224, small=96, batch=32, head=384),
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


def case_config(method_name: str, spec: dict, dtype: str, queue_size: int, on_device: bool = False):
    """The method's preset with the case's model, crops and batch."""
    vit = spec["trunk"].startswith("vit")
    # MoCo v3's default preset is ViT-S/16, DINO's a ResNet-50: pick the one of the trunk.
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
    if method_name == "dino":  # its own DINO head (method.head_*), no projector MLP
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
    if method_name == "dino":  # 2 global + 6 local crops, as SwAV's
        config.data.augment.num_crops = (1, 1, 6)
        config.data.augment.crop_sizes = (spec["image_size"], spec["image_size"], spec["small"])
    return config


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
