"""The examples run as a user runs them, and reach what they promise."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.hangs import run_or_report

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`make demo` (examples/demo.py) at 3 epochs of its 8 (99% accuracy already), run once: its first
    part is examples/train_digits.py on one process as a user runs it (`--out runs/demo/one`, the
    default batch 64), its second the same file under `unison launch --nproc 2`. Two tests read it."""
    folder = tmp_path_factory.mktemp("demo")
    proc = run_or_report(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--epochs", "3"], 240, cwd=folder
    )
    return proc, folder


@pytest.mark.launch
@pytest.mark.timeout(300)  # the demo runs in the first of its two tests
def test_train_digits_reaches_95_percent(demo: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, folder = demo
    assert "=== 1 process: " in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    one = proc.stdout.split("=== 1 process: ", 1)[1].split("=== 2 processes", 1)[0]
    assert one.split("\n", 1)[0].endswith("train_digits.py --bs 64 --epochs 3"), one[:300]
    found = re.search(r"^valid_accuracy (\d\.\d+)$", one, re.MULTILINE)
    assert found, one + proc.stderr[-3000:]
    assert float(found.group(1)) >= 0.95
    assert re.search(r"^valid_loss \d+\.\d+$", one, re.MULTILINE)
    out = folder / "runs" / "demo" / "one"
    png = out / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    state = torch.load(out / "models" / "digits.pth", weights_only=True)
    assert state["model"]["3.weight"].shape == (10, 256)
    assert not (folder / "models").exists()  # everything went under --out


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_make_demo_trains_on_one_then_two_processes_and_they_agree(
    demo: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """`make demo`: the same file on 1 process and under `unison launch --nproc 2` (half the
    per-process batch: the same global batch), compared on weights, loss curve and accuracy."""
    proc, tmp_path = demo
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "they agree" in proc.stdout
    two = proc.stdout.split("=== 2 processes", 1)[1].split("=== 1 process against 2", 1)[0]
    accuracies = re.findall(r"valid_accuracy (\d\.\d+)", two)
    assert len(accuracies) == 1  # one voice: rank 0 reports, once
    assert float(accuracies[0]) >= 0.95
    assert two.count("train_loss") == 1  # one table header
    # independent of the demo's own comparison: the two saved models, read here
    one_w, two_w = (
        torch.load(tmp_path / "runs" / "demo" / run / "models" / "digits.pth", weights_only=True)["model"]
        for run in ("one", "two")
    )
    gap32 = max(float((one_w[k].float() - two_w[k].float()).abs().max()) for k in one_w)
    if gap32 >= 1e-4:
        # float32's rounding grew past 1e-4 (on 2026-11-27's CPU, an AVX-512 AMD EPYC, 3 epochs gave
        # 7e-4 after a jump at step 26; 8 epochs 2.4e-7): the demo then ran the same steps in
        # float64, which must agree to rounding, read here from its records.
        assert "=== float32 differs by more than 1e-4" in proc.stdout
        assert "verdict: exact to float noise" in proc.stdout
        records = tmp_path / "runs" / "demo" / "check" / "records"
        one64, two64 = (torch.load(records / f"{n}p-float64.pt", weights_only=True) for n in (1, 2))
        assert one64["weights"].keys() == one_w.keys() and one64["steps"] == two64["steps"] == 69
        assert max(float((one64["weights"][k] - two64["weights"][k]).abs().max()) for k in one_w) < 1e-10
    assert (tmp_path / "runs" / "demo" / "agree.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.launch
@pytest.mark.timeout(600)
def test_the_own_loop_example_passes_check_exact_on_2_processes(tmp_path):
    """examples/own_loop.py (digits CNN, BatchNorm, AdamW, written on `unison.Run`): `unison check-exact`
    runs 3 steps on 1 process at batch 64 and on 2 at batch 32; float64 agrees to rounding."""
    cmd = [sys.executable, "-m", "unison.cli", "check-exact", "--nproc", "2", "--steps", "3", "--float64"]
    cmd += ["--batch-arg", "bs", str(ROOT / "examples" / "own_loop.py"), "--bs", "64", "--epochs", "1"]
    proc = run_or_report([*cmd, "--out", "out"], 540, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compared after 3 optimizer step(s), global batch 64" in proc.stdout
    assert "verdict: exact to float noise: in float64, 2 processes agree with 1" in proc.stdout
    worst = float(re.search(r"float64:\n  weights: max \|dw\| (\S+);", proc.stdout).group(1))
    # float64 rounding of another summation order, amplified by AdamW where a gradient is nearly
    # noise: 5.9e-12 in the conv before a BatchNorm (1.0.weight) in the loader's own shuffled order
    assert worst < 1e-10


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_the_no_trainer_evaluation_on_1001_items_equals_one_process(tmp_path):
    """examples/eval_no_trainer.py on 2 processes: unison's accuracy over 1,001 items at batch 16 is the
    one-process accuracy (the same count of correct items), the padded gather's counts 1,002 items."""
    script = ROOT / "examples" / "eval_no_trainer.py"
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", str(script)]
    proc = run_or_report(cmd, 280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    one = re.search(r"one process: accuracy (\S+) over 1001 items", out).group(1)
    assert re.search(rf"unison: accuracy {re.escape(one)} over 1001 items", out), out
    assert "padded: accuracy" in out and "over 1002 items" in out
    assert "unison equals one process: True" in out


@pytest.mark.launch
@pytest.mark.timeout(600)
def test_nanogpt_on_run_reproduces_one_process_loss_curve_on_two(tmp_path):
    """examples/nanogpt/train.py at a global batch of 16: 1 process (batch 16) and 2 (batch 8) train on
    the same windows, so their per-step losses over the global batch agree to float32 rounding."""
    script = str(ROOT / "examples" / "nanogpt" / "train.py")
    common = ["--max_iters", "4", "--eval_interval", "2", "--eval_iters", "2"]
    one = run_or_report(
        [sys.executable, script, "--batch_size", "16", "--out_dir", "one", *common], 280, cwd=tmp_path
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_or_report(
        [
            sys.executable,
            "-m",
            "unison.launch",
            "--nproc",
            "2",
            script,
            "--batch_size",
            "8",
            "--out_dir",
            "two",
            *common,
        ],
        280,
        cwd=tmp_path,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    curves = [json.loads((tmp_path / run / "losses.json").read_text()) for run in ("one", "two")]
    assert len(curves[0]) == len(curves[1]) == 8  # 4 steps of 2 accumulated batches
    assert max(abs(a - b) for a, b in zip(*curves, strict=True)) < 1e-5
    assert curves[0][-1] < curves[0][0]  # it learns
