"""The installable package: ``pip install -e .`` gives ``import jssl`` from any directory and a
``jssl`` command equal to ``python launch.py``; pyproject.toml pins what requirements.txt pins."""

import os
import re
import subprocess
import sys
import tomllib

import pytest
from support.launch import REPO, launch_env

from jssl import cli


def _pins(lines) -> list[str]:
    return sorted(
        re.sub(r"\s+", "", line.split("#")[0]) for line in lines if line.split("#")[0].strip()
    )


def test_pyproject_dependencies_are_requirements_txt():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    with open(os.path.join(REPO, "requirements.txt")) as f:
        assert _pins(project["dependencies"]) == _pins(f)
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
    result = subprocess.run(
        [
            command,
            f"--config={REPO}/configs/moco.py:test",
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
