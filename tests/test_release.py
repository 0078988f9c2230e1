"""What a release needs: one version, the license and changelog beside the code, `python -m unison`."""

import importlib.metadata
import runpy
import sys
from pathlib import Path

import pytest

import unison

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent


def test_the_version_is_written_once():
    assert importlib.metadata.version("unison") == unison.__version__
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]


def test_license_changelog_and_typing_marker_are_there():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert (
        "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    )
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## Unreleased" in changelog and f"## {unison.__version__}" in changelog
    assert (ROOT / "src" / "unison" / "py.typed").exists()
    assert project["requires-python"] and project["authors"] and project["classifiers"]
    # no extra that exists for one machine's sake: the fastai workaround lives in the Makefile
    assert "fastai-core" not in project["optional-dependencies"]


@pytest.mark.parametrize(
    "argv", [["--help"], ["launch", "--help"], ["check-exact", "--help"], ["lighthouse", "--help"]]
)
def test_python_dash_m_unison_runs_every_subcommand(argv, monkeypatch, capsys):
    """`python -m unison ...` is `unison ...` (for a PATH where another `unison` comes first)."""
    monkeypatch.setattr(sys, "argv", ["unison", *argv])
    with pytest.raises(SystemExit) as ended:
        runpy.run_module("unison", run_name="__main__", alter_sys=False)
    assert ended.value.code in (0, None)
    assert "usage" in capsys.readouterr().out.lower()
