"""fastai's tutorial idioms on W processes against fastai alone on one (tests/scripts/fastai_idioms.py:
the stock distributed script with its import changed to `from unison.fastai import *`): lr_find's
suggestion, fit_one_cycle at it, SaveModelCallback's best model loaded at the end on every rank,
EarlyStopping, ReduceLROnPlateau and CSVLogger; and the same script killed mid-run and resumed."""

import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastai.tabular.all", reason="fastai is not installed (make install puts it in)")

from tests.hangs import run_or_report  # noqa: E402

pytestmark = [pytest.mark.launch, pytest.mark.timeout(480)]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "fastai_idioms.py"
TOL = 1e-9  # float64 rounding, through lr_find's sweep and four epochs of Adam


def run(args: list[str], cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = run_or_report(args, 300, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def launch(nproc: int, out: Path, *args: str, launch_args: tuple[str, ...] = (), script: Path = SCRIPT):
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", str(nproc), *launch_args, str(script)]
    return run([*cmd, "--out", str(out), *args], cwd=out.parent)


def rank_files(out: Path, world: int) -> list[dict]:
    return [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(world)]


def max_diff(a: dict, b: dict) -> float:
    return max(float((a["weights"][k] - b["weights"][k]).abs().max()) for k in a["weights"])


def csv_rows(out: Path) -> list[list[str]]:
    """The CSV log's rows without the time column (wall time differs from run to run)."""
    return [line.split(",")[:-1] for line in Path(f"{out}.csv").read_text().splitlines()]


@pytest.fixture(scope="module")
def fastai_alone(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("fastai-alone") / "one"
    run([sys.executable, str(SCRIPT), "--plain", "--out", str(out)], cwd=out.parent)
    return out, rank_files(out, 1)[0]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_stock_script_with_lr_find_and_trackers_equals_fastai_alone(
    tmp_path: Path, fastai_alone: tuple[Path, dict], world: int
) -> None:
    """Every rank ends on one model (SaveModelCallback's best, loaded once rank 0 has written it
    whole), that of fastai alone; lr_find suggests the same rate and leaves every rank where it
    began; CSVLogger's file is written once; fastai's messages are printed once."""
    one_out, one = fastai_alone
    out = tmp_path / "many"
    if world == 1:  # `python train.py`: the same script without a launcher
        run([sys.executable, str(SCRIPT), "--out", str(out)], cwd=out.parent)
    else:
        launch(world, out)
    ranks = rank_files(out, world)
    for other in ranks[1:]:
        assert max_diff(ranks[0], other) == 0.0  # bit-equal: no rank read a torn or older best.pth
    assert max_diff(one, ranks[0]) < TOL
    assert [r["suggestion"] for r in ranks] == [one["suggestion"]] * world
    for mine, theirs in zip(one["values"], ranks[0]["values"], strict=True):
        assert max(abs(x - y) for x, y in zip(mine, theirs, strict=True)) < TOL
    assert max(abs(x - y) for x, y in zip(one["final"], ranks[0]["final"], strict=True)) < TOL
    # the best model is epoch 2's (min_delta 0.1), not the last epoch's: the final validation says so
    assert abs(ranks[0]["final"][0] - ranks[0]["values"][2][1]) < TOL
    assert len(csv_rows(out)) == len(csv_rows(one_out)) == 1 + 4  # one header, one row per epoch
    assert csv_rows(out)[0] == csv_rows(one_out)[0]
    assert one["printed"].count("Better model found") == ranks[0]["printed"].count("Better model found") == 2
    assert all("Better model found" not in r["printed"] for r in ranks[1:])
    if world > 1:
        assert f"global batch 60 = {world} processes x {60 // world}" in ranks[0]["printed"]


def test_a_rank_killed_past_epoch_0_resumes_with_its_trackers_to_fastai_alone(
    tmp_path: Path, fastai_alone: tuple[Path, dict]
) -> None:
    """Rank 1 SIGKILLed at epoch 1, step 4 (a checkpoint every 3 steps) under --max-restarts 1: the
    job restarts and resumes; the finished epoch passes with its row logged again, the trackers go on
    with the checkpoint's state (SaveModelCallback's best of epoch 0 keeps epoch 1 from counting as
    better), and the job ends on fastai alone's weights with the same CSV file and messages."""
    one_out, one = fastai_alone
    out = tmp_path / "killed"
    proc = launch(
        2, out, "--every", "3", "--kill-rank", "1", "--at", "4", launch_args=("--max-restarts", "1")
    )
    assert "restarting the workers" in proc.stderr  # it did die and come back
    ranks = rank_files(out, 2)
    assert max_diff(ranks[0], ranks[1]) == 0.0
    assert max_diff(one, ranks[0]) < TOL
    for mine, theirs in zip(one["values"], ranks[0]["values"], strict=True):  # train_loss too (smoothed)
        assert max(abs(x - y) for x, y in zip(mine, theirs, strict=True)) < TOL
    rows, expected = csv_rows(out), csv_rows(one_out)
    assert len(rows) == len(expected) and rows[0] == expected[0]
    for mine, theirs in zip(expected[1:], rows[1:], strict=True):
        assert max(abs(float(x) - float(y)) for x, y in zip(mine, theirs, strict=True)) < TOL
    # the resumed attempt finds epoch 2 better, as the uninterrupted run did; epoch 1 is not
    assert "Better model found at epoch 2" in ranks[0]["printed"]
    assert "Better model found at epoch 1" not in ranks[0]["printed"]


def test_fastais_distributed_tutorial_script_runs_with_only_its_import_changed(tmp_path: Path) -> None:
    """examples/fastai_distributed.py (fastai's tutorial steps: setup_distrib, rank0_first writing the
    data once, `ctx = learn.parallel_ctx if ... else learn.distrib_ctx`, fit_flat_cos) at batch 32
    on 2 processes ends on the weights of one process at 64 (float32 rounding)."""
    example = ROOT / "examples" / "fastai_distributed.py"
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    run([sys.executable, str(example), "--bs", "64", "--out", str(one)], cwd=tmp_path)
    proc = launch(2, two, "--bs", "32", script=example)
    assert "global batch 64 = 2 processes x 32" in proc.stdout
    a, b = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    assert max(float((a[k].double() - b[k].double()).abs().max()) for k in a) < 1e-5


def test_what_users_inspect_after_a_fit_is_fastai_alones(tmp_path: Path) -> None:
    """Inside the block on 2 processes, as fastai alone on one: get_preds(with_input=True) gives
    every row once with its own inputs, ClassificationInterpretation's items, top losses and
    confusion matrix are the same on every rank, `learn.export` (rank 0 writes the plain model) reads
    back on every rank, and collab_learner(use_nn=True), whose zero-width BatchNorm gets no gradient,
    trains to the same weights."""
    script = ROOT / "tests" / "scripts" / "fastai_inspect.py"
    run([sys.executable, str(script), "--plain", "--out", str(tmp_path / "one")], cwd=tmp_path)
    launch(2, tmp_path / "two", script=script)
    one, *ranks = (
        torch.load(tmp_path / name, weights_only=True)
        for name in ("one.rank0.pt", "two.rank0.pt", "two.rank1.pt")
    )
    for rank in ranks:
        for key in ("preds", "item_losses", "top_losses"):
            assert one[key].shape == rank[key].shape and float((one[key] - rank[key]).abs().max()) < 1e-5, key
        for key in ("targs", "top_idx", "confusion"):
            assert torch.equal(one[key], rank[key]), key
        assert [t.shape for t in rank["inputs"]] == [(201, 2), (201, 3)]  # (categories, continuous)
        assert all(torch.equal(a, b) for a, b in zip(one["inputs"], rank["inputs"], strict=True))
        assert max(rank["reloaded"]) == 0.0  # the exported model is the trained one
        weights = [k for k, v in one["collab"].items() if v.numel()]
        # float32 rounding, which Adam amplifies on rarely seen embedding rows (in float64: 2e-16)
        assert max(float((one["collab"][k] - rank["collab"][k]).abs().max()) for k in weights) < 2e-4
    assert max(float((ranks[0]["collab"][k] - ranks[1]["collab"][k]).abs().max()) for k in weights) == 0.0


def test_fastais_gradient_accumulation_steps_where_one_process_steps(tmp_path: Path) -> None:
    """fastai's GradientAccumulation(100) at a global batch of 60 steps after every second batch (120
    rows), its gradient the sum over 100, and a step's batches run on across an epoch's end (13
    batches an epoch): on 3 processes at 20 the bridge counts every rank's rows, so the weights are
    fastai alone's (it alone would count each rank's 20 rows and step three times as seldom)."""
    args = ("--no-lr-find", "--accumulate", "100")
    one, three = tmp_path / "one", tmp_path / "three"
    run([sys.executable, str(SCRIPT), "--plain", *args, "--out", str(one)], cwd=tmp_path)
    launch(3, three, *args)
    alone, ranks = rank_files(one, 1)[0], rank_files(three, 3)
    assert max_diff(ranks[0], ranks[2]) == 0.0
    assert max_diff(alone, ranks[0]) < TOL


def test_a_ranks_own_error_is_reported_as_its_own_not_as_a_stall(tmp_path: Path) -> None:
    """A layer the model never calls: the first step is refused on every rank, and the job reports it
    (naming the parameters and the fix in the fastai script's own call, distrib_ctx's
    find_unused_parameters) instead of a stalled rank."""
    script = ROOT / "tests" / "scripts" / "fastai_unused_parameter.py"
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", str(script)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = run_or_report(cmd, 300, env=env, cwd=tmp_path)
    assert proc.returncode != 0
    assert "extra.weight, extra.bias got no gradient" in proc.stderr
    assert "pass learn.distrib_ctx(find_unused_parameters=True)" in proc.stderr  # fastai's call, not Run's
    assert "stopped taking part" not in proc.stderr


def test_gradient_accumulation_that_ends_an_epoch_mid_step_is_refused_with_checkpoints(
    tmp_path: Path,
) -> None:
    """n_acc 100 at a global batch of 60 leaves 60 rows of a step at each epoch's end; a checkpoint there
    keeps no accumulated gradient, so with checkpoints the job is refused before a step, not resumed
    silently off the uninterrupted run."""
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", str(SCRIPT), "--out", str(tmp_path / "x")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = run_or_report(
        [*cmd, "--no-lr-find", "--accumulate", "100", "--every", "3"], 300, env=env, cwd=tmp_path
    )
    assert proc.returncode != 0
    assert "GradientAccumulation with checkpoints" in proc.stderr and "60 rows into a step" in proc.stderr
    assert not (tmp_path / "models" / "checkpoint.pth").exists()


SEAMS = ROOT / "tests" / "scripts" / "fastai_seams.py"


def test_train_metrics_custom_metrics_and_a_test_dl_are_fastai_alones(tmp_path: Path) -> None:
    """`learn.recorder.train_metrics = True` with accuracy, RocAucBinary and an sklearn f1 through
    skm_to_fastai, fit_flat_cos(wd=0.1), fit_sgdr, validate(dl=test_dl), get_preds(act=, reorder=False):
    on 2 processes as fastai alone. The train metrics score every rank's rows of each batch (they
    scored rank 0's: accuracy 0.851 where one process has 0.833)."""
    one, two = tmp_path / "one", tmp_path / "two"
    run([sys.executable, str(SEAMS), "--plain", "--out", str(one)], cwd=tmp_path)
    launch(2, two, script=SEAMS)
    alone = rank_files(one, 1)[0]
    for rank in rank_files(two, 2):
        assert len(rank["values"]) == len(alone["values"]) == 2
        for mine, theirs in zip(alone["values"], rank["values"], strict=True):  # train and valid metrics
            assert max(abs(x - y) for x, y in zip(mine, theirs, strict=True)) < TOL, (mine, theirs)
        assert max(abs(x - y) for x, y in zip(alone["validated"], rank["validated"], strict=True)) < TOL
        assert alone["preds"].shape == rank["preds"].shape == (77, 2)
        assert float((alone["preds"] - rank["preds"]).abs().max()) < TOL
        assert max_diff(alone, rank) < TOL


def test_get_preds_on_a_loader_of_each_ranks_own_rows_is_refused(tmp_path: Path) -> None:
    """Each rank passes get_preds a test_dl of its own 40 rows: the bridge deals one loader's items
    across ranks and gathers them, so each rank got a mix of both ranks' rows. Refused, naming it."""
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", str(SEAMS), "--own-rows"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = run_or_report([*cmd, "--out", str(tmp_path / "x")], 300, env=env, cwd=tmp_path)
    assert proc.returncode != 0
    assert "differs on rank(s) [1] from rank 0" in proc.stderr, proc.stderr[-3000:]
    assert "outside distrib_ctx" in proc.stderr
    assert not (tmp_path / "x.rank0.pt").exists()


def test_loaders_built_from_each_ranks_own_rows_are_refused_at_the_first_fit(tmp_path: Path) -> None:
    """Each rank builds TabularDataLoaders from its own half of the table (the same sizes, seed and
    batch): the bridge deals positions of each rank's own order, so the job trained on half of each
    half and scored a mix. Refused before a step, naming the loader and the rank."""
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", str(SEAMS), "--own-shard"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = run_or_report([*cmd, "--out", str(tmp_path / "x")], 300, env=env, cwd=tmp_path)
    assert proc.returncode != 0
    assert "the train loader differs on rank(s) [1] from rank 0" in proc.stderr, proc.stderr[-3000:]
    assert "from the same items" in proc.stderr
    assert not (tmp_path / "x.rank0.pt").exists()
