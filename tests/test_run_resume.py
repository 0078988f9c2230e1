"""`unison.Run` resumes to the uninterrupted weights, under the real launcher (issue 29's proofs):

- nanoGPT's port (examples/nanogpt/train.py, run unchanged) with a rank SIGKILLed mid-run under
  `--max-restarts 1` ends on the uninterrupted run's weights and loss curve, bit for bit;
- `Run(shard=True)` (FSDP2, torch.distributed.checkpoint) killed mid-epoch and resumed ends on the
  plain one-process loop's weights;
- a checkpoint written on 2 processes resumes on 1, and one written on 1 resumes on 2, at the same
  global batch, to the plain loop's weights (float64: the summation order of 1 and 2 processes
  differs, within the 1e-9 of tests/test_run.py).

The plain loop and the own-loop script are tests/test_run_launch.py's (tests/fault_scripts/own_loop.py).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.hangs import run_or_report
from tests.test_run_launch import SCRIPT, TOL, final_diff
from unison import Run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
NANOGPT = ROOT / "examples" / "nanogpt" / "train.py"
KILLED_NANOGPT = ROOT / "tests" / "fault_scripts" / "nanogpt_killed.py"
TIMEOUT_S = 300  # a launch on a loaded 2-core machine; seconds when quiet


def run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_or_report(cmd, TIMEOUT_S, cwd=cwd)


def unison_launch(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "unison.launch", "--nproc", str(nproc), *args]


# ---- nanoGPT: a SIGKILL under --max-restarts 1 --------------------------------------------------
# 6 iterations of 2 accumulated micro-batches of 8 windows per rank; a checkpoint every 2 iterations
# (examples/nanogpt/train.py: every eval_interval); rank 1 dies right after iteration 3's step, so the
# restarted job resumes from iteration 2 and redoes iteration 3.
NANOGPT_ARGS = ["--batch_size", "8", "--max_iters", "6", "--eval_interval", "2", "--eval_iters", "2"]


@pytest.mark.launch
@pytest.mark.timeout(900)
def test_nanogpt_port_sigkilled_with_max_restarts_1_ends_on_the_uninterrupted_weights(tmp_path: Path) -> None:
    whole = run(unison_launch(2, str(NANOGPT), *NANOGPT_ARGS, "--out_dir", "whole"), cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    # rank 0 alone writes the results (the port reads `run.is_main` before `run.setup`)
    assert "[rank0] final loss" in whole.stdout and "[rank1] final loss" not in whole.stdout, whole.stdout
    killed = run(
        unison_launch(2, "--max-restarts", "1", str(KILLED_NANOGPT), "--kill-rank", "1", "--kill-after", "3")
        + [*NANOGPT_ARGS, "--out_dir", "killed"],
        cwd=tmp_path,
    )
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "restart" in killed.stderr.lower(), killed.stderr[-3000:]  # it did die and come back
    expected = torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=True)["model"]
    got = torch.load(tmp_path / "killed" / "ckpt.pt", weights_only=True)["model"]
    assert expected.keys() == got.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected), {
        k: float((got[k] - expected[k]).abs().max()) for k in expected
    }
    curves = [json.loads((tmp_path / name / "losses.json").read_text()) for name in ("whole", "killed")]
    assert len(curves[0]) == 12 and curves[1] == curves[0]  # every micro-batch's loss, the redone ones once


# ---- FSDP2 and DCP -------------------------------------------------------------------------------
@pytest.mark.launch
def test_run_shard_true_killed_mid_epoch_resumes_from_dcp_to_the_plain_loops_weights(tmp_path: Path) -> None:
    proc = run(
        unison_launch(2, "--max-restarts", "1", str(SCRIPT), "--dir", str(tmp_path))
        + ["--bs", "8", "--shard", "--kill-rank", "1", "--at", "4"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restart" in proc.stderr.lower(), proc.stderr[-3000:]
    assert (tmp_path / "models" / "checkpoint.dcp" / ".metadata").exists()  # DCP, every rank its shards
    assert not (tmp_path / "models" / "checkpoint.pth").exists()
    assert final_diff(tmp_path) < TOL


# ---- another number of processes ----------------------------------------------------------------
@pytest.mark.launch
@pytest.mark.parametrize("before, after, sched", [(2, 1, False), (1, 2, False), (2, 1, True)])
def test_a_checkpoint_resumes_at_another_w_to_the_plain_loops_weights(
    tmp_path: Path, before, after, sched
) -> None:
    """Killed mid-epoch (step 4 of 6) on `before` processes, resumed on `after` at the same global batch
    of 16 (per process 16 / W): the plain one-process loop's weights (with its OneCycleLR: `sched`)."""

    def command(nproc: int, *extra: str) -> list[str]:
        where = ["--dir", str(tmp_path), "--bs", str(16 // nproc), *extra, *(["--sched"] if sched else [])]
        if nproc == 1:
            return [sys.executable, str(SCRIPT), *where]
        return unison_launch(nproc, str(SCRIPT), *where)

    killed = run(command(before, "--kill-rank", str(before - 1), "--at", "4"))
    assert killed.returncode != 0  # a lost process, and no restarts: the job ends
    assert (tmp_path / "models" / "checkpoint.pth").exists() and not (tmp_path / "final.pt").exists()
    resumed = run(command(after))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "GlobalBatchChangedWarning" not in resumed.stderr  # the same global batch: no warning
    assert final_diff(tmp_path, sched) < TOL


# ---- where a process stands before setup --------------------------------------------------------
def _where_before_setup() -> tuple[int, int, bool]:
    run = Run()
    return run.rank, run.world_size, run.is_main


def test_rank_world_size_and_is_main_read_the_launch_before_setup(pool2) -> None:
    """nanoGPT's `master_process = run.is_main` comes before `run.setup`: it was True on every rank,
    and both ranks wrote ckpt.pt to the same file at the same time."""
    assert pool2.run(_where_before_setup) == [(0, 2, True), (1, 2, False)]
