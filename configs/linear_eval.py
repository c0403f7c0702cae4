r"""Linear evaluation of a frozen trunk: VISSL's linear image-classification benchmark
(``configs/config/benchmark/linear_image_classification/imagenet1k/
eval_resnet_8gpu_transfer_in1k_linear.yaml``).

  python launch.py --config=configs/linear_eval.py:demo --workdir=runs/demo_linear \
      --config.init.checkpoint=runs/demo                # ~2 min on 2 CPU cores
  python launch.py --config=configs/linear_eval.py --workdir=runs/moco_linear \
      --config.init.checkpoint=runs/moco               # ImageNet, 28 epochs
  python launch.py --config=configs/linear_eval.py:demo --workdir=runs/demo_linear_cached \
      --config.linear.cached_features=runs/demo_features/features   # heads on cached features

One BN -> linear head (VISSL's eval_mlp) per layer in ``linear.layers`` and per point of
``linear.lrs`` x ``linear.weight_decays``, all trained at once; each layer's head is chosen
by top-1 on the held-out end of the train split (``linear.val_fraction``) and scored on the
test split and on ``linear.extra_test_sets``. ``workdir/results.json`` holds
``{"evaluator": "linear", "layers": {"<layer>": {"protocol", "selection", "top1", "top5",
"grid", ...}}}`` (jssl/engines/linear_eval_record.py). The model fields come from the
evaluated workdir's config.json (jssl.checkpoints.source_model), so
``--config.init.checkpoint=<any method's workdir>`` is enough; a ``--config.model.*`` flag
wins, and a PyTorch file uses this preset's model fields (ResNet-50 by default).
``config.optim`` (its base_lr and weight_decay replaced by each grid point's), ``num_epochs``
and ``data.batch_size`` describe the training of the heads.

  python launch.py --config=configs/linear_eval.py --workdir=runs/moco_linear \
      --config.init.checkpoint=runs/moco --config.linear.extra_test_sets='("imagenet_a:test",
      "imagenet_r:test", "imagenet_v2/matched-frequency:test", "imagenet_sketch:test")'

Presets: "" / "imagenet" (VISSL's ResNet-50 recipe), "demo" (the demos' ResNet on the demo
data), "test" (tiny, for the test suite).
"""

import ml_collections

from configs import base, recipes

PRESETS = ("", "imagenet", "demo", "test")


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    base.check_preset(preset, PRESETS, "configs/linear_eval.py")
    c = base.get_base_config()
    recipes.evaluation(c, "linear_eval", preset)

    c.linear = ml_collections.ConfigDict()
    lin = c.linear
    # Taps to evaluate, one head each: conv1, conv1_relu, res2..res5, avgpool (VISSL's
    # res5avg), head. VISSL evaluates conv1 and res2..res5 pooled to ~9k dims.
    lin.layers = ("conv1", "res2", "res3", "res4", "res5", "avgpool")
    # jssl/evaluation/pooling.py: "none" | "avg" | "avg:k,s,p" | "vissl_resnet50" (VISSL's
    # LINEAR_EVAL_FEAT_POOL_OPS_MAP) for every layer, or "layer=spec;layer=spec".
    lin.pool = "vissl_resnet50"
    lin.num_classes = 1000
    # An extract_features workdir's features/ dir: train on its (already pooled) features
    # of data.train_split / data.test_split with no trunk forward; layers must be in it.
    lin.cached_features = ""
    lin.crop_scale = (0.08, 1.0)  # RandomResizedCrop of the training images (torchvision's)
    lin.sync_bn = True  # head BN statistics over the global batch (VISSL: SYNC_BN, apex)
    # The grid (jssl/evaluation/linear_grid.py): one head per layer and (lr, weight decay),
    # all trained at once. Base rates per optim.base_lr_batch_size (256) examples, scaled to
    # data.batch_size as optim.base_lr is; () = optim.base_lr / optim.weight_decay alone.
    # ImageNet: VISSL's 0.01 and a decade each way in steps of ~3x (DINOv2's grid spans
    # 1e-5..0.1 for its heads without BN), at VISSL's weight decay.
    lin.lrs = (0.001, 0.003, 0.01, 0.03, 0.1)
    lin.weight_decays = (5e-4,)
    # The share of the train split (its last examples) held out to choose each layer's point;
    # the test split never chooses. 0: nothing held out, for a one-point grid only.
    lin.val_fraction = 0.1
    # Or a split of its own to choose on (a dataset's validation split; val_fraction=0): the
    # heads then train on the whole of data.train_split.
    lin.val_split = ""
    lin.report_all = False  # True: also record every point's test figures (labelled as such)
    # "tfds_name:split" sets scored with the chosen heads after training on ImageNet (their
    # labels are ImageNet's; -A and -R over their 200 classes), e.g.
    # ("imagenet_v2/matched-frequency:test", "imagenet_a:test", "imagenet_r:test",
    #  "imagenet_sketch:test"); each must be prepared in data.data_dir (`tfds build`).
    lin.extra_test_sets = ()

    # VISSL: 32 per GPU x 8, RandomResizedCrop 224 + flip / Resize 256 CenterCrop 224.
    c.data.batch_size = 256
    # VISSL: sgd, momentum 0.9, nesterov, weight_decay 5e-4, regularize_bn False,
    # regularize_bias True, lr 0.01 per 256 (auto_lr_scaling), multistep x0.1 at epochs
    # [8, 16, 24], update_interval epoch, 28 epochs, a test phase every epoch.
    c.num_epochs = 28
    o = c.optim
    o.name = "sgd"
    o.base_lr = 0.01
    o.base_lr_batch_size = 256
    o.momentum = 0.9
    o.nesterov = True
    o.weight_decay = 5e-4
    o.regularize_bn = False
    o.regularize_bias = True
    o.schedule = "multistep"
    o.milestones = (8, 16, 24)
    o.gamma = 0.1
    o.warmup_epochs = 0.0
    o.update_interval = "epoch"
    c.test_every_epochs = 1
    c.log_every_steps = 200  # VISSL LOG_FREQUENCY
    c.checkpoint.every_steps = 0  # the head state is saved at the end of every epoch

    if preset == "demo":
        # 32 px, ResNet-18 x0.25 (cifar stem): res3 16x16x32, res4 8x8x64, res5 4x4x128.
        lin.layers = ("res3", "res4", "res5", "avgpool")
        lin.pool = "res3=avg:4,4,0;res4=avg:4,2,0;res5=avg:2,2,0"  # 512, 576, 512, 128 dims
        lin.num_classes = 10
        lin.crop_scale = (0.2, 1.0)
        c.data.batch_size = 256
        c.num_epochs = 6
        o.base_lr = 0.1
        lin.lrs = (0.03, 0.1, 0.3)  # 0.1 alone before the grid (docs/evaluation.md)
        o.schedule = "cosine"
        o.update_interval = "step"
        c.test_every_epochs = 0
        c.log_every_steps = 10
    elif preset == "test":
        # 16 px, ResNet-18 x0.125: res4 4x4x32, res5 2x2x64, avgpool 64.
        lin.layers = ("res4", "res5", "avgpool")
        lin.pool = "res4=avg:2,2,0"
        lin.num_classes = 10
        lin.crop_scale = (0.2, 1.0)
        c.data.batch_size = 16
        c.data.test_split = "test[:100]"
        c.num_epochs = 1
        o.base_lr = 0.1
        lin.lrs, lin.weight_decays, lin.val_fraction = (), (), 0.0  # one head, all of train
        c.test_every_epochs = 0
        c.log_every_steps = 2
        c.checkpoint.async_save = False
    return c
