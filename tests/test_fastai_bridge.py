"""The fastai bridge (`unison.fastai`): a stock fastai Learner, bridged on 2 processes, against fastai
itself on 1 process at the global batch (weights, losses, metrics, get_preds on an odd-sized
validation set), fastai's own order dealt across ranks, a NaN stopping every rank, a stalled rank
named, and examples/fastai_bridge.py passing `unison check-exact`."""

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastai.tabular.all", reason="fastai is not installed (make install puts it in)")

# pytest's default 120 s is short for fastai's launches on a loaded machine (each imports fastai and
# pandas); every subprocess below is bounded by its own timeout as well.
pytestmark = pytest.mark.timeout(480)

from fastai.tabular.all import DataLoader, set_seed  # noqa: E402

from tests.hangs import communicate_or_report, run_or_report  # noqa: E402
from unison.fastai import RankShardedFastaiDL  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "fastai_parity.py"
EXAMPLE = ROOT / "examples" / "fastai_bridge.py"
TOL = 1e-9  # float64 rounding, amplified by Adam over 2 epochs


def fastai_loader(bs: int, shuffle: bool, drop_last: bool, n: int = 103) -> DataLoader:
    set_seed(7)  # every rank builds its loaders after the same seed, as a fastai script does
    return DataLoader(list(range(n)), bs=bs, shuffle=shuffle, drop_last=drop_last)


@pytest.mark.parametrize("shuffle, drop_last", [(True, True), (True, False), (False, False)])
def test_ranks_together_deal_fastais_own_order_at_the_global_batch(shuffle: bool, drop_last: bool) -> None:
    """Step k of 2 ranks at batch 8 holds exactly fastai's own batch k at 16, epoch after epoch."""
    ranks = [RankShardedFastaiDL(fastai_loader(8, shuffle, drop_last), r, 2, pad=False) for r in range(2)]
    one = fastai_loader(16, shuffle, drop_last)
    for _ in range(2):  # two epochs: fastai's generator moves on alike
        expected = [b.tolist() for b in one]
        got = list(zip(*(iter(dl) for dl in ranks), strict=True))
        assert len(got) == len(expected) == len(ranks[0])
        for k, (b0, b1) in enumerate(got):
            real = [*b0.tolist()[: ranks[0].real_rows(k)], *b1.tolist()[: ranks[1].real_rows(k)]]
            assert sorted(real) == sorted(expected[k])
            assert ranks[0].global_rows(k) == len(expected[k])


def test_an_odd_validation_set_is_padded_and_the_padding_is_marked() -> None:
    """103 items over 2 ranks at batch 16: every item once among the real rows, the wrap marked."""
    ranks = [RankShardedFastaiDL(fastai_loader(16, False, False), r, 2, pad=True) for r in range(2)]
    seen = []
    for dl in ranks:
        for k, b in enumerate(dl):
            assert len(b) >= dl.real_rows(k)
            seen += b.tolist()[: dl.real_rows(k)]
        assert len(dl) == len(ranks[0])
    assert sorted(seen) == list(range(103))


