"""`unison.Run(fault_tolerant=True)`: an own loop on torchft replicas (real replica processes, a real
lighthouse on loopback, a real SIGKILL), and losses counted over tokens under torchft (the own loop's
and the Learner's): each run is checked against a plain one-process loop written here. The Learner's
own kill/replace tests and the helpers used here: tests/distributed/test_fault_tolerant.py."""

import os
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unison import Run, set_seed

torchft = pytest.importorskip("torchft")

from tests.distributed.test_fault_tolerant import (  # noqa: E402
    finish,
    group_launch,
    replica,
    stop_all,
    went_past,
)
from unison.distributed.fault_tolerant import LIGHTHOUSE_ENV, start_lighthouse  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "fault_scripts" / "ft_own_loop.py"
IGNORE = -100
N, BATCH = 121, 12  # 11 steps an epoch; the last holds 1 sample, so one replica's share of it is empty
ATOL = 2e-5  # float32 noise of another summation order (the Learner's torchft tests use the same)


def plain_loop(loss: str, opt_kind: str, epochs: int, sched: bool = False) -> dict[str, torch.Tensor]:
    """What tests/fault_scripts/ft_own_loop.py trains, on one process without unison: each step of 12
    samples (sequential order) backpropagates the summed loss over its count (tokens or samples);
    `sched`: a OneCycleLR stepped after each step (`--sched`)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 5, 8, generator=g)
    y = (x[..., 0] + 0.5 * x[..., 1] > 0).long()
    if loss == "tokens":
        y[torch.rand(N, 5, generator=g) < 0.33] = IGNORE
    set_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    opt_func = torch.optim.AdamW if opt_kind == "adamw" else torch.optim.SGD
    opt = opt_func(model.parameters(), lr=1e-2)
    one_cycle = (
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=11 * epochs) if sched else None
    )
    for _ in range(epochs):
        for first in range(0, N, BATCH):
            xb, yb = x[first : first + BATCH], y[first : first + BATCH]
            total = F.cross_entropy(
                model(xb).reshape(-1, 2), yb.reshape(-1), ignore_index=IGNORE, reduction="sum"
            )
            count = int((yb != IGNORE).sum()) if loss == "tokens" else len(yb)
            (total / count).backward()
            opt.step()
            opt.zero_grad()
            if one_cycle is not None:
                one_cycle.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_weights(runs: dict, want: dict[str, torch.Tensor], note: str) -> None:
    for name, run in runs.items():  # float noise of another summation order only
        for key, value in want.items():
            torch.testing.assert_close(
                run["weights"][key], value, rtol=0, atol=ATOL, msg=f"{note} {name} {key}"
            )
    first = next(iter(runs.values()))
    for name, run in runs.items():  # one all-reduce result: the replicas agree to the bit
        for key in want:
            assert torch.equal(run["weights"][key], first["weights"][key]), f"{note} {name} {key}"


@pytest.mark.lighthouse
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("learner", "loss", "opt_kind"),
    [(False, "tokens", "adamw"), (False, "rows", "sgd"), (True, "tokens", "adamw")],
    ids=["run-tokens-adamw", "run-rows-sgd", "learner-tokens-adamw"],
)
def test_two_replicas_train_to_the_plain_loops_weights(tmp_path, learner, loss, opt_kind):
    lighthouse = start_lighthouse(min_replicas=2, join_timeout_ms=2000, quorum_tick_ms=100)
    env = {**os.environ, LIGHTHOUSE_ENV: lighthouse.address()}
    args = ["--loss", loss, "--opt", opt_kind, "--epochs", "2", "--min-replicas", "2"]
    args += ["--learner"] if learner else []
    procs = []
    try:
        procs = [
            replica(tmp_path / f"r{r}.pt", "--replica", f"r{r}", *args, env=env, script=SCRIPT)
            for r in (0, 1)
        ]
        logs = [finish(p, timeout=180) for p in procs]
    finally:
        stop_all(procs, lighthouse)
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    runs = {f"r{r}": torch.load(tmp_path / f"r{r}.pt") for r in (0, 1)}
    check_weights(runs, plain_loop(loss, opt_kind, epochs=2), note=loss)
    for run in runs.values():  # both took part in every step, none redone
        assert run["events"]["participants"] == [2] * 22 and run["events"]["redone"] == 0
        assert len(run["bodies"]) == 22 and run["redoing"] == []


@pytest.mark.lighthouse
@pytest.mark.timeout(240)
def test_an_own_loop_as_a_replica_group_of_two_processes_trains_to_the_plain_loops_weights(
    tmp_path,
):
    # `unison launch --nproc 2 --start-lighthouse`: rank r takes rows r::2 of each step, the two
    # shares' token counts differ, and the group's gloo sum carries them with the gradient.
    args = ["--loss", "tokens", "--epochs", "2", "--start-replicas", "1"]
    procs = []
    try:
        procs.append(group_launch(tmp_path / "a.pt", "a", *args, lighthouse=None, script=SCRIPT))
        log = finish(procs[0], timeout=200)
    finally:
        stop_all(procs, None)
    assert procs[0].returncode == 0, log[-4000:]
    runs = {f"a{r}": torch.load(tmp_path / f"a.pt.rank{r}") for r in (0, 1)}
    check_weights(runs, plain_loop("tokens", "adamw", epochs=2), note="group")
    assert runs["a0"]["events"]["participants"] == [1] * 22


@pytest.mark.lighthouse
@pytest.mark.timeout(300)
def test_an_own_loop_survives_a_sigkilled_replica_redoing_its_step_and_ends_on_the_plain_loops_weights(
    tmp_path,
):
    """With a OneCycleLR given to `run.setup`: skipped in the failed pass, healed into the replacement."""
    die_at = random.randint(3, 9)  # a random global step (of 44); printed on failure
    lighthouse = start_lighthouse(min_replicas=1, join_timeout_ms=2000, quorum_tick_ms=100)
    env = {**os.environ, LIGHTHOUSE_ENV: lighthouse.address()}
    common = ["--epochs", "4", "--step-time", "0.1", "--timeout", "10", "--start-replicas", "2", "--sched"]
    replacement = tmp_path / "r1.pt"
    # The survivor waits after step die_at + 2 until the replacement has started (imports done): it is
    # then still training when the replacement joins, however slow the machine.
    hold = ["--hold-at", str(die_at + 2), "--hold-for", f"{replacement}.started"]
    procs = []
    try:
        procs.append(replica(tmp_path / "r0.pt", "--replica", "r0", *common, *hold, env=env, script=SCRIPT))
        doomed = replica(
            tmp_path / "r1-killed.pt",
            "--replica",
            "r1",
            "--die-at",
            str(die_at),
            *common,
            env=env,
            script=SCRIPT,
        )
        procs.append(doomed)
        log = finish(doomed, timeout=150)
        assert doomed.returncode == -9, f"die_at={die_at}: the replica was not killed\n{log[-3000:]}"
        # The replacement starts once the survivor went on alone (else it may join the redo itself).
        assert went_past(tmp_path / "r0.pt.step", die_at + 2, timeout=60), f"die_at={die_at}: no progress"
        procs.append(replica(replacement, "--replica", "r1", *common, env=env, script=SCRIPT))
        logs = [finish(p, timeout=200) for p in (procs[0], procs[2])]
    finally:
        stop_all(procs, lighthouse)
    for p, text in zip((procs[0], procs[2]), logs, strict=True):
        assert p.returncode == 0, f"die_at={die_at}\n{text[-3000:]}"
    survivor_log, replacement_log = logs
    said = (
        f"epoch 0 step {die_at} failed with 2 replicas; redone with 1 over the same items; replica(s) r1 left"
    )
    assert said in survivor_log, f"die_at={die_at}\n{survivor_log[-3000:]}"
    assert "healed from a live peer (replica r0): joins at epoch" in replacement_log, replacement_log[-3000:]
    runs = {name: torch.load(tmp_path / f"{name}.pt") for name in ("r0", "r1")}
    check_weights(runs, plain_loop("tokens", "adamw", epochs=4, sched=True), note=f"die_at={die_at}")
    survivor = runs["r0"]
    # The survivor's loop body ran every step once, and the killed step twice (the redo, same items).
    steps = [(e, s) for e in range(4) for s in range(11)]
    assert sorted(set(survivor["bodies"])) == steps
    assert survivor["bodies"].count((0, die_at)) == 2 and len(survivor["bodies"]) == 45, f"die_at={die_at}"
    assert survivor["events"]["redone"] == 1 and survivor["redoing"] == [(0, die_at)]
    assert survivor["events"]["participants"][die_at + 1] == 1  # went on alone, then with the replacement
    assert survivor["events"]["participants"][-1] == 2
    healed = runs["r1"]["events"]["healed_at"]
    assert healed is not None and healed[0] * 11 + healed[1] > die_at + 2, f"die_at={die_at}: {healed}"
    assert runs["r1"]["bodies"][0] == healed  # the replacement's loop starts where it healed


def test_run_fault_tolerant_refuses_what_it_cannot_make_exact_in_one_line(monkeypatch):
    with pytest.raises(ValueError, match=r"^Run\(fault_tolerant=True\) does not support accumulate=2"):
        Run(fault_tolerant=True, accumulate=2)
    with pytest.raises(ValueError, match="fault_tolerant=True and shard=True"):
        Run(fault_tolerant=True, shard=True)
    monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    with Run(fault_tolerant=True) as run:
        with pytest.raises(ValueError, match=r"^Run\(fault_tolerant=True\) needs a torchft lighthouse: set"):
            run.setup(nn.Linear(4, 2), torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1))
    monkeypatch.setenv(LIGHTHOUSE_ENV, "http://localhost:1")  # refused before it is reached
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with Run(fault_tolerant=True) as run:
        with pytest.raises(
            ValueError, match=r"^Run\(fault_tolerant=True\): the model's BatchNorm \(1\) .* or Run\(\)"
        ):
            run.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert run.host.strategy is None  # nothing left attached
        assert not [cb for cb in run.host.cbs if type(cb).__name__ == "FaultTolerantTrainer"]
