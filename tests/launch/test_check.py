"""`unison check-exact`: a script's first steps on 1 and on W processes, compared.

The fast tests check the option handling and the comparison on records made here. The slow
ones run the real command (real launches, real gloo groups) on the digits example, which must
agree to float noise, and on a script whose loss depends on the rank, which must be reported as
diverging, naming the parameter, by the amount the gradient's arithmetic predicts.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hangs import run_or_report
from unison.check.report import describe
from unison.check.runs import CheckError, compare, global_batch, main, preflight, scale_batch_arg, verdict

ROOT = Path(__file__).resolve().parents[2]
CHECK = [sys.executable, "-m", "unison.cli", "check-exact"]

# A regression whose loss on rank r has an extra PUSH * r * (sum of the output bias): with one
# process there is no rank 1, so only the 2-process run pushes that bias.
PUSH_SCRIPT = """
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import DataLoaders, Learner, set_seed
from unison.distributed import num_distrib, rank_distrib

parser = argparse.ArgumentParser()
parser.add_argument("--push", type=float, default=0.0)
parser.add_argument("--fixed-bs", action="store_true", help="16 per process, whatever their number")
args = parser.parse_args()

set_seed(0)
x, y = torch.randn(64, 4), torch.randn(64, 1)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def loss_func(pred, target):
    return nn.functional.mse_loss(pred, target) + args.push * rank_distrib() * model[2].bias.sum()


bs = 16 if args.fixed_bs else 16 // num_distrib()  # the global batch: 16
ds = TensorDataset(x, y)
dls = DataLoaders(DataLoader(ds, batch_size=bs), DataLoader(ds, batch_size=32))
learn = Learner(dls, model, loss_func, opt_func=torch.optim.SGD, lr=0.1)
with learn.distrib_ctx():
    learn.fit(2)
