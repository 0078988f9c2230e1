"""The examples run as a user runs them, and reach what they promise."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # real processes: launches, spawns, kills

ROOT = Path(__file__).resolve().parent.parent


def test_train_digits_reaches_95_percent(tmp_path):
    out = tmp_path / "digits"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_digits.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"^valid_accuracy (\d\.\d+)$", proc.stdout, re.MULTILINE)
    assert found, proc.stdout
    assert float(found.group(1)) >= 0.95
    assert re.search(r"^valid_loss \d+\.\d+$", proc.stdout, re.MULTILINE)
    png = out / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    state = torch.load(out / "models" / "digits.pth", weights_only=True)
    assert state["model"]["3.weight"].shape == (10, 256)
    assert not (tmp_path / "models").exists()  # everything went under --out


def test_train_digits_runs_unchanged_on_two_processes(tmp_path):
    """The same file under `unison launch --nproc 2` (half the per-process batch: the same global batch)."""
    out = tmp_path / "digits2"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "unison.launch",
            "--nproc",
            "2",
            str(ROOT / "examples" / "train_digits.py"),
            "--out",
            str(out),
            "--bs",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracies = re.findall(r"valid_accuracy (\d\.\d+)", proc.stdout)
    assert len(accuracies) == 1  # one voice: rank 0 reports, once
    assert float(accuracies[0]) >= 0.95
    assert proc.stdout.count("train_loss") == 1  # one table header
    assert (out / "loss.png").exists() and (out / "models" / "digits.pth").exists()
