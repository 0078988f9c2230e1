"""`python -m build` makes a wheel and an sdist that install into a fresh virtual environment and
run the README's training script there: what a user who installs a release gets.

Offline and quick: the build runs without isolation (the test extra has `build`, and setuptools is
in the project's environment), each fresh environment sees the project environment's packages
(torch, numpy) through a `.pth` file placed after its own site-packages, and pip installs unison
alone into it (`--no-deps --no-index`), so the unison that runs is the one from the wheel or the
sdist, not the checkout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import unison

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]


def readme_script() -> str:
    text = (ROOT / "README.md").read_text()
    return re.search(r"## A training script\n\n```python\n(.*?)```", text, re.DOTALL).group(1)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    pytest.importorskip("build")
    source = tmp_path_factory.mktemp("source")
    # a clean copy of what the sdist takes (no .venv, build outputs or caches)
    for name in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def fresh_env(folder: Path) -> Path:
    """A new virtual environment that sees this one's packages after its own; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = folder / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    # appended to sys.path after the environment's own site-packages: the installed unison wins
    Path(site, "project_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def install_and_run(package: Path, folder: Path) -> str:
    python = fresh_env(folder / "env")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            str(package),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    work = folder / "work"
    work.mkdir()
    (work / "train.py").write_text(
        readme_script() + "\nimport unison, importlib.metadata\n"
        "print('FROM', unison.__file__, unison.__version__, importlib.metadata.version('unison'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # a plain subprocess: the fresh environment's own interpreter, never the suite's warm one
    ran = subprocess.run(
        [str(python), "train.py"], capture_output=True, text=True, timeout=300, cwd=work, env=env
    )
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    assert (work / "models" / "model.pth").exists()
    found = re.search(r"^FROM (\S+) (\S+) (\S+)$", ran.stdout, re.MULTILINE)
    assert found, ran.stdout[-2000:]
    assert Path(found.group(1)).is_relative_to(folder / "env"), found.group(1)  # not the checkout's
    assert found.group(2) == found.group(3) == unison.__version__
    helped = subprocess.run(
        [str(python), "-m", "unison", "--help"], capture_output=True, text=True, timeout=120
    )
    assert helped.returncode == 0 and "launch" in helped.stdout, helped.stderr
    return found.group(1)


def test_the_wheel_holds_the_package_its_license_and_typing_marker(dist):
    (wheel,) = dist.glob("unison-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "unison/py.typed" in names and "unison/__main__.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names[-10:]
    metadata = (
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    )
    assert f"Version: {unison.__version__}" in metadata and "License-Expression: Apache-2.0" in metadata
    (sdist,) = dist.glob("unison-*.tar.gz")
    members = tarfile.open(sdist).getnames()
    assert any(m.endswith("/LICENSE") for m in members) and any(
        m.endswith("/unison/py.typed") for m in members
    )


def test_the_wheel_installs_and_runs_the_readme_script(dist, tmp_path):
    (wheel,) = dist.glob("unison-*.whl")
    install_and_run(wheel, tmp_path)


def test_the_sdist_installs_and_runs_the_readme_script(dist, tmp_path):
    (sdist,) = dist.glob("unison-*.tar.gz")
    install_and_run(sdist, tmp_path)