"""


# ---- options ----------------------------------------------------------------------------------
def test_batch_arg_divides_the_per_process_batch() -> None:
    assert scale_batch_arg(["--bs", "64", "--epochs", "1"], "bs", 2) == ["--bs", "32", "--epochs", "1"]
    assert scale_batch_arg(["--epochs", "1", "--bs=96"], "--bs", 3) == ["--epochs", "1", "--bs=32"]
    with pytest.raises(CheckError, match="a batch of 10 does not split evenly over 3 processes"):
        scale_batch_arg(["--bs", "10"], "bs", 3)
    with pytest.raises(CheckError, match="have no --bs"):
        scale_batch_arg(["--lr", "0.1"], "bs", 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "1", "x.py"], "--nproc must be at least 2"),
        (["--steps", "0", "x.py"], "--steps must be at least 1"),
        (["no_such_script.py"], "no such script: no_such_script.py"),
    ],
)
def test_bad_options_are_refused_before_any_run(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "x.py").write_text("")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert main(argv) == 2
    assert message in capsys.readouterr().err


# ---- the comparison -----------------------------------------------------------------------------
def record(weights: dict[str, list[float]], losses: list[float], values: list[float]) -> dict[str, Any]:
    """A probe record as a run writes it (float64 tensors, so the differences below are exact)."""
    tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in weights.items()}
    return {
        "weights": tensors,
        "losses": losses,
        "metric_names": ["train_loss", "valid_loss", "accuracy"],
        "values": [values],
    }


def test_compare_measures_weights_losses_and_metrics() -> None:
    one = record({"a": [1.0, -4.0], "b": [0.5], "c": [0.0]}, [2.0, 1.5], [1.4, 1.2, 0.5])
    many = record({"a": [1.0, -4.25], "b": [0.5], "c": [0.0]}, [2.0, 1.5 + 2**-10], [1.4, 1.2, 0.75])
    cmp = compare(one, many)
    assert cmp.weights[0] == ("a", 0.25, 0.25 / 4.25)  # relative to the tensor's largest entry
    assert {name: d for name, d, _ in cmp.weights[1:]} == {"b": 0.0, "c": 0.0}
    assert cmp.losses == [(1, 2.0, 2.0, 0.0), (2, 1.5, 1.5 + 2**-10, 2**-10)]
    assert cmp.metrics[-1] == ("accuracy", 0.5, 0.75, 0.25)
    assert cmp.max_rel == 0.25 / 4.25 and cmp.max_rel_metric == 0.25 / 0.75
    status, line = verdict(cmp, None, 2, None)
    assert status == 1 and line.startswith("DIFFERS") and "most in a." in line
    status, line = verdict(cmp, cmp, 2, None)
    assert status == 1 and line.startswith("DIVERGES") and line.endswith("Diverging: a")
    same = compare(one, one)
    assert same.max_rel == 0.0 and verdict(cmp, same, 2, None)[0] == 0


def test_nans_compare_equal_only_to_nans() -> None:
    one = record({"w": [math.nan, math.inf, 1.0]}, [math.nan], [1.0, 1.0, 1.0])
    assert compare(one, one).weights[0][1] == 0.0
    assert math.isnan(compare(one, one).losses[0][3])  # neither run has a loss there: not compared
    other = record({"w": [0.0, math.inf, 1.0]}, [1.0], [1.0, 1.0, 1.0])
    assert compare(one, other).weights[0][1] == math.inf
    assert compare(one, other).losses[0][3] == math.inf


def test_a_value_neither_run_recorded_is_not_compared() -> None:
    """A validation loss neither run recorded (an evaluation that does not go through run.loss) is
    NaN in both records: reported as not compared, never as an agreement."""
    one = record({"w": [1.0]}, [0.5], [0.5, math.nan, 1.0])
    cmp = compare(one, one)
    assert cmp.not_compared == ["valid_loss"] and cmp.max_rel_metric == 0.0
    assert "valid_loss not compared (neither run recorded it)" in "\n".join(describe(cmp, 2, "float64", 1e-8))
    assert verdict(None, cmp, 2, None)[0] == 0  # judged on what was compared


def test_a_float32_loss_inside_a_float64_run_is_judged_by_the_weights() -> None:
    """fastai's CrossEntropyLossFlat computes in float32 whatever the model's dtype: in a float64 run
    the per-batch losses agree only to float32 rounding (4e-8 here) while the weights agree to 7e-15.
    That is float noise, not a divergence; the weights decide."""
    one = record({"w": [1.0]}, [0.5, 0.4], [0.5, 0.4, 1.0])
    many = record({"w": [1.0 + 7e-15]}, [0.5, 0.4 * (1 + 4e-8)], [0.5, 0.4, 1.0])
    for r in (one, many):
        r.update(float64=True, loss_float64=False)
    cmp = compare(one, many)
    status, line = verdict(None, cmp, 2, None)
    assert status == 0, line
    assert "losses to 4.0e-08 (<= 1e-05: the loss function computes in float32)" in line
    assert "computed in float32 by the loss function" in "\n".join(describe(cmp, 2, "float64", 1e-8))
    many["losses"][1] = 0.4 * (1 + 3e-4)  # beyond float32's rounding: still a difference
    assert verdict(None, compare(one, many), 2, None)[0] == 1
    for r in (one, many):
        r["loss_float64"] = True  # a float64 loss: judged at float64's tolerance, as before
    assert verdict(None, compare(one, many), 2, None)[0] == 1


def test_the_global_batch_is_named_with_its_accumulated_batches() -> None:
    assert (
        global_batch({"batch_size": 32, "accumulate": 2}) == ", global batch 64 (2 accumulated batches of 32)"
    )
    assert global_batch({"batch_size": 32}) == ", global batch 32"


def test_runs_that_were_not_set_up_alike_are_refused() -> None:
    def run(world: int, bs: int, start: float, steps: int = 3) -> dict[str, Any]:
        prints = {"w": torch.tensor([start, abs(start), start * start], dtype=torch.float64)}
        return {"world_size": world, "batch_size": bs, "steps": steps, "initial": prints}

    preflight(run(1, 32, 0.5), run(2, 16, 0.5), 2, None)  # alike: nothing to say
    with pytest.raises(CheckError, match="trained on 1 and 1 process"):
        preflight(run(1, 32, 0.5), run(1, 16, 0.5), 2, None)  # no distrib_ctx in the script
    with pytest.raises(CheckError, match="batches of 32, 2 processes on 2 x 32 = 64"):
        preflight(run(1, 32, 0.5), run(2, 32, 0.5), 2, None)
    with pytest.raises(CheckError, match="took 3 and 2 optimizer steps"):
        preflight(run(1, 32, 0.5), run(2, 16, 0.5, steps=2), 2, None)
    with pytest.raises(CheckError, match=r"started from different weights \(w\): seed the script"):
        preflight(run(1, 32, 0.5), run(2, 16, 0.25), 2, None)


# ---- real runs ------------------------------------------------------------------------------------
def check_exact(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return run_or_report([*CHECK, *args], timeout, cwd=cwd)


def reported(out: str, dtype: str) -> float:
    """The `weights: max |dw| X` figure of the report's `dtype` section."""
    section = out.split(f"\n{dtype}", 1)[1]
    return float(re.search(r"weights: max \|dw\| (\S+);", section).group(1))