def run(args: list[str], timeout: float = 240, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return run_or_report(args, timeout, env=env, cwd=cwd)


def launch2(*script_args: str, launch_args: tuple[str, ...] = (), cwd: Path | None = None):
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", *launch_args, str(SCRIPT), *script_args]
    return run(cmd, cwd=cwd)


def fastai_alone(out: Path, *args: str) -> Path:
    """fastai alone on one process, at the global batch (float64): the reference run, written to `out`."""
    plain = run([sys.executable, str(SCRIPT), "--plain", *args, "--out", str(out)], cwd=out.parent)
    assert plain.returncode == 0, plain.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def fastai_alone_adam(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted reference of the Adam runs below, made once: three tests read it."""
    return fastai_alone(tmp_path_factory.mktemp("fastai-alone") / "one.pt")


@pytest.fixture(scope="module")
def fastai_alone_sgd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fastai_alone(tmp_path_factory.mktemp("fastai-alone-sgd") / "one.pt", "--opt", "sgd")


@pytest.mark.launch
@pytest.mark.parametrize(
    "opt, reference",
    [pytest.param("adam", "fastai_alone_adam", id="adam"), pytest.param("sgd", "fastai_alone_sgd", id="sgd")],
)
def test_two_bridged_processes_train_as_fastai_alone_on_one(
    tmp_path: Path, opt: str, reference: str, request: pytest.FixtureRequest
) -> None:
    """fastai alone at batch 64 vs the same script bridged on 2 processes at 32 each (float64):
    the same weights, per-step losses, validation loss and accuracy over 201 rows (odd: one rank
    holds a padded row), and get_preds gives the 201 rows in order."""
    one, two = request.getfixturevalue(reference), tmp_path / "two.pt"
    bridged = launch2("--opt", opt, "--out", str(two))
    assert bridged.returncode == 0, bridged.stderr[-3000:]
    a, b = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    assert a["weights"].keys() == b["weights"].keys()
    diff = max(float((a["weights"][k].double() - b["weights"][k].double()).abs().max()) for k in a["weights"])
    assert diff < TOL, diff
    assert len(a["losses"]) == len(b["losses"]) == 2 * (800 // 64)
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)) < TOL
    for row_a, row_b in zip(a["values"], b["values"], strict=True):  # train_loss, valid_loss, accuracy
        assert abs(row_a[1] - row_b[1]) < TOL
        assert row_a[2] == row_b[2]  # accuracy over the 201 rows: no padded duplicate counted
    assert a["preds"].shape == b["preds"].shape == (201, 2)
    assert torch.equal(a["targs"], b["targs"])
    assert float((a["preds"] - b["preds"]).abs().max()) < TOL
    # and the accuracy is the one computed here from get_preds over the 201 rows
    accuracy = float((b["preds"].argmax(1) == b["targs"].view(-1)).double().mean())
    assert abs(b["values"][-1][2] - accuracy) < 1e-6
    # Leaving distrib_ctx freed the DDP wrapper while the group was alive: freed after, it took the
    # group down with it, without the settle that avoids torch's gloo teardown deadlock (#56297).
    assert b["ddp_freed_in_group"] == [True]


@pytest.mark.launch
def test_a_sigkilled_rank_resumes_mid_epoch_to_fastais_own_weights(
    tmp_path: Path, fastai_alone_adam: Path
) -> None:
    """Rank 1 SIGKILLed at epoch 1, step 4 under --max-restarts 1, checkpoints every 3 steps: the job
    restarts, resumes at epoch 1 step 3 (fastai's order of that epoch drawn again: its tabular loader
    shuffles with NumPy's global generator) and ends on the weights of fastai alone, uninterrupted."""
    one, two = fastai_alone_adam, tmp_path / "two.pt"
    args = ("--every", "3", "--kill-rank", "1", "--at", "4", "--out", str(two))
    killed = launch2(*args, launch_args=("--max-restarts", "1"), cwd=tmp_path)
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "restarting the workers" in killed.stderr  # it did die and come back
    a, b = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    diff = max(float((a["weights"][k].double() - b["weights"][k].double()).abs().max()) for k in a["weights"])
    assert diff < TOL, diff
    assert len(b["losses"]) == 24 - 15  # the resumed run trained only the steps after the checkpoint
    assert max(abs(x - y) for x, y in zip(a["losses"][15:], b["losses"], strict=True)) < TOL
    assert abs(a["final"][0] - b["final"][0]) < TOL and a["final"][1] == b["final"][1]


@pytest.mark.launch
def test_a_preempted_job_exits_75_checkpointed_and_resumes_to_fastais_own_weights(
    tmp_path: Path, fastai_alone_adam: Path
) -> None:
    """SIGTERM on rank 0 in epoch 1: every rank stops at one step boundary, checkpointed, exit 75;
    the same command again resumes there and ends on the weights of fastai alone, uninterrupted."""
    one, two = fastai_alone_adam, tmp_path / "two.pt"
    preempted = launch2("--every", "5", "--term-rank", "0", "--at", "4", "--out", str(two), cwd=tmp_path)
    assert preempted.returncode == 75, preempted.stderr[-3000:]
    assert "preempted by SIGTERM" in preempted.stderr and not two.exists()
    assert "resubmit with distrib_ctx(learn, resume=True)" in preempted.stderr  # the bridge's API, not fit's
    resumed = launch2("--every", "5", "--out", str(two), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    diff = max(float((a["weights"][k].double() - b["weights"][k].double()).abs().max()) for k in a["weights"])
    assert diff < TOL, diff
    assert abs(a["final"][0] - b["final"][0]) < TOL and a["final"][1] == b["final"][1]


@pytest.mark.launch
def test_a_nan_on_one_rank_stops_every_rank_naming_it(tmp_path: Path) -> None:
    proc = launch2("--nan-rank", "1", "--at", "3", "--out", str(tmp_path / "x.pt"))
    assert proc.returncode != 0
    assert "non-finite loss (nan) at epoch 0, step 3, from the batch of rank 1" in proc.stderr
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.launch
def test_a_stalled_rank_is_named(tmp_path: Path) -> None:
    proc = launch2("--stall-rank", "1", "--at", "2", "--out", str(tmp_path / "x.pt"))
    assert proc.returncode != 0
    assert "rank 1 stopped taking part" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.launch
def test_the_fastai_example_killed_mid_run_resumes_to_one_process_weights(tmp_path: Path) -> None:
    """examples/fastai_bridge.py (2 epochs of its 3: enough to resume into) under `unison launch
    --nproc 2 --max-restarts 1 ... --every 3`: rank 1 SIGKILLed from outside once the first
    checkpoint exists; the job restarts, resumes and ends on the weights of the same script on one
    process, uninterrupted (float32: within 1e-5)."""
    psutil = pytest.importorskip("psutil")
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    plain = run([sys.executable, str(EXAMPLE), "--epochs", "2", "--out", str(one)], cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", "--max-restarts", "1", str(EXAMPLE)]
    job = subprocess.Popen(
        [*cmd, "--epochs", "2", "--every", "3", "--out", str(two)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killed = False
    deadline = time.monotonic() + 300
    while job.poll() is None and not killed and time.monotonic() < deadline:
        if (tmp_path / "models" / "checkpoint.pth").exists():
            for proc in psutil.Process(job.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if proc.environ().get("RANK") == "1" and "fastai_bridge.py" in " ".join(proc.cmdline()):
                        proc.kill()
                        killed = True
        time.sleep(0.05)
    _, stderr = communicate_or_report(job, 300)
    assert killed and job.returncode == 0, stderr[-3000:]
    assert "restarting the workers" in stderr
    a, b = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    diff = max(float((a["weights"][k].double() - b["weights"][k].double()).abs().max()) for k in a["weights"])
    assert diff < 1e-5, diff


@pytest.mark.launch
def test_the_fastai_example_passes_check_exact_on_2_processes() -> None:
    cmd = [sys.executable, "-m", "unison.cli", "check-exact", "--nproc", "2", "--steps", "3", "--float64"]
    proc = run([*cmd, str(EXAMPLE)])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "exact to float noise" in proc.stdout


def test_gradient_accumulation_with_checkpoints_on_one_process_is_refused_before_a_step(
    tmp_path: Path,
) -> None:
    """On one process the bridge leaves fastai's GradientAccumulation alone, so its checkpoints would fall
    mid-step and keep no accumulated gradient: a resume would end off the uninterrupted run. Refused."""
    sys.path.insert(0, str(ROOT / "examples"))
    from fastai.tabular.all import GradientAccumulation
    from fastai_bridge import build

    from unison.fastai import distrib_ctx

    learn = build(64)
    learn.path = tmp_path
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    with (
        pytest.raises(ValueError, match="GradientAccumulation with checkpoints"),
        distrib_ctx(learn, checkpoint_every=3),
    ):
        learn.fit(1, cbs=[GradientAccumulation(128)])
    assert all(torch.equal(before[k], v) for k, v in learn.model.state_dict().items())  # no step taken
