"""Per-step fault tolerance on torchft: real replica processes, a real lighthouse on loopback, a real
SIGKILL; the result is checked against a plain one-process run of the same script."""

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Learner
from unison.data.batch import DataLoaders

torchft = pytest.importorskip("torchft")

from tests.hangs import dump_and_kill, run_or_report  # noqa: E402
from tests.launch.test_multinode import machines, netns_port  # noqa: E402, F401  (fixture: two network namespaces)
from tests.warm_runner import start  # noqa: E402
from unison.distributed.fault_tolerant import LIGHTHOUSE_ENV, start_lighthouse  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "fault_scripts" / "ft_replica.py"


def tiny_learner():
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=4), None)
    return Learner(dls, nn.Linear(4, 2), nn.CrossEntropyLoss(), default_cbs=False)


def test_without_a_lighthouse_it_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    learn = tiny_learner()
    with pytest.raises(ValueError, match="needs a torchft lighthouse: set TORCHFT_LIGHTHOUSE"):
        with learn.distrib_ctx(fault_tolerant=True):
            pass
    assert learn.cbs == []  # nothing left attached


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--lighthouse", "http://h:1", "--start-lighthouse"], "--lighthouse and --start-lighthouse exclude"),
        (["--lighthouse", "h:29510"], "--lighthouse h:29510: expected http://host:port"),
        (["--lighthouse", "http://h:70000"], "--lighthouse http://h:70000: the port must be in 1..65535"),
        (["--min-replicas", "2"], "--min-replicas needs --start-lighthouse"),
        (["--start-lighthouse", "--min-replicas", "0"], "--min-replicas must be at least 1, got 0"),
        (["--replica-id", "a b"], "--replica-id 'a b': use letters, digits"),
    ],
)
def test_unison_launch_refuses_bad_replica_options_in_one_line_before_anything_starts(
    argv, said, capsys, tmp_path
):
    from unison.launch.launcher import main

    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    assert main(["--nproc", "2", *argv, str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"unison launch: error: {said}") and err.count("\n") == 1, err
    assert not marker.exists()


def test_unison_launch_refuses_to_start_a_lighthouse_on_a_port_in_use_in_one_line(capsys, tmp_path):
    from unison.launch.launcher import main

    script = tmp_path / "train.py"
    script.write_text("")
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--start-lighthouse", "--lighthouse-port", str(port), str(script)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"unison launch: error: --start-lighthouse: port {port} is already in use on this machine (another "
        "lighthouse?): join it with --lighthouse http://host:port, or choose --lighthouse-port\n"
    )


def test_unison_launch_exports_the_lighthouse_and_the_replica_id_to_its_workers(tmp_path):
    from unison.launch.launcher import parse_options, plan_launch

    script = tmp_path / "train.py"
    script.write_text("")
    opts = parse_options(["--lighthouse", "http://h:29510", "--replica-id", "b", str(script)])
    plan = plan_launch(opts, str(tmp_path))
    assert plan.env[LIGHTHOUSE_ENV] == "http://h:29510" and plan.env["UNISON_REPLICA_ID"] == "b"
    assert plan.logs.replica == "b"  # the restart line names the replica
    plain = plan_launch(parse_options([str(script)]), str(tmp_path))
    assert LIGHTHOUSE_ENV not in plain.env and plain.logs.replica is None


def test_batchnorm_and_sharding_are_refused_in_one_line_since_they_cannot_be_exact(monkeypatch):
    # Each replica normalises over its share of a step: not one process's statistics of the whole batch.
    monkeypatch.setenv(LIGHTHOUSE_ENV, "http://localhost:1")
    learn = tiny_learner()
    learn.model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"BatchNorm \(1\) .* not exact"):
        with learn.distrib_ctx(fault_tolerant=True):
            pass
    assert learn.cbs == []
    with pytest.raises(ValueError, match="fault_tolerant=True and shard=True"):
        with tiny_learner().distrib_ctx(fault_tolerant=True, shard=True):
            pass