def max_dw(keep: Path, dtype: str, nproc: int = 2) -> tuple[float, dict[str, float]]:
    """Recomputed here from the two runs' records: the largest |dw| and each tensor's."""
    one = torch.load(keep / f"1p-{dtype}.pt", weights_only=True)["weights"]
    many = torch.load(keep / f"{nproc}p-{dtype}.pt", weights_only=True)["weights"]
    each = {k: float((one[k].double() - many[k].double()).abs().max()) for k in one}
    return max(each.values()), each


@pytest.mark.launch
@pytest.mark.timeout(360)
def test_the_digits_example_is_exact_on_1_and_2_processes(tmp_path: Path) -> None:
    """examples/train_digits.py (BatchNorm CNN, one-cycle AdamW): float32 rounding, float64 agrees."""
    keep = tmp_path / "keep"
    script = str(ROOT / "examples" / "train_digits.py")
    args = ["--nproc", "2", "--steps", "3", "--float64", "--batch-arg", "bs", "--keep", str(keep)]
    proc = check_exact([*args, script, "--bs", "64", "--epochs", "1", "--out", "out"], tmp_path, 330)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compared after 3 optimizer step(s), global batch 64" in proc.stdout
    assert "verdict: exact to float noise: in float64, 2 processes agree with 1" in proc.stdout
    worst32, _ = max_dw(keep, "float32")
    worst64, _ = max_dw(keep, "float64")
    assert 0 < worst32 < 1e-5  # float32 rounding of another summation order
    assert worst64 < 1e-13
    assert reported(proc.stdout, "float32") == pytest.approx(worst32, rel=1e-2)
    assert reported(proc.stdout, "float64") == pytest.approx(worst64, rel=1e-2)
    assert not (tmp_path / "out" / "models").exists()  # the script stopped after the probed fit


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_a_rank_dependent_loss_diverges_naming_the_parameter(tmp_path: Path) -> None:
    """Rank 1 adds PUSH * sum(output bias) to its loss. After one SGD step the 2-process bias is
    off by lr * PUSH * (rank 1's share of the global batch) = 0.1 * 0.01 * 8/16, every other
    tensor equal: float64 shows exactly that, and the check names `2.bias`. (`--float64-only`: the
    two float64 runs alone, as `make demo` asks where its float32 runs differed.)"""
    script = tmp_path / "push.py"
    script.write_text(PUSH_SCRIPT)
    keep = tmp_path / "keep"
    args = ["--nproc", "2", "--steps", "1", "--float64-only", "--keep", str(keep)]
    args += [str(script), "--push", "0.01"]
    proc = check_exact(args, tmp_path, 270)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert sorted(p.name for p in keep.glob("*.pt")) == ["1p-float64.pt", "2p-float64.pt"]
    assert "float32 (as the script runs)" not in proc.stdout and "float64:" in proc.stdout
    expected = 0.1 * 0.01 * 8 / 16
    _, each = max_dw(keep, "float64")
    assert each.pop("2.bias") == pytest.approx(expected, abs=1e-15)
    assert max(each.values()) < 1e-15
    assert reported(proc.stdout, "float64") == pytest.approx(expected, rel=1e-2)
    verdict_line = proc.stdout.strip().splitlines()[-1]
    assert verdict_line.startswith("verdict: DIVERGES: in float64, 2 processes differ from 1")
    assert verdict_line.endswith("Diverging: 2.bias")


@pytest.mark.launch
@pytest.mark.timeout(200)
def test_a_script_that_keeps_its_per_process_batch_is_refused(tmp_path: Path) -> None:
    """16 per process on 1 and on 2 processes: the global batches differ (16 and 32), no verdict."""
    script = tmp_path / "push.py"
    script.write_text(PUSH_SCRIPT)
    proc = check_exact(["--nproc", "2", "--steps", "1", str(script), "--fixed-bs"], tmp_path, 170)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the global batch differs: 1 process trained on batches of 16, 2 processes on 2 x 16 = 32" in (
        proc.stderr
    )
    assert "verdict" not in proc.stdout


