"""The examples run as a user runs them, and reach what they promise."""

import re
import subprocess
import sys
from pathlib import Path

import torch

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
