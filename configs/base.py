"""Defaults shared by every jssl config; method configs start from ``get_base_config()``.

Each field has one comment where its meaning is not obvious. Values derived from others
(learning rate from batch size, steps from epochs) are computed in code at run time, so a
command-line override of one field follows through.
"""

import ml_collections
from ml_collections import config_dict

from jssl import data, models


def get_base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.engine = "train"  # one of jssl.engines.ENGINES: "train", "evaluate", "knn", ...
    c.seed = 0  # model init, dropout/shuffle-BN randomness and the data order all derive from it
    c.num_epochs = 1
    c.log_every_steps = 10
    c.test_every_epochs = 0  # >0: a test phase (validation loss, kNN monitor) every N epochs

    c.method = ml_collections.ConfigDict()
    c.method.name = "moco"

    c.model = models.default_config()  # jssl/models/__init__.py: one comment per field

    c.data = data.default_config()  # jssl/data/__init__.py: one comment per field

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
    # "multistep" | "cosine" | "constant" | "cosine_warm_restart" | "inverse_sqrt" (VISSL's
    # InverseSqrtScheduler: peak * sqrt(warmup fraction / progress); needs interval_scaling
    # "fixed" after a warmup, and without one stays above the peak, as VISSL's does)
    o.schedule = "cosine"
    # cosine_warm_restart (VISSL CosineWarmRestartScheduler): peak -> peak * final_lr_fraction,
    # restarted every this fraction of the progress after the warmup (restart_interval_length)
    o.restart_interval_length = 0.5
    o.restart_wave_type = "half"  # "half": fall, jump back | "full": fall, rise (wave_type)
    o.restart_lr_multiplier = 1.0  # restart i peaks at peak * this**i (VISSL lr_multiplier)
    o.restart_adaptive = False  # True: each restart peaks on the plain cosine (is_adaptive)
    o.milestones = (30, 60)  # epochs, for multistep
    o.gamma = 0.1
    o.final_lr_fraction = 0.0  # cosine ends at peak * this (VISSL: end_value / start_value)
    o.warmup_epochs = 0.0  # linear warmup to the peak (VISSL composite: lengths[0] * num_epochs)
    o.warmup_start_lr = 0.0  # where the warmup starts, unless warmup_start_nodes > 0
    # >0: VISSL auto-scaling's warmup start, base_lr * (batch_size / this) / base_lr_batch_size,
    # i.e. the base rate scaled linearly to one node's batch (8 in VISSL's 8-node recipes: 0.6 at
    # batch 4096). 1: VISSL drops a warmup that would not climb. A field, not the machine count.
    o.warmup_start_nodes = 0
    # How the schedule after the warmup reads the progress (VISSL interval_scaling, 2nd part):
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
    o.layer_decay = 1.0  # ViT: block i of L at this ** (L + 1 - i) x the rate (MAE); 1.0 = off
    o.grad_clip_per_parameter = 0.0  # >0: each parameter's gradient norm clipped (DINO clip_grad)
    # >1: each device's share of data.batch_size in this many micro-batches, the loss and its
    # gradient still exactly the method's over the whole batch (jssl.training.accumulation;
    # batch norm normalises per micro-batch). Memory of one micro-batch, one extra forward.
    o.accumulation_steps = 1

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
    # Evaluation engines: take model.* from the config.json of the workdir they evaluate
    # (flags given on the command line win); False keeps this config's model fields.
    c.init.model_from_checkpoint = True
    # Training from init.checkpoint (a jssl workdir): take the trunk's model.* fields from its
    # config.json (flags given win) and size the head's input to it; the fine-tuning presets.
    c.init.trunk_from_checkpoint = False

    c.parallel = ml_collections.ConfigDict()
    # True: parameters, teacher and optimizer state split over the devices (ZeRO-3 / FSDP:
    # jssl.parallel.leaf_spec), gathered for the forward pass; the same training, less memory.
    c.parallel.shard_params = False
    c.parallel.shard_min_size = 2**14  # arrays with fewer elements stay replicated (biases, norms)

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

    c.monitor = ml_collections.ConfigDict()
    # The collapse statistics (jssl/training/collapse.py, TensorBoard collapse/*) are written at
    # every log step; when one stays past its bound for `patience` log steps in a row: "warn"
    # (log a warning naming it), "stop" (save a checkpoint, exit with status 1) or "off".
    c.monitor.on_collapse = "warn"
    c.monitor.patience = 3  # log steps in a row, so that one noisy batch does not fire
    c.monitor.min_rank_fraction = 0.01  # RankMe below 1 + this x (min(global batch, dim) - 1), or 2
    c.monitor.min_std_fraction = 0.05  # std of the L2-normalised rows below this x 1/sqrt(dim)
    c.monitor.max_entropy_fraction = 0.995  # DINO teacher, SwAV: per-image entropy > this x log K
    c.monitor.min_mean_entropy_fraction = 0.05  # entropy of the batch's mean < this x log K

    c.loss = ml_collections.ConfigDict()
    # The method's named loss terms (its config declares them with loss_terms below): the loss
    # is sum(weight * term). weights.<term>: the weight, or where a ramp ends; ramps.<term>:
    # kind "constant" | "linear" | "cosine" from `initial` at `begin` to the weight at `end`
    # (unit "epochs" | "steps"). Every term is logged unweighted and weighted.
    c.loss.weights = ml_collections.ConfigDict()
    c.loss.ramps = ml_collections.ConfigDict()

    c.verify = ml_collections.ConfigDict()
    # engine="verify" (docs/operations.md): the first `steps` steps of this config on every
    # device, against one device (no split state, no accumulation) and against a run
    # checkpointed after steps // 2 and resumed.
    c.verify.steps = 4  # >= 2
    # The loss, and each part of the state (params, batch_stats, opt_state, ...), pass when
    # ||difference|| <= atol + rtol * ||value of the run as given||.
    c.verify.rtol = 1e-3
    c.verify.atol = 1e-6

    c.eval_outputs = True  # per-example test-split outputs in workdir/eval/epoch_<n>/

    # Evaluators (jssl/evaluation/evaluators.py, docs/evaluation.md): name -> an entry built by
    # configs/evaluate.py's entry(type, preset), each with its type, every_epochs and the
    # config sections it sets. In training they run on the checkpoints the run saves; with
    # engine="evaluate" on init.checkpoint.
    c.evals = ml_collections.ConfigDict()
    c.evaluate = ml_collections.ConfigDict()
    c.evaluate.follow = False  # evaluate each checkpoint of a training workdir as it appears
    c.evaluate.poll_seconds = 60  # how often a follower looks for a new checkpoint
    c.evaluate.idle_minutes = 120  # a follower stops after this long without a new one
    c.evaluate.keep_features = False  # keep each checkpoint's extracted features

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


