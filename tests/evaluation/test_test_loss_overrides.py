"""The test_loss engine takes the method from the evaluated workdir's config.json; a
method.name given here that is not that one is refused, naming both, before the workdir is
touched (it used to be ignored without a word)."""

import json

import pytest

from configs import test_loss as test_loss_config
from jssl import engines
from jssl.engines import test_loss


def _workdir(tmp_path, method="moco"):
    """The part of a trained workdir the start-up checks read: its config.json."""
    trained = tmp_path / "trained"
    (trained / "checkpoints" / "2").mkdir(parents=True)
    (trained / "config.json").write_text(json.dumps({"method": {"name": method}}))
    return trained


@pytest.mark.parametrize("at", ["", "checkpoints/2"])
def test_another_method_name_is_refused_naming_the_workdirs(tmp_path, at):
    trained = _workdir(tmp_path)
    config = test_loss_config.get_config("test")
    config.init.checkpoint = str(trained / at) if at else str(trained)
    config.method.name = "simclr"
    workdir = tmp_path / "out"
    with pytest.raises(ValueError, match=r"method.name='simclr', but .* trained 'moco'") as e:
        engines.run(config, str(workdir))
    assert "Drop --config.method.name" in str(e.value)
    assert not workdir.exists()


@pytest.mark.parametrize("name", ["", "moco"])
def test_the_workdirs_own_method_or_none_passes(tmp_path, name):
    config = test_loss_config.get_config("test")
    config.init.checkpoint = str(_workdir(tmp_path))
    config.method.name = name
    test_loss.validate(config)
