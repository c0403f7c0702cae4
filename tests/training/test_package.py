"""The installable package: ``pip install -e .`` gives ``import jssl`` from any directory and a
``jssl`` command equal to ``python launch.py``, whose config file may live anywhere and import
the ``configs`` recipes installed with it; pyproject.toml pins what requirements.txt pins."""

import glob
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
from absl import flags
from ml_collections import config_flags
from support.launch import REPO, launch_env

from jssl import cli

pytestmark = pytest.mark.e2e  # the end-to-end tier (JSSL_E2E_TESTS=1)

# A user's own config file, kept outside any checkout: it starts from jssl's MoCo recipe.
OWN_CONFIG = """
from configs import moco


def get_config(arg=None):
    return moco.get_config(arg)
"""


def _pins(lines) -> list[str]:
    return sorted(
        re.sub(r"\s+", "", line.split("#")[0]) for line in lines if line.split("#")[0].strip()
    )


def test_pyproject_dependencies_are_requirements_txt():
    # requirements.txt is the required set plus the tf extra (the tf.data pipelines).
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert not any(p.startswith("tensorflow-cpu") for p in project["dependencies"])
    pinned = [*project["dependencies"], *project["optional-dependencies"]["tf"]]
    with open(os.path.join(REPO, "requirements.txt")) as f:
        assert _pins(pinned) == _pins(f)
    assert project["scripts"]["jssl"] == "jssl.cli:main"


def test_config_checkout_is_the_config_files_repository(tmp_path):
    assert cli.config_checkout(["jssl", f"--config={REPO}/configs/moco.py:demo"]) == REPO
    assert cli.config_checkout(["jssl", "--config", f"{REPO}/configs/moco.py"]) == REPO
    assert cli.config_checkout(["jssl", f"--config={tmp_path}/x.py"]) is None


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A virtual environment over this interpreter's packages with jssl installed editable
    (no network: dependencies are the ones already installed, the build needs setuptools)."""
    path = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(path)], check=True)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps"]
    result = subprocess.run(
        [*pip, "--no-build-isolation", "-e", REPO], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return path


def test_editable_install_imports_from_any_directory_and_runs_the_jssl_command(
    venv, tmp_path, shared_dirs
):
    python, command = str(venv / "bin" / "python"), str(venv / "bin" / "jssl")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(
        [python, "-c", "import jssl, jssl.cli; print(jssl.__file__)"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == os.path.join(REPO, "jssl", "__init__.py")

    data_dir, cache_dir = shared_dirs
    workdir = tmp_path / "run"
    (elsewhere / "my_moco.py").write_text(OWN_CONFIG)
    result = subprocess.run(
        [
            command,
            "--config=my_moco.py:test",
            f"--workdir={workdir}",
            f"--config.data.data_dir={data_dir}",
            "--config.debug.max_steps=2",
        ],
        cwd=elsewhere,
        env=launch_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert os.path.isdir(workdir / "checkpoints" / "2")


def test_the_wheel_ships_the_configs_recipes(tmp_path):
    """A regular (not editable) install holds configs/ beside jssl/, so that a config file
    anywhere can ``from configs import base``. Built from a copy of the sources: a build in
    the checkout would reuse its build/ folder, whatever pyproject.toml now says."""
    source = tmp_path / "source"
    for folder in ("jssl", "configs"):
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(os.path.join(REPO, folder), source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), source / name)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = glob.glob(str(tmp_path / "jssl-*.whl"))
    shipped = set(zipfile.ZipFile(wheel).namelist())
    recipes = {f"configs/{os.path.basename(p)}" for p in glob.glob(f"{REPO}/configs/*.py")}
    assert {"configs/__init__.py", "configs/base.py", "configs/recipes.py"} <= recipes
    assert recipes <= shipped, sorted(recipes - shipped)
    assert "jssl/cli.py" in shipped


@pytest.mark.parametrize(
    "imports, fix",
    [
        ("from configs import mine", "The configs package found is jssl's recipes in"),
        ("import configs.mine", "The configs package found is jssl's recipes in"),
        ("import my_helpers", "Install the module it imports, or add its folder to PYTHONPATH"),
    ],
)
def test_a_config_importing_what_python_cannot_find_says_what_to_do(tmp_path, imports, fix):
    path = tmp_path / "own.py"
    path.write_text(f"{imports}\n\n\ndef get_config():\n    return None\n")
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values)
    with pytest.raises(cli.ConfigImportError) as raised:
        cli.parse_flags(["jssl", f"--config={path}"], flag_values)
    assert str(raised.value).startswith(f"The config file {path} cannot be loaded: ")
    assert fix in str(raised.value)