def get_method_config(
    method: str, preset: str, presets: tuple[str, ...]
) -> ml_collections.ConfigDict:
    """``get_base_config()`` for ``configs/<method>.py``'s ``preset`` (one of ``presets``, else
    refused) with ``method.name`` set: each method's config file is named after it."""
    check_preset(preset, presets, f"configs/{method}.py")
    c = get_base_config()
    c.method.name = method
    return c


def check_preset(preset: str, presets: tuple[str, ...], file: str) -> None:
    """Refuses a preset that ``file``'s ``get_config`` does not have, naming those it has."""
    if preset not in presets:
        raise ValueError(
            f"Unknown preset {preset!r} of {file}: use one of "
            f"{', '.join(repr(p) for p in presets)}."
        )


def loss_terms(c: ml_collections.ConfigDict, **weights: float | None) -> None:
    """Declares the method's loss terms with their weights, each with a constant ramp that the
    command line can turn into one, e.g. ``--config.loss.ramps.variance.kind=linear
    --config.loss.ramps.variance.end=10`` (from 0 to the weight over the first 10 epochs).

    A method whose terms depend on the config (``terms(config)`` of its module: SwAV's per
    assignment crop, DINO's per teacher crop, the supervised method's per output) gets a field
    for each term of ``c`` as it stands, so call this after the method fields that name them
    (``method.crops_for_assign``, ``method.teacher_crops``, ``method.tap_classifiers``). The
    weights given here may name a family (``swapped_prediction=1.0``: it multiplies its parts);
    the parts not given are placeholders (None: their share of the family's mean), which
    ``--config.loss.weights.swapped_prediction_crop1=0`` sets. A weight given as None declares
    an optional term, off until set (DINO's and iBOT's ``koleo``).
    """
    c.loss.weights = ml_collections.ConfigDict(
        {
            name: config_dict.placeholder(float) if w is None else float(w)
            for name, w in weights.items()
        }
    )
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
