"""examples/stream_digits.py runs as the README shows, and 2 processes equal one (workers: test_stream.py)."""

import re
import sys
from pathlib import Path

import pytest

from tests.hangs import run_or_report

pytestmark = pytest.mark.launch  # real processes

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLE = str(ROOT / "examples" / "stream_digits.py")


def _accuracy(cmd, cwd):
    proc = run_or_report(cmd, 240, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"valid_accuracy (\d\.\d+)", proc.stdout)
    assert len(found) == 1, proc.stdout  # rank 0 reports, once
    return float(found[0])


def test_stream_example_on_one_and_two_processes(tmp_path):
    one = _accuracy([sys.executable, EXAMPLE, "--out", str(tmp_path / "one")], tmp_path)
    launch = [sys.executable, "-m", "unison.launch", "--nproc", "2", EXAMPLE]
    two = _accuracy([*launch, "--out", str(tmp_path / "two"), "--bs", "32"], tmp_path)
    assert one >= 0.85
    assert two == one  # the same global batches: the same weights, the same accuracy
