"""The presets that need the scale machinery: SEER's SwAV on a RegNetY-128GF and DINO's ViT-L/16
(state split over the devices, blocks recomputed) and SimCLR's batch of 4096 on 8 devices (exact
accumulation). Their shapes only: the state is traced (``jax.eval_shape``), never allocated, and
laid out for 8 devices with the rule the step uses (``partition_specs``). The machinery itself
is tested in test_parallel.py, test_accumulation.py and tests/models/test_remat.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from configs import dino, simclr, swav
from jssl import methods, models, parallel
from jssl.checkpoints.run_config import flatten
from jssl.engines import train
from jssl.training import state as train_state

DEVICES = 8


def _state_shapes(config):
    method = methods.get(config, steps_per_epoch=100)
    tx, _ = train.make_optimizer(config, method, steps_per_epoch=100)
    return train.abstract_state(config, method, tx, parallel.make_mesh())


def _bytes(x) -> int:
    return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def _per_device(shapes, specs) -> tuple[int, int, int]:
    """(total bytes, bytes per device of the split state, bytes of the leaves left whole)."""
    total = per_device = whole = 0
    for x, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(specs), strict=True):
        size = _bytes(x)
        total += size
        if parallel.sharded_dim(spec) is None:
            per_device += size
            whole += size
        else:
            per_device += size // DEVICES
    return total, per_device, whole


@pytest.mark.parametrize(
    "module, preset, trunk, trunk_params",
    [
        (swav, "seer", "regnet_y_128gf", 644_812_894 - 7_393_000),  # torchvision's, less fc
        (dino, "vit_large", "vit_large", 304_326_632 - 1_025_000),  # timm's, less its classifier
    ],
)
def test_large_model_presets_split_their_state(module, preset, trunk, trunk_params):
    config = module.get_config(preset)
    assert config.model.trunk == trunk and config.parallel.shard_params
    assert config.model.remat == "full"
    train.validate(config)
    shapes = _state_shapes(config)
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes.params["trunk"]))
    assert count == trunk_params
    specs = train_state.partition_specs(shapes, DEVICES, config.parallel)
    total, per_device, whole = _per_device(shapes, specs)
    # Within 1.15x of an even split, plus the leaves left whole (biases, norms, the step
    # counter, the online probe's classifier: 1.5% of SEER's state, 0.3% of ViT-L's).
    assert per_device <= 1.15 * total / DEVICES + whole
    assert whole < 0.02 * total
    # Everything as large as the model is split: parameters, teacher, optimizer moments.
    assert bool(jax.tree.leaves(shapes.ema_params)) == (preset == "vit_large")  # DINO's teacher
    for field in train_state.SHARDED_FIELDS:
        leaves = jax.tree.leaves(getattr(shapes, field))
        if not leaves:
            continue
        split = jax.tree.leaves(getattr(specs, field))
        big = [s for x, s in zip(leaves, split, strict=True) if _bytes(x) >= 4 * 2**20]
        assert big and all(parallel.sharded_dim(s) is not None for s in big), field


def test_seer_follows_vissls_regnet128gf_configs():
    config = swav.get_config("seer")
    assert config.model.head_dims == (models.trunk_feature_dim(config.model), 8192, 8192, 256)
    assert config.method.num_prototypes == (16000,) and not config.model.head_bn
    assert config.data.batch_size == 8192 and config.optim.weight_decay == 1e-5
    assert config.data.augment.num_crops == (2, 4) and config.data.augment.crop_sizes == (224, 96)


def test_simclr_batch_4096_on_8_devices_is_vissls_per_replica_batch():
    config = simclr.get_config("imagenet_8dev")
    reference = simclr.get_config()
    assert config.data.batch_size == reference.data.batch_size == 4096
    steps = config.optim.accumulation_steps
    # Each of 8 devices: 512 examples in micro-batches of 64, VISSL's BATCHSIZE_PER_REPLICA.
    assert config.data.batch_size // DEVICES // steps == 64
    train.validate(config)  # on this process's devices: 4096 / 1 splits into 8 as well
    # Nothing else differs from the reference recipe.
    new, old = flatten(config), flatten(reference)
    assert {k for k in new if new[k] != old[k]} == {"optim.accumulation_steps"}