def test_the_verdict_states_the_tolerance_each_figure_is_judged_at() -> None:
    """float64 runs whose weights agree to 1e-12 and whose epoch values (reduced in float32 by unison)
    agree to 6.2e-8: the line said "(<= 1e-08), metrics to 6.2e-08" and "exact" beside it. Each
    figure now comes with the bound it is judged at, and a metric beyond its bound is named as such."""
    one = record({"w": [1.0]}, [0.5], [0.5, 0.4, 1.0])
    close = record({"w": [1.0 + 1e-12]}, [0.5], [0.5, 0.4 * (1 + 6.2e-8), 1.0])
    status, line = verdict(compare(one, one), compare(one, close), 2, None)
    assert status == 0, line
    assert (
        "agree with 1 to 1.0e-12 relative (<= 1e-08), metrics to 6.2e-08 (<= 1e-05: unison reduces " in line
    )
    far = record({"w": [1.0 + 1e-12]}, [0.5], [0.5, 0.4 * (1 + 3e-5), 1.0])
    status, line = verdict(compare(one, one), compare(one, far), 2, None)
    assert status == 1, line
    assert "differ from 1 by 1.0e-12 relative (<= 1e-08), metrics to 3.0e-05 (> 1e-05: unison" in line
    status, line = verdict(compare(one, close), None, 2, None)  # float32 alone: one tolerance for both
    assert status == 0 and "differ by 1.0e-12 relative (<= 1e-05), metrics to 6.2e-08 (<= 1e-05);" in line


def test_a_gradient_of_rounding_noise_is_named_as_the_likely_cause() -> None:
    """Per-parameter gradient sizes (relative to the model's largest) as the probe records them, with
    the figures measured on a Linear bias before a BatchNorm: 8.5e-17 and 7.3e-17 in float64."""
    from unison.check.runs import noise_hint, rounding_noise_gradients

    runs = [
        {"float64": True, "grad_ratio": {"0.weight": 0.55, "0.bias": 8.5e-17, "3.bias": 1e-9}},
        {"float64": True, "grad_ratio": {"0.weight": 0.55, "0.bias": 7.3e-17, "3.bias": 1e-9}},
    ]
    assert rounding_noise_gradients(runs) == {"0.bias": 8.5e-17}  # 1e-9 is a small real gradient
    as32 = [{**r, "float64": False} for r in runs]  # float32's epsilon is 1.2e-7: 1e-9 is noise there
    assert rounding_noise_gradients(as32) == {"0.bias": 8.5e-17, "3.bias": 1e-9}
    assert rounding_noise_gradients([runs[0], {"float64": True, "grad_ratio": {"0.bias": 0.1}}]) == {}
    line = noise_hint({"0.bias": 8.5e-17}, ["0.bias", "1.running_mean", "0.bias"], "float64")
    assert line.startswith("hint: 0.bias's gradient is zero but for rounding (at most 8.5e-17 of the ")
    assert "bias=False" in line and "\n" not in line
    assert noise_hint({"0.bias": 8.5e-17}, ["3.weight"], "float64") is None  # not among the differing


# A Linear with a bias before a BatchNorm, under AdamW: that bias's gradient is float noise.
BIAS_BEFORE_NORM = """
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import DataLoaders, Learner, set_seed
from unison.distributed import num_distrib

set_seed(0)
x = torch.randn(256, 8)
y = (x[:, 0] > 0).long()
ds = TensorDataset(x, y)
dls = DataLoaders(DataLoader(ds, batch_size=64 // num_distrib(), shuffle=True), DataLoader(ds, batch_size=64))
model = nn.Sequential(nn.Linear(8, 16, bias="--no-bias" not in sys.argv), nn.BatchNorm1d(16), nn.ReLU(),
                      nn.Linear(16, 2))
learn = Learner(dls, model, nn.CrossEntropyLoss(), lr=1e-2)  # AdamW, the default
with learn.distrib_ctx():
    learn.fit(2)
"""


