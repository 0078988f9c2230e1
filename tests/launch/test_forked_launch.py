"""`unison check-exact`'s launches as forks of a preloaded driver (`unison.check.forked_launch`):
the same verdict as fresh launches, and a run past `--run-timeout` leaves nothing running."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hangs import communicate_or_report, wait_ended
from tests.warm_runner import WarmProcess, server_env, start
from unison.check import forked_launch

CHECK = [sys.executable, "-m", "unison.cli", "check-exact", "--nproc", "2", "--steps", "3"]

# A tiny Learner whose every process says whether it is a fork of the suite's warm server.
MARKED = """
import json, os, sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import DataLoaders, Learner, set_seed
from unison.distributed import num_distrib

with open(os.path.join(os.environ["MARKS"], f"{os.getpid()}.json"), "w") as f:
    json.dump({"warm": "tests.warm_runner" in sys.modules, "world": num_distrib()}, f)
set_seed(0)
x, y = torch.randn(64, 4), torch.randn(64, 1)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
ds = TensorDataset(x, y)
dls = DataLoaders(DataLoader(ds, batch_size=16 // num_distrib()), DataLoader(ds, batch_size=32))
learn = Learner(dls, model, nn.functional.mse_loss, opt_func=torch.optim.AdamW, lr=0.01)
with learn.distrib_ctx():
    learn.fit(1)
"""


def test_a_process_not_preloaded_launches_fresh_interpreters() -> None:
    assert not forked_launch.preloaded()  # pytest's process: no UNISON_PRELOADED_PID naming it


@pytest.mark.launch
@pytest.mark.timeout(240)
def test_forked_launches_give_the_fresh_launches_verdict_and_figures(tmp_path: Path) -> None:
    """Through the warm runner the driver is preloaded: its launches, their zygotes and workers are
    forks of it; fresh, none is. Both report the same figures, to the last digit."""
    script = tmp_path / "marked.py"
    script.write_text(MARKED)
    report, marks = {}, {}
    for how in ("forked", "fresh"):
        folder = tmp_path / how
        folder.mkdir()
        env = {**server_env(), "MARKS": str(folder)}  # (a library an earlier test loaded may have set one)
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        proc = start([*CHECK, str(script)], **pipes, env=env, fresh=how == "fresh")
        assert isinstance(proc, WarmProcess) == (how == "forked")
        out, err = communicate_or_report(proc, 180)
        assert proc.returncode == 0, (how, out[-3000:], err[-3000:])
        assert "verdict: agrees to float32 rounding" in out, (how, out)
        # (the lines after the per-run timings: differences, the verdict)
        report[how] = out.split("compared after", 1)[1]
        marks[how] = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    assert report["forked"] == report["fresh"]
    for how in ("forked", "fresh"):  # 1 process, then 2
        assert sorted(m["world"] for m in marks[how]) == [1, 2, 2], how
        assert {m["warm"] for m in marks[how]} == {how == "forked"}, how


HANGS = """
import os, time
with open(os.environ["PIDFILE"], "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
"""


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_a_forked_run_past_its_time_limit_is_stopped_and_named(tmp_path: Path) -> None:
    script, pidfile = tmp_path / "hangs.py", tmp_path / "worker.pid"
    script.write_text(HANGS)
    env = {**server_env(), "PIDFILE": str(pidfile)}
    cmd = [*CHECK[:4], "--nproc", "2", "--run-timeout", "4", str(script)]
    proc = start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert isinstance(proc, WarmProcess)
    out, err = communicate_or_report(proc, 90)
    assert proc.returncode == 2, (out, err)
    assert "the run on 1 process, float32 did not finish in 4s" in err, err
    wait_ended(int(pidfile.read_text()), 30, "the hung worker, after check-exact ended,")
