"""A ``--workdir`` that holds a user's files but is no jssl workdir is refused before anything
is written there; a failed first launch's leftovers are still a jssl workdir; ``~`` is the
home directory (the shell leaves ``--workdir=~/x`` unexpanded)."""

import os

import pytest
from support.runs import make_config

from configs import moco
from jssl import engines
from jssl.checkpoints import workdir as workdir_lib


def test_a_directory_of_other_files_is_refused_and_left_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "results.json").write_text('{"tool": "another"}')
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(FileExistsError) as info:
        with workdir_lib.open_run(moco.get_config("test"), str(tmp_path)):
            pass
    message = str(info.value)
    assert str(tmp_path) in message and "notes.txt, results.json" in message
    assert "not a jssl workdir" in message and "new or empty directory" in message
    assert sorted(os.listdir(tmp_path)) == before  # no .lock, no config.json
    assert (tmp_path / "results.json").read_text() == '{"tool": "another"}'


@pytest.mark.parametrize(
    "leftovers",
    [
        (".lock", "tensorboard/"),  # a first launch that failed and removed its config.json
        ("config.json",),
        (".DS_Store",),  # hidden files only
    ],
)
def test_a_jssl_workdir_or_an_empty_one_is_accepted(tmp_path, leftovers):
    for name in leftovers:
        if name.endswith("/"):
            (tmp_path / name).mkdir()
        elif name == "config.json":
            (tmp_path / name).write_text(moco.get_config("test").to_json_best_effort())
        else:
            (tmp_path / name).write_text("")
    with workdir_lib.open_run(moco.get_config("test"), str(tmp_path)) as changes:
        assert changes == []


def test_a_tilde_workdir_is_under_home(tmp_path, shared_dirs, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    # probe.num_classes=5 fails inside the train engine, after the workdir is made.
    config = make_config(shared_dirs, **{"probe.num_classes": 5})
    with pytest.raises(ValueError, match=r"probe.num_classes=5"):
        engines.run(config, "~/run")
    assert (home / "run" / workdir_lib.LOCK_FILE).exists()
    assert os.listdir(cwd) == []  # no folder named "~"