@pytest.mark.launch
@pytest.mark.timeout(400)
def test_a_bias_before_a_batchnorm_is_named_as_the_cause_of_the_difference(tmp_path: Path) -> None:
    """The README's old example in small: float32 differs (AdamW's steps on the bias's noise), float64
    agrees, and the check names `0.bias` as the likely cause; without the bias there is no hint."""
    script = tmp_path / "bias.py"
    script.write_text(BIAS_BEFORE_NORM)
    keep = tmp_path / "keep"
    args = ["--nproc", "2", "--steps", "4", "--float64", "--keep", str(keep), str(script)]
    proc = check_exact(args, tmp_path, 370)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _, each32 = max_dw(keep, "float32")
    assert max(each32, key=each32.get) == "0.bias" and each32["0.bias"] > 1e-4  # far past rounding
    hints = [line for line in proc.stdout.splitlines() if line.startswith("hint:")]
    assert len(hints) == 1 and hints[0].startswith("hint: 0.bias's gradient is zero but for rounding"), (
        proc.stdout
    )
    ratios = torch.load(keep / "1p-float64.pt", weights_only=True)["grad_ratio"]
    assert ratios["0.bias"] < 1e-14 < 1e-3 < ratios["0.weight"]  # noise against a real gradient
    proc = check_exact([*args[:-1], str(script), "--no-bias"], tmp_path, 370)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hint:" not in proc.stdout


@pytest.mark.launch
@pytest.mark.timeout(400)
def test_check_exact_on_a_finished_runs_folder_trains_from_scratch_and_leaves_its_checkpoint(
    tmp_path: Path,
) -> None:
    """An own loop with `resume=True` whose run finished: its checkpoint is at the end, and check-exact
    compared 0 steps and called it exact. Each run now starts from scratch (a fresh checkpoint folder
    beside its record) and the script's checkpoint is left as it was."""
    script = ROOT / "tests" / "fault_scripts" / "own_loop.py"
    done = run_or_report([sys.executable, str(script), "--dir", str(tmp_path), "--bs", "16", "--sched"], 200)
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = tmp_path / "models" / "checkpoint.pth"
    before = ckpt.read_bytes()
    args = ["--nproc", "2", "--steps", "3", "--float64-only", "--batch-arg", "bs", str(script)]
    proc = check_exact([*args, "--dir", str(tmp_path), "--bs", "16", "--sched"], tmp_path, 300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compared after 3 optimizer step(s), global batch 16" in proc.stdout, proc.stdout
    assert "verdict: exact to float noise" in proc.stdout
    assert ckpt.read_bytes() == before


@pytest.mark.launch
@pytest.mark.timeout(400)
def test_a_float32_loss_in_a_stock_fastai_script_is_exact_in_float64(tmp_path: Path) -> None:
    """fastai's CrossEntropyLossFlat computes in float32 whatever the model's dtype: check-exact
    --float64 said DIVERGES (losses 1.5e-7 apart) while the weights agreed to 1.6e-15."""
    pytest.importorskip("fastai")
    script = tmp_path / "stock.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "from fastai.tabular.all import CrossEntropyLossFlat, num_distrib\n"
        "import fastai_bridge\n"
        "from unison.fastai import distrib_ctx\n"
        "learn = fastai_bridge.build(64 // max(1, num_distrib()))\n"
        "learn.loss_func = CrossEntropyLossFlat()\n"
        "with distrib_ctx(learn):\n"
        "    learn.fit_one_cycle(1, 1e-2)\n"
    )
    proc = check_exact(["--nproc", "2", "--steps", "4", "--float64-only", str(script)], tmp_path, 360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "computed in float32 by the loss function" in proc.stdout
    assert (
        "verdict: exact to float noise" in proc.stdout
        and "the loss function computes in float32" in proc.stdout
    )


@pytest.mark.launch
@pytest.mark.timeout(500)
def test_check_exact_names_the_global_batch_and_steps_under_accumulation(tmp_path: Path) -> None:
    """nanoGPT's port (`Run(accumulate=2)`, an evaluation not through run.loss): 3 optimizer steps of 2
    accumulated batches of 16 windows (it said "global batch 16" and counted batches as steps), and
    the valid_loss neither run recorded is not compared (it counted NaN vs NaN as agreeing)."""
    script = ROOT / "examples" / "nanogpt" / "train.py"
    args = ["--nproc", "2", "--steps", "3", "--float64-only", "--batch-arg", "batch_size", str(script)]
    args += ["--batch_size", "16", "--max_iters", "6", "--eval_interval", "100", "--eval_iters", "2"]
    proc = check_exact([*args, "--out_dir", str(tmp_path / "out")], tmp_path, 450)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compared after 3 optimizer step(s), global batch 32 (2 accumulated batches of 16)" in proc.stdout
    assert "losses (6 training batches)" in proc.stdout
    assert "valid_loss not compared (neither run recorded it)" in proc.stdout
