"""SimCLR end to end on the tiny preset, its presets and start-up checks. Its loss (global
negatives, gradients through the gather) is tested in test_losses*.py, its step on 1 vs 4
devices in test_parallel.py."""

import numpy as np
import pytest
from test_launch import enable_compilation_cache, prepare_shared_dirs

from configs import simclr
from jssl import methods
from jssl.engines import train


@pytest.fixture(scope="module")
def shared_dirs(tmp_path_factory):
    dirs = prepare_shared_dirs(tmp_path_factory)
    enable_compilation_cache(dirs[1])
    return dirs


def test_presets_follow_vissl():
    config = simclr.get_config()
    assert config.optim.name == "larc" and config.data.batch_size == 4096
    assert config.model.head_dims == (2048, 2048, 128) and not config.model.head_bn
    for preset in ("demo", "test"):
        assert simclr.get_config(preset).method.name == "simclr"
    with pytest.raises(ValueError, match="Unknown preset"):
        simclr.get_config("nope")


def test_bad_settings_name_the_field():
    config = simclr.get_config("test")
    config.method.temperature = 0.0
    with pytest.raises(ValueError, match="method.temperature=0.0"):
        methods.check_config(config)
    config = simclr.get_config("test")
    config.data.augment.num_crops = (1,)
    with pytest.raises(ValueError, match=r"num_crops=\(1,\)"):
        methods.check_config(config)


def test_trains_end_to_end_multicrop(tmp_path, shared_dirs):
    # Multi-crop SimCLR: 2 crops at 16 px and 2 at 8 px (VISSL multicrop_simclr_info_nce_loss).
    config = simclr.get_config("test")
    config.data.augment.num_crops = (2, 2)
    config.data.augment.crop_sizes = (16, 8)
    config.data.augment.crop_scale = ((0.2, 1.0), (0.05, 0.2))
    config.data.data_dir = shared_dirs[0]
    config.checkpoint.async_save = False
    config.test_every_epochs = 2
    config.data.test_split = "test[:40]"
    summary = train.run(config, str(tmp_path))
    assert summary["step"] == 8
    state = summary["state"]
    assert state.ema_params == {} and state.method_state == {}
    for leaf in np.asarray(state.params["head"]["fc1"]["kernel"]).ravel()[:5]:
        assert np.isfinite(leaf)
    inds = np.load(tmp_path / "eval" / "epoch_2" / "inds.npy")
    np.testing.assert_array_equal(inds, np.arange(40))
    losses = np.load(tmp_path / "eval" / "epoch_2" / "per_example_loss.npy")
    assert np.all(np.isfinite(losses)) and losses.mean() > 0
