r"""BYOL pre-training (Grill et al. 2020, "Bootstrap Your Own Latent"), the paper's recipe
(Sec. 3.3, App. B-C) compared value by value with VISSL's
configs/config/pretrain/byol/byol_8node_resnet.yaml (300 epochs, batch 4096).

  python launch.py --config=configs/byol.py --workdir=runs/byol \
      --config.data.source=tfds --config.data.name=imagenet2012      # ImageNet, 300 epochs
  python launch.py --config=configs/byol.py:demo --workdir=runs/byol_demo    # CPU, minutes

Presets: "" / "imagenet" (the reference recipe), "demo" (small ResNet-18 on the built-in demo
data at 32 px; prints the kNN accuracy of learned vs random features), "test" (tiny).
"""

import ml_collections

from configs import base


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_base_config()
    m = c.method
    m.name = "byol"
    # The target's EMA momentum, cosine from base to final over the run (Sec. 3.2: tau_base
    # 0.996; VISSL byol_loss.momentum 0.996, byol_hooks.target_ema).
    m.base_momentum = 0.996
    m.final_momentum = 1.0
    # The predictor q_theta: same shape as the projector, 256-4096-256, BN after the hidden
    # layer (Sec. 3.3; VISSL's second head, mlp [256, 4096, 256] use_bn True).
    m.predictor_dims = (256, 4096, 256)
    m.predictor_bn = True
    base.loss_terms(c, regression=1.0)  # 2 - 2 cos, both directions summed (L + L~)

    # ResNet-50; projector 2048-4096-256 with BN after the hidden layer (VISSL's first head,
    # mlp [2048, 4096, 256] use_bn True); ZERO_INIT_RESIDUAL True; CONVERT_BN_TO_SYNC_BN True
    # (the paper's BN statistics span the whole batch).
    c.model.trunk = "resnet50"
    c.model.zero_init_residual = True
    c.model.head_dims = (2048, 4096, 256)
    c.model.head_bn = True
    c.model.head_last_bn = False
    c.model.sync_bn = True

    # Asymmetric views (Table 6 of App. B; VISSL ImgPilMultiCropRandomApply): one crop per
    # group, blur p (1.0, 0.1), solarisation p (0.0, 0.2); RandomResizedCrop 224 scale
    # 0.08-1, flip 0.5, colour jitter p 0.8 with strength 0.5 (brightness/contrast/saturation
    # 0.4, hue 0.1; the paper's saturation is 0.2), grayscale p 0.2, blur sigma 0.1-2.0.
    # BATCHSIZE_PER_REPLICA 64 x 64 GPUs = 4096.
    c.data.source = "tfds"
    c.data.name = "imagenet2012"
    c.data.test_split = "validation"
    c.data.batch_size = 4096
    c.data.image_size = 224
    base.byol_views(c)

    # LARS (trust coefficient 1e-3, momentum 0.9), biases and BN parameters excluded from both
    # the trust ratio and weight decay (Sec. 3.3; VISSL: regularize_bn False but
    # regularize_bias True); base lr 0.2 per 256 (3.2 at 4096; VISSL's 300-epoch yaml 0.3),
    # weight decay 1.5e-6 (VISSL 1e-6); linear warmup from 0 over 10 epochs (VISSL lengths
    # 0.0334 of 300), then cosine to 0 (VISSL to 1e-5 of the peak), both rescaled.
    c.num_epochs = 300
    o = c.optim
    o.name = "lars"
    o.lars_eta = 0.001
    o.trust_ratio_exclude = "bias_and_norm"
    o.momentum = 0.9
    o.nesterov = False
    o.weight_decay = 1.5e-6
    o.regularize_bn = False
    o.regularize_bias = False
    o.base_lr = 0.2
    o.base_lr_batch_size = 256
    o.lr_scaling = "linear"
    o.schedule = "cosine"
    o.warmup_epochs = 10
    o.warmup_start_lr = 0.0
    o.interval_scaling = "rescaled"
    o.final_lr_fraction = 0.0
    o.update_interval = "step"
    c.checkpoint.every_steps = 3130  # VISSL CHECKPOINT_FREQUENCY 10 epochs at 313 steps/epoch
    c.log_every_steps = 200  # LOG_FREQUENCY
    c.probe.num_classes = 1000  # the paper's online linear probe (App. C), monitoring only

    if preset in ("", "imagenet"):
        pass
    elif preset in ("demo", "test"):
        _demo(c)
        if preset == "test":
            base.tiny(c)
            c.method.predictor_dims = (16, 32, 16)
    else:
        raise ValueError(
            f"Unknown preset {preset!r} of configs/byol.py: use '', 'imagenet', 'demo' or 'test'."
        )
    return c


