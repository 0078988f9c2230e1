"""The examples run as a user runs them, and reach what they promise."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.procs
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


@pytest.mark.launch
def test_make_demo_trains_on_one_then_two_processes_and_they_agree(tmp_path):
    """`make demo`: the same file on 1 process and under `unison launch --nproc 2` (half the
    per-process batch: the same global batch), compared on weights, loss curve and accuracy."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "they agree" in proc.stdout
    two = proc.stdout.split("=== 2 processes", 1)[1]
    accuracies = re.findall(r"valid_accuracy (\d\.\d+)", two)
    assert len(accuracies) == 1  # one voice: rank 0 reports, once
    assert float(accuracies[0]) >= 0.95
    assert two.count("train_loss") == 1  # one table header
    # independent of the demo's own comparison: the two saved models, read here
    one_w, two_w = (
        torch.load(tmp_path / "runs" / "demo" / run / "models" / "digits.pth", weights_only=True)["model"]
        for run in ("one", "two")
    )
    assert max(float((one_w[k].float() - two_w[k].float()).abs().max()) for k in one_w) < 1e-4
    assert (tmp_path / "runs" / "demo" / "agree.png").read_bytes()[:4] == b"\x89PNG"