@pytest.mark.lighthouse
@pytest.mark.timeout(60)
def test_a_replica_without_enough_peers_fails_within_the_quorum_timeout_naming_the_fix(monkeypatch):
    lighthouse = start_lighthouse(min_replicas=2)  # this replica is alone
    monkeypatch.setenv(LIGHTHOUSE_ENV, lighthouse.address())
    learn = tiny_learner()
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="no quorum within 2 s .* are at least its --min-replicas"):
            with learn.distrib_ctx(fault_tolerant={"quorum_timeout": 2}):
                learn.fit(1)
    finally:
        lighthouse.shutdown()
    assert time.monotonic() - start < 30
    assert learn.cbs == []  # detached on the way out


def replica(out, *args, env, script=SCRIPT):
    cmd = [sys.executable, str(script), "--out", str(out), *args]
    with open(f"{out}.log", "w") as log:  # a file, not a pipe: torchft logs a lot, nobody drains a pipe
        proc = start(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)  # a fork of a warm interpreter
    proc.log = f"{out}.log"
    return proc


def went_past(step_file, step, timeout):
    """Whether the replica writing `step_file` committed global step `step` within `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = step_file.read_text().strip() if step_file.exists() else ""
        if text and int(text) >= step:
            return True
        time.sleep(0.05)
    return False


def finish(proc, timeout):
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        dump_and_kill(proc)  # its processes' stacks into its log, and none left running
        proc.wait(timeout=10)
    return Path(proc.log).read_text()


def stop_all(procs, lighthouse):
    """No replica or lighthouse outlives its test, passed or failed (a launch's workers die with it)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    if lighthouse is not None:
        lighthouse.shutdown()


def served_address(launch, timeout):
    """The address `unison launch --start-lighthouse` printed in its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launch.poll() is None:
        found = re.search(r"lighthouse serving at (http://\S+)", Path(launch.log).read_text())
        if found:
            return found.group(1)
        time.sleep(0.1)
    raise AssertionError(f"no lighthouse address in {launch.log}:\n{Path(launch.log).read_text()[-2000:]}")


def plain_run(tmp_path, epochs: int, *data: str) -> None:
    """The plain one-process run the replicas are compared with: its weights in `tmp_path/plain.pt`."""
    out = str(tmp_path / "plain.pt")
    cmd = [sys.executable, str(SCRIPT), "--out", out, "--plain", "--epochs", str(epochs), *data]
    done = run_or_report(cmd, 120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "data", [[], ["--sampler"], ["--stream"]], ids=["shuffled-loader", "uneven-batch-sampler", "stream"]
)
@pytest.mark.lighthouse
def test_a_replica_killed_mid_step_is_replaced_and_every_replica_ends_on_the_uninterrupted_weights(
    tmp_path, data
):
    die_at = random.randint(4, 16)  # a random global step (of 64 or 92); printed on failure
    args = ["--epochs", "4", "--step-time", "0.1", "--min-replicas", "2", "--timeout", "20", *data]
    # All three from step 0: on a loaded machine the third used to start late and heal (8 steps in).
    args += ["--start-replicas", "3"]
    plain_run(tmp_path, 4, *data)
    lighthouse = start_lighthouse(min_replicas=2, join_timeout_ms=2000, quorum_tick_ms=100)
    env = {**os.environ, LIGHTHOUSE_ENV: lighthouse.address()}
    procs = []
    try:
        # The survivors wait after step die_at + 2 until the replacement is about to ask for its first
        # quorum, so that they are still training when it asks (they take one every 0.5 s).
        hold = ["--hold-at", str(die_at + 2), "--hold-for", str(tmp_path / "r2.pt.asking0")]
        procs = [replica(tmp_path / f"r{r}.pt", "--replica", f"r{r}", *args, *hold, env=env) for r in (0, 1)]
        doomed_args = ["--replica", "r2", "--die-at", str(die_at), *args]
        doomed = replica(tmp_path / "r2-killed.pt", *doomed_args, env=env)
        procs.append(doomed)
        log = finish(doomed, timeout=150)
        assert doomed.returncode == -9, f"die_at={die_at}: the replica was not killed\n{log}"
        # The replacement starts once the survivors went on alone (else it may join the redo itself).
        assert went_past(tmp_path / "r0.pt.step", die_at + 2, timeout=60), f"die_at={die_at}: no progress"
        procs.append(replica(tmp_path / "r2.pt", "--replica", "r2", *args, env=env))
        logs = [finish(p, timeout=150) for p in procs[:2] + procs[3:]]
        for text in logs[:2]:  # each survivor's log says what happened
            assert "failed with 3 replicas; redone with 2 over the same items" in text, f"die_at={die_at}"
            # A stream has no index to load a replica's rows by: it loads each step whole, and says so once.
            whole = "each step's whole batch is loaded to keep this replica's rows: the loader streams"
            assert text.count(whole) == (1 if "--stream" in data else 0), text[-3000:]
        assert re.search(r"healed from a live peer \(replica r[01]\): joins at epoch", logs[2])
        for p, text in zip(procs[:2] + procs[3:], logs, strict=True):
            assert p.returncode == 0, f"die_at={die_at}\n{text[-3000:]}"
    finally:
        stop_all(procs, lighthouse)
    want = torch.load(tmp_path / "plain.pt")["weights"]
    runs = {name: torch.load(tmp_path / f"{name}.pt") for name in ("r0", "r1", "r2")}
    n_iter = runs["r0"]["steps_per_epoch"]  # 16 full batches of 12, or 23 uneven ones
    total = 4 * n_iter
    for name, run in runs.items():
        for key, value in want.items():  # float noise of another summation order only
            torch.testing.assert_close(run["weights"][key], value, rtol=0, atol=2e-5, msg=f"{name} {key}")
    for key in want:  # one all-reduce result: the replicas agree to the bit
        assert torch.equal(runs["r0"]["weights"][key], runs["r2"]["weights"][key])
    survivors = [runs["r0"], runs["r1"]]
    for run in survivors:  # never restarted: one process trained every step, one was redone
        assert run["steps"] == total
        assert run["events"]["redone"] >= 1, f"die_at={die_at}: {run['events']}"
        assert 2 in run["events"]["participants"][die_at:]  # went on with two
    healed = runs["r2"]["events"]["healed_at"]
    joined = healed[0] * n_iter + healed[1] if healed is not None else -1
    assert joined > die_at, f"die_at={die_at}: healed at {healed}"
    assert runs["r2"]["steps"] == total - joined  # joined and trained to the end
    assert survivors[0]["events"]["participants"][-1] == 3  # ended with the replacement taking part


@pytest.mark.slow
@pytest.mark.lighthouse
@pytest.mark.timeout(240)
def test_between_periodic_quorums_a_replica_that_joins_is_taken_in_at_the_next_one_and_all_end_exact(
    tmp_path,
):
    """A quorum every 0.5 s, not every step: a third replica started mid-run (nothing failing) waits
    for the next quorum, heals, and takes its share; every replica ends on the one-process weights."""
    args = ["--epochs", "4", "--step-time", "0.05", "--min-replicas", "2", "--timeout", "20"]
    args += ["--opt", "sgd", "--quorum-interval", "0.5"]
    plain_run(tmp_path, 4, "--opt", "sgd")
    lighthouse = start_lighthouse(min_replicas=2, join_timeout_ms=2000, quorum_tick_ms=100)
    env = {**os.environ, LIGHTHOUSE_ENV: lighthouse.address()}
    procs = []
    try:
        # r0 and r1 hold after step 8 until r2 is about to ask for its first quorum: on a loaded
        # machine r2's start-up can outlast their whole run.
        hold = ["--hold-at", "8", "--hold-for", str(tmp_path / "r2.pt.asking0")]
        procs = [
            replica(
                tmp_path / f"r{r}.pt", "--replica", f"r{r}", "--start-replicas", "2", *args, *hold, env=env
            )
            for r in (0, 1)
        ]
        assert went_past(tmp_path / "r0.pt.step", 8, timeout=90), finish(procs[0], timeout=1)[-3000:]
        procs.append(replica(tmp_path / "r2.pt", "--replica", "r2", *args, env=env))
        logs = [finish(p, timeout=150) for p in procs]
        for p, text in zip(procs, logs, strict=True):
            assert p.returncode == 0, text[-3000:]
    finally:
        stop_all(procs, lighthouse)
    assert "replica(s) r2 joined the quorum (3 replicas now)" in logs[0], logs[0][-3000:]
    want = torch.load(tmp_path / "plain.pt")["weights"]
    runs = {name: torch.load(tmp_path / f"{name}.pt") for name in ("r0", "r1", "r2")}
    for name, run in runs.items():
        for key, value in want.items():  # float noise of another summation order only
            torch.testing.assert_close(run["weights"][key], value, rtol=0, atol=2e-5, msg=f"{name} {key}")
    total = 4 * runs["r0"]["steps_per_epoch"]
    first = runs["r0"]["events"]
    assert runs["r0"]["steps"] == total and first["redone"] == 0, first
    seen = first["participants"]
    assert seen[:8] == [2] * 8 and seen[-1] == 3 and sorted(seen) == seen, seen  # 2, then 3 for good
    # Fewer quorums than steps, yet none missed the newcomer. How many fewer depends on the steps'
    # time, not a test's business: quiet, a quorum about every 10 steps; in a loaded double run
    # (load 9-13) 33 of the 64 steps had one (the bound was total // 2 then, and failed). A gap
    # between two quorums is not bounded below by the interval either: the first replica whose
    # interval is up asks, and the replicas' clocks reset up to a step apart (0.37 s seen).
    assert 2 <= first["quorums"] < total, first["quorums"]
    healed = runs["r2"]["events"]["healed_at"]
    joined = healed[0] * runs["r0"]["steps_per_epoch"] + healed[1]
    assert joined >= 8 and runs["r2"]["steps"] == total - joined, healed


def test_a_negative_quorum_interval_is_refused_in_one_line():
    from unison.distributed.fault_tolerant import FaultTolerantTrainer

    with pytest.raises(ValueError, match=r"quorum_interval must be 0 or more seconds, not -1"):
        FaultTolerantTrainer(lighthouse="http://h:1", quorum_interval=-1)


def group_launch(out, name, *args, lighthouse, where=None, script=SCRIPT):
    """One replica group: `unison launch --nproc 2 --lighthouse ADDRESS --replica-id NAME --max-restarts 1`;
    `lighthouse=None`: `--start-lighthouse` instead (on a free port, serving for the launch's life)."""
    join = ["--lighthouse", lighthouse] if lighthouse else ["--start-lighthouse", "--lighthouse-port", "0"]
    launch = [sys.executable, "-m", "unison.launch", "--nproc", "2", *join]
    launch += ["--replica-id", name, "--max-restarts", "1"]
    cmd = [*launch, str(script), "--out", str(out), *args]
    with open(f"{out}.log", "w") as log:  # `where`: a command prefix (another network namespace)
        proc = subprocess.Popen(where(cmd) if where else cmd, stdout=log, stderr=log)
    proc.log = f"{out}.log"
    return proc


# 5 processes each, waiting 60 s at most for the replicas to start and agree: two at once on a loaded
# 2-core machine missed it (a -n 4 run), so one worker runs them one after the other.
@pytest.mark.xdist_group("torchft-groups-of-two")
@pytest.mark.lighthouse
@pytest.mark.timeout(240)
def test_two_replica_groups_of_two_processes_a_killed_process_restarts_only_its_group_which_heals(tmp_path):
    die_at = random.randint(3, 12)  # a random global step (of 96); printed on failure
    # 6 epochs: group a, alone after the kill, must still be training when b comes back (with a
    # quorum every 0.5 s, not every step, a alone runs 96 steps of 0.15 s in about 15 s).
    common = ["--epochs", "6", "--step-time", "0.15", "--timeout", "10", "--start-replicas", "2"]
    plain_run(tmp_path, 6)
    procs = []
    try:  # group a's launcher serves the lighthouse (--start-lighthouse); group b joins it
        # Group a holds after step die_at + 2 until b's restart is about to ask for a quorum: on a
        # loaded machine a restart can take longer than a alone takes to finish.
        hold = ["--hold-at", str(die_at + 2), "--hold-for", str(tmp_path / "b.pt.rank0.asking1")]
        procs.append(group_launch(tmp_path / "a.pt", "a", *common, *hold, lighthouse=None))
        address = served_address(procs[0], timeout=60)
        # Rank 1 of group b dies (first attempt only); its restart comes back 5 s late, after a's redo.
        doomed = ["--die-at", str(die_at), "--die-rank", "1", "--restart-delay", "5"]
        procs.append(group_launch(tmp_path / "b.pt", "b", *common, *doomed, lighthouse=address))
        logs = [finish(p, timeout=200) for p in procs]
    finally:
        stop_all(procs, None)
    for p, text in zip(procs, logs, strict=True):
        assert p.returncode == 0, f"die_at={die_at}\n{text[-4000:]}"
    a_log, b_log = logs
    assert "restarting replica a" not in a_log, f"die_at={die_at}: group a restarted\n{a_log[-3000:]}"
    # The survivors name the replica they lost and redo the step alone (rank r of 2 takes rows r::2),
    # then say when it came back.
    line = f"epoch 0 step {die_at} failed with 2 replicas; redone with 1 over the same items; "
    assert f"{line}replica(s) b left the quorum\n" in a_log, f"die_at={die_at}\n{a_log[-3000:]}"
    assert "replica(s) b joined the quorum (2 replicas now)" in a_log
    # The launcher names the replica, the worker and how it ended; only this group restarts.
    restart = re.search(
        r"unison launch: replica b: worker rank (\d) exited with ([^;]+); restarting replica b "
        r"\(1/1\); the other replicas keep training",
        b_log,
    )
    assert restart, f"die_at={die_at}\n{b_log[-3000:]}"
    assert "healed from a live peer (replica a): joins at epoch" in b_log
    want = torch.load(tmp_path / "plain.pt")["weights"]
    runs = {f"{g}{r}": torch.load(tmp_path / f"{g}.pt.rank{r}") for g in "ab" for r in (0, 1)}
    for name, run in runs.items():  # float noise of another summation order only
        for key, value in want.items():
            torch.testing.assert_close(run["weights"][key], value, rtol=0, atol=2e-5, msg=f"{name} {key}")
        for key in want:  # the same all-reduces: every rank of every group agrees to the bit
            assert torch.equal(run["weights"][key], runs["a0"]["weights"][key]), f"{name} {key}"
    total = 6 * runs["a0"]["steps_per_epoch"]
    for name in ("a0", "a1"):  # never restarted: trained every step, redid the one in flight
        assert runs[name]["steps"] == total, f"die_at={die_at}: {name} {runs[name]['steps']}"
        assert runs[name]["events"]["redone"] >= 1
        assert 1 in runs[name]["events"]["participants"][die_at:]  # went on alone
        assert runs[name]["events"]["participants"][:die_at] == [2] * die_at  # both groups from step 0
    healed = runs["b0"]["events"]["healed_at"]
    assert healed is not None and healed == runs["b1"]["events"]["healed_at"], f"die_at={die_at}"
    joined = healed[0] * runs["a0"]["steps_per_epoch"] + healed[1]
    assert joined > die_at and runs["b0"]["steps"] == runs["b1"]["steps"] == total - joined


@pytest.mark.xdist_group("torchft-groups-of-two")  # (see above)
@pytest.mark.lighthouse
@pytest.mark.timeout(240)
def test_two_replica_groups_on_two_network_namespaces_as_two_hosts_survive_a_killed_process(
    machines,  # noqa: F811
    tmp_path,
):
    die_at = random.randint(3, 10)  # a random global step (of 48); printed on failure
    common = ["--epochs", "3", "--step-time", "0.15", "--timeout", "10", "--start-replicas", "2"]
    plain_run(tmp_path, 3)
    port = netns_port()  # inside namespace A: nothing else listens there
    serve = [sys.executable, "-m", "unison.cli", "lighthouse", "--min-replicas", "1", "--port", str(port)]
    lighthouse = subprocess.Popen(
        machines.cmd(0, serve), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    procs = [lighthouse]
    try:
        assert lighthouse.stdout.readline().startswith(f"{LIGHTHOUSE_ENV}=http://")
        address = f"http://{machines.addrs[0]}:{port}"  # the host name maps to 127.0.0.1 in both
        a_cmd, b_cmd = (lambda cmd, i=i: machines.cmd(i, cmd) for i in (0, 1))
        hold = ["--hold-at", str(die_at + 2), "--hold-for", str(tmp_path / "b.pt.rank0.asking1")]
        procs.append(group_launch(tmp_path / "a.pt", "a", *common, *hold, lighthouse=address, where=a_cmd))
        doomed = ["--die-at", str(die_at), "--die-rank", "1"]
        procs.append(group_launch(tmp_path / "b.pt", "b", *common, *doomed, lighthouse=address, where=b_cmd))
        logs = [finish(p, timeout=200) for p in procs[1:]]
    finally:
        stop_all(procs, None)
    for p, text in zip(procs[1:], logs, strict=True):
        assert p.returncode == 0, f"die_at={die_at}\n{text[-4000:]}"
    a_log, b_log = logs
    assert "gloo via unvA" in a_log and "gloo via unvB" in b_log  # the interfaces between the two hosts
    assert f"epoch 0 step {die_at} failed with 2 replicas; redone with" in a_log
    assert "restarting replica b (1/1); the other replicas keep training" in b_log
    assert "healed from a live peer (replica a)" in b_log
    want = torch.load(tmp_path / "plain.pt")["weights"]
    runs = {f"{g}{r}": torch.load(tmp_path / f"{g}.pt.rank{r}") for g in "ab" for r in (0, 1)}
    for name, run in runs.items():
        for key, value in want.items():
            torch.testing.assert_close(run["weights"][key], value, rtol=0, atol=2e-5, msg=f"{name} {key}")
            assert torch.equal(run["weights"][key], runs["a0"]["weights"][key]), f"{name} {key}"
    assert runs["a0"]["steps"] == 3 * runs["a0"]["steps_per_epoch"]  # group a never restarted


@pytest.mark.lighthouse
@pytest.mark.timeout(150)
def test_a_stalled_replica_does_not_hang_the_other_which_names_it_and_ends_on_the_uninterrupted_weights(
    tmp_path,
):
    stall_at = random.randint(3, 10)  # b is SIGSTOPped mid-step there (of 32); printed on failure
    common = ["--epochs", "2", "--timeout", "3", "--start-replicas", "2"]
    plain_run(tmp_path, 2)
    lighthouse = start_lighthouse(min_replicas=1, join_timeout_ms=2000, quorum_tick_ms=100)
    env = {**os.environ, LIGHTHOUSE_ENV: lighthouse.address()}
    procs = []
    try:
        procs.append(replica(tmp_path / "a.pt", "--replica", "a", *common, env=env))
        procs.append(
            replica(tmp_path / "b.pt", "--replica", "b", "--stall-at", str(stall_at), *common, env=env)
        )
        log = finish(procs[0], timeout=100)
        assert procs[1].poll() is None  # b is still there, stopped: a went on without it
    finally:
        stop_all(procs, lighthouse)
    assert procs[0].returncode == 0, f"stall_at={stall_at}\n{log[-3000:]}"
    line = "failed with 2 replicas; redone with 1 over the same items; replica(s) b left the quorum"
    assert line in log, f"stall_at={stall_at}\n{log[-3000:]}"
    run = torch.load(tmp_path / "a.pt")
    want = torch.load(tmp_path / "plain.pt")["weights"]
    for key, value in want.items():
        torch.testing.assert_close(run["weights"][key], value, rtol=0, atol=2e-5, msg=key)
    assert run["steps"] == 32 and run["events"]["participants"][-1] == 1
    gaps = [b - a for a, b in zip(run["times"], run["times"][1:], strict=False)]
    assert max(gaps) < 15, f"stall_at={stall_at}: a stalled {max(gaps):.1f} s (timeout 3 s, join 2 s)"


def fetched(path):
    """The lists of indices a --counted replica loaded, one per fetch, in order."""
    return [[int(i) for i in line.split()] for line in Path(path).read_text().splitlines()]


@pytest.mark.lighthouse
@pytest.mark.timeout(150)
def test_each_replica_loads_only_its_rows_and_a_survivor_loads_the_rows_it_lacks_to_redo_a_step(tmp_path):
    """Two replicas each load half of every step (rows p::2 of the loader's batch, in its order),
    not the whole batch; one is killed mid-step, and the survivor loads that step's rows again
    whole (its new share, the rows it lacked with it), then whole batches alone, ending exact."""
    die_at = random.randint(3, 10)  # b is SIGKILLed mid-step here (of 32); printed on failure
    common = ["--epochs", "2", "--timeout", "10", "--start-replicas", "2", "--counted"]
    plain_run(tmp_path, 2, "--counted")
    lighthouse = start_lighthouse(min_replicas=1, join_timeout_ms=2000, quorum_tick_ms=100)
    env = {**os.environ, LIGHTHOUSE_ENV: lighthouse.address()}
    procs = []
    try:
        procs.append(replica(tmp_path / "a.pt", "--replica", "a", *common, env=env))
        procs.append(replica(tmp_path / "b.pt", "--replica", "b", "--die-at", str(die_at), *common, env=env))
        logs = [finish(p, timeout=120) for p in procs]
    finally:
        stop_all(procs, lighthouse)
    assert procs[0].returncode == 0 and procs[1].returncode == -9, f"die_at={die_at}\n{logs[0][-3000:]}"
    redone = f"step {die_at} failed with 2 replicas; redone with 1 over the same items"
    assert redone in logs[0], logs[0][-3000:]
    steps = fetched(tmp_path / "plain.pt.fetched")  # one process: each step's whole batch
    assert len(steps) == 32 and sorted(i for s in steps[:16] for i in s) == list(range(192))
    a, b = fetched(tmp_path / "a.pt.fetched"), fetched(tmp_path / "b.pt.fetched")
    p = 0 if a[0] == steps[0][0::2] else 1  # a's place among the two participants
    assert b == [s[1 - p :: 2] for s in steps[: die_at + 1]], f"die_at={die_at}"  # half of each, then killed
    halves = [s[p::2] for s in steps[: die_at + 1]]
    assert a == [*halves, steps[die_at], *steps[die_at + 1 :]], f"die_at={die_at}"  # the redo, then alone
    run = torch.load(tmp_path / "a.pt")
    want = torch.load(tmp_path / "plain.pt")["weights"]
    for key, value in want.items():
        torch.testing.assert_close(run["weights"][key], value, rtol=0, atol=2e-5, msg=key)
    assert run["steps"] == 32 and run["events"]["redone"] == 1


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--min-replicas", "0"], "--min-replicas must be at least 1, got 0"),
        (["--quorum-tick-ms", "0"], "--quorum-tick-ms must be at least 1 (milliseconds), got 0"),
        (["--port", "70000"], "--port must be in 0..65535, got 70000"),
    ],
)
def test_unison_lighthouse_refuses_bad_input_in_one_line_as_launch_does(argv, said, capsys):
    """The same checks and words as `unison launch --start-lighthouse --lighthouse-...`."""
    from unison.cli import main

    assert main(["lighthouse", *argv]) == 2
    assert capsys.readouterr().err == f"unison lighthouse: {said}\n"


@pytest.mark.lighthouse
@pytest.mark.timeout(120)
def test_unison_lighthouse_makes_quorums_refuses_a_port_in_use_and_stops_on_sigterm(tmp_path):
    from torchft.coordination import LighthouseClient

    cmd = [sys.executable, "-m", "unison.cli", "lighthouse", "--min-replicas", "1"]
    proc = subprocess.Popen(
        [*cmd, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        line = proc.stdout.readline().strip()  # bounded by the test's timeout
        assert line.startswith(f"{LIGHTHOUSE_ENV}=http://"), line
        address = line.split("=", 1)[1]
        client = LighthouseClient(address, connect_timeout=timedelta(seconds=10))
        quorum = client.quorum(replica_id="a", timeout=timedelta(seconds=10), step=7, world_size=1)
        assert [(m.replica_id, m.step) for m in quorum.participants] == [("a", 7)]
        port = address.rsplit(":", 1)[1]
        second = run_or_report([*cmd, "--port", port], 60)
        assert second.returncode == 1
        assert second.stderr.startswith(f"unison lighthouse: could not start on port {port}: "), second.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.lighthouse
@pytest.mark.timeout(300)
def test_after_losing_every_replica_the_job_resumes_from_checkpoints_and_ends_on_the_uninterrupted_weights(
    tmp_path,
):
    die_at = random.randint(3, 40)  # every replica dies mid-step here (of 64); printed on failure
    plain_run(tmp_path, 4)
    # No replica is lost after the resume: the lighthouse waits 15 s for a late one. With 2 s, a
    # replica slowed that much on a loaded machine (an epoch's end) missed a step's quorum, was
    # healed past its own step and refused to go on (ReplicaBehindError), as it must.
    lighthouse = start_lighthouse(min_replicas=2, join_timeout_ms=15000, quorum_tick_ms=100)
    env = {**os.environ, LIGHTHOUSE_ENV: lighthouse.address()}
    procs = []
    try:
        for attempt, extra in (("lost", ["--die-at", str(die_at)]), ("resumed", ["--resume"])):
            # All three start together: a replica that asked late would be healed from the others
            # past the steps they took without it (a loaded machine: 3 s late), not resume from its
            # checkpoint, and train fewer steps after resuming than the others.
            common = ["--epochs", "4", "--min-replicas", "2", "--start-replicas", "3", *extra]
            procs = [
                replica(
                    tmp_path / f"{attempt}-r{r}.pt",
                    "--replica",
                    f"r{r}",
                    "--dir",
                    str(tmp_path / f"r{r}"),
                    *common,
                    env=env,
                )
                for r in range(3)
            ]
            logs = [finish(p, timeout=150) for p in procs]
            want = -9 if attempt == "lost" else 0
            for p, log in zip(procs, logs, strict=True):
                assert p.returncode == want, f"die_at={die_at} {attempt}\n{log[-3000:]}"
    finally:
        stop_all(procs, lighthouse)
    want = torch.load(tmp_path / "plain.pt")["weights"]
    for r in range(3):
        run = torch.load(tmp_path / f"resumed-r{r}.pt")
        assert run["steps"] == 64 - die_at, (
            f"die_at={die_at}: r{r} trained {run['steps']} steps after resuming"
        )
        for key, value in want.items():
            torch.testing.assert_close(run["weights"][key], value, rtol=0, atol=2e-5, msg=f"r{r} {key}")