def _demo(c: ml_collections.ConfigDict) -> None:
    """The demo data and network every method's demo uses, BYOL's asymmetric views, solo-learn's
    CIFAR optimizer (scripts/pretrain/cifar/byol.yaml: LARS eta 0.02 without biases and norms,
    lr 1.0 per 256, weight decay 1e-5, tau_base 0.99) and a predictor that learns 10x faster
    than the rest (BYOL App. F; Tian et al. 2021, "Understanding self-supervised learning
    dynamics without contrastive pairs": the predictor must keep up with the encoder).

    6 epochs (372 steps): 8 min 4 s on 2 cores from a fresh clone, over the 5 minutes the
    other demos take; shorter runs did not learn. Measured (seed 0, kNN top-1 learned vs random
    init 57.6%; 2 cores shared with other jobs):
    - this preset: 72.3% after epoch 2, 85.2% after epoch 4, **87.1%** at the end (824 s on the
      shared machine);
    - the same in 4 or 5 epochs: 61.8% and 62.0% (441 s and 425 s);
    - 3 epochs: plain SGD (lr 0.05-0.15 at batch 128, tau_base 0.9-0.99, with or without an
      affine-free BN on the projector output): 40.9-48.9%, partial collapse (the std of the
      normalised target outputs fell from 0.095 to 0.036; 1/sqrt(64) = 0.125); this LARS
      without the faster predictor: 48.7% (tau 0.99), 41.9% (tau 0.95); with it: 56.2%.
    Shorter runs (issue 9; the 6-epoch run reached 72.3% at step 124, where a 4-epoch run's
    cosines have barely moved: lr 0.75 vs 0.90 of the peak, tau 0.995 vs 0.9925):
    - the 6-epoch run's step schedule at half the batch (batch 64, 3 epochs = 372 steps, lr 2.0
      per 256 = the same 0.5 a step, warmup 0.5 epoch = 62 steps, tau 0.99 -> 1 over 372
      steps; 1.4 CPU-s a step, the run's total over its steps, against 2.6 at batch 128 in the
      run below): 30.2% after epoch 1, 29.6% after epoch 2 (step 250), the target std at
      0.080; stopped at step 269 (365 CPU-s). The same number of updates at batch 64 does not
      learn: the step count alone is not what 4 epochs lack;
    - 4 epochs with both cosines stopped where the 6-epoch run is after 4 epochs (lr down to
      ``optim.final_lr_fraction=0.35`` of the peak, ``method.final_momentum=0.9975``): 57.9%
      after epoch 1, 46.8% after epoch 2 (step 124, against 72.3% in the 6-epoch run whose
      schedules differ there by the figures above), 60.2% after epoch 3, **48.9%** at the end
      (248 steps; 639 CPU-s: 546 s user + 93 s sys, 1926 s wall on the loaded machine).
    So the 4-epoch failures are not the target freezing or the rate decaying late in the run:
    under nearly the 6-epoch run's schedules the kNN accuracy already swings from epoch to
    epoch (57.9, 46.8, 60.2, 48.9) with the target std at 0.065-0.078, i.e. the run never
    leaves the unstable early phase in which the projections partially collapse and the
    predictor has to catch up; the 6-epoch run left it by step 124. (Its figures are from
    2026-11-22 and were not re-measured here; BYOL's code has only been refactored since.)
    Not yet under 5 minutes: the preset keeps the 6 epochs that learn. Next to try: seeds of
    the 6-epoch run (is its take-off reliable?) and a higher predictor rate in the first epochs.
    The online probe lags the kNN monitor (36.9% after epoch 4): its zero-init linear layer
    trains on features whose scale LARS keeps changing.
    """
    base.demo_data_and_model(c)
    c.num_epochs = 6
    c.test_every_epochs = 2
    c.model.head_dims = (128, 256, 64)
    c.model.head_last_bn = True  # batch-standardised targets (measured with SGD: slows collapse)
    c.model.sync_bn = True
    c.method.predictor_dims = (64, 256, 64)
    c.method.base_momentum = 0.99  # solo-learn's CIFAR tau_base (0.996 is for 300 ImageNet epochs)
    base.demo_two_views(c)
    base.demo_lars(c, base_lr=1.0, weight_decay=1e-5)
    c.optim.param_groups = (("predictor", 10.0),)
