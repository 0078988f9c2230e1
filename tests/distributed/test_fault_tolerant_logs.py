"""What fault-tolerant replicas show: their tables agree with each other and with one process, their
start-up lines say what happened, and torchft's INFO lines stay out unless asked for.

Two replica groups started together under `unison launch` (one serving the lighthouse with the
timing options), and the plain one-process run they are compared with.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.hangs import run_or_report
from unison.launch.launcher import parse_options
from unison.launch.options import LaunchError

pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "fault_scripts" / "ft_table.py")
LAUNCH = [sys.executable, "-m", "unison.launch"]
WAIT_S = 180


def test_start_lighthouse_takes_the_lighthouse_timings_and_refuses_them_alone_or_below_1_ms():
    opts = parse_options(
        ["--start-lighthouse", "--lighthouse-port", "0", "--lighthouse-join-timeout-ms", "300",
         "--lighthouse-quorum-tick-ms", "20", "--lighthouse-heartbeat-timeout-ms", "4000", SCRIPT]
    )  # fmt: skip
    assert (opts.replica.join_timeout_ms, opts.replica.quorum_tick_ms, opts.replica.heartbeat_timeout_ms) == (
        300,
        20,
        4000,
    )
    with pytest.raises(LaunchError, match="^--lighthouse-join-timeout-ms needs --start-lighthouse"):
        parse_options(["--lighthouse-join-timeout-ms", "300", SCRIPT])
    with pytest.raises(
        LaunchError, match=r"^--lighthouse-quorum-tick-ms must be at least 1 \(milliseconds\), got 0"
    ):
        parse_options(
            ["--start-lighthouse", "--lighthouse-port", "0", "--lighthouse-quorum-tick-ms", "0", SCRIPT]
        )


def values(log: str) -> dict:
    found = re.search(r"VALUES (\{.*\})", log)
    assert found, log[-3000:]
    return json.loads(found.group(1))


@pytest.mark.launch
@pytest.mark.lighthouse
@pytest.mark.timeout(WAIT_S + 60)
def test_replicas_started_together_print_the_same_table_as_one_process_and_say_so_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RUST_LOG", "UNISON_FT_VERBOSE")}
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b")}
    ft = [SCRIPT, "--start-replicas", "2"]
    serve = ["--start-lighthouse", "--lighthouse-port", "0", "--min-replicas", "2"]
    serve += ["--lighthouse-join-timeout-ms", "500", "--lighthouse-quorum-tick-ms", "50"]
    procs = []
    try:
        with open(logs["a"], "w") as out:
            procs.append(
                subprocess.Popen([*LAUNCH, *serve, "--replica-id", "a", *ft], stdout=out, stderr=out, env=env)
            )
        deadline = time.monotonic() + 60
        while not (address := re.search(r"lighthouse serving at (http://\S+)", logs["a"].read_text())):
            assert procs[0].poll() is None and time.monotonic() < deadline, logs["a"].read_text()
            time.sleep(0.1)
        with open(logs["b"], "w") as out:
            cmd = [*LAUNCH, "--lighthouse", address.group(1), "--replica-id", "b", *ft]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=out, env=env))
        plain = run_or_report([sys.executable, SCRIPT, "--plain"], WAIT_S)
        for proc in procs:
            proc.wait(timeout=WAIT_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    shown = {name: path.read_text() for name, path in logs.items()}
    for proc, name in zip(procs, shown, strict=True):
        assert proc.returncode == 0, shown[name][-3000:]
    assert plain.returncode == 0, plain.stderr
    got = {name: values(text) for name, text in shown.items()}
    want = values(plain.stdout)
    # train_loss is the whole global batch's: the same on both replicas, and the plain run's
    assert got["a"]["values"] == got["b"]["values"]
    assert got["a"]["losses"] == got["b"]["losses"]
    for row, plain_row in zip(got["a"]["values"], want["values"], strict=True):
        assert row == pytest.approx(plain_row, rel=1e-6), (got, want)
    assert got["a"]["losses"] == pytest.approx(want["losses"], rel=1e-6)
    # one line each says they started together; one took the other's initial weights (not a recovery)
    for name, text in shown.items():
        assert f"unison: replica {name}: started with replicas a, b at epoch 0 step 0" in text, text[-3000:]
        assert "healed from a live peer" not in text
        assert "[INFO]" not in text and "torchft::manager" not in text  # torchft's per-step lines stay out
    took = [
        n for n, text in shown.items() if "'s weights and optimizer state, so all start identical" in text
    ]
    assert len(took) <= 1, shown


@pytest.mark.procs
def test_a_launch_shares_the_cores_with_the_workers_of_other_launches_and_says_so(tmp_path):
    """A stand-in for another launch (a process whose 2 children run `-m unison.launch.worker`):
    this launch's plan divides the cores among its worker and theirs, and one line says so. (Other
    launches on this machine, such as other test runs, may add to the count: compared as bounds.)"""
    from unison.distributed.env import threads_per_worker
    from unison.launch.launcher import plan_launch
    from unison.launch.neighbours import other_launches

    worker = "[sys.executable, '-c', 'import time; time.sleep(60)', '-m', 'unison.launch.worker']"
    child = f"import subprocess, sys, time\nw = [subprocess.Popen({worker}) for _ in range(2)]\n"
    other = subprocess.Popen(
        [sys.executable, "-c", child + "print('up', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    saved = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        assert other.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 30  # (a loaded machine: /proc may show a child a moment late)
        while other_launches().get(other.pid) != 2:
            assert time.monotonic() < deadline, other_launches()
            time.sleep(0.1)
        plan = plan_launch(parse_options(["--nproc", "1", SCRIPT]), str(tmp_path))
        assert 1 <= int(plan.env["OMP_NUM_THREADS"]) <= threads_per_worker(3)
        [note] = plan.notes
        found = re.fullmatch(
            r"unison launch: note: (\d+) other launch(?:es)? here runs? (\d+) worker\(s\); "
            r"the cores are shared among all (\d+) \((\d+) thread\(s\) each; OMP_NUM_THREADS chooses\)",
            note,
        )
        assert found, note
        launches, workers, total, threads = map(int, found.groups())
        assert launches >= 1 and workers >= 2 and total == workers + 1
        assert threads == int(plan.env["OMP_NUM_THREADS"]) == threads_per_worker(total)
    finally:
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved
        for proc in psutil.Process(other.pid).children():
            proc.kill()
        other.kill()
        other.wait()
    assert other.pid not in other_launches()


def test_torchft_tracebacks_fold_to_one_line_and_its_info_lines_go_unless_verbose(monkeypatch, caplog):
    """What a survivor logs at a lost peer: torchft's `Manager.exception` (a gloo error) becomes one
    line naming the switch; `verbose` keeps the traceback; RUST_LOG=warn unless the user set it."""
    import logging

    from unison.distributed.ft_logs import VERBOSE_ENV, quiet_torchft

    monkeypatch.delenv("RUST_LOG", raising=False)
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    logger = logging.getLogger("torchft.manager")
    monkeypatch.setattr(logger, "filters", [])  # (the logger's own list: restored after the test)

    def lost_peer() -> None:
        try:
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:10442.\nmore")
        except RuntimeError as exc:
            logger.exception(f"[a/0 - step 8] got exception waiting for work {exc}")

    assert quiet_torchft(verbose=True) is True and "RUST_LOG" not in os.environ
    with caplog.at_level(logging.INFO, logger="torchft.manager"):
        lost_peer()
    assert caplog.records[-1].exc_info is not None  # verbose: the traceback stays
    caplog.clear()
    assert quiet_torchft() is False and os.environ["RUST_LOG"] == "warn"
    with caplog.at_level(logging.INFO, logger="torchft.manager"):
        lost_peer()
        logger.warning("Unable to reset NCCL flight recorder recording so traces will be incorrect.")
        logger.warning("a real torchft warning")
    assert [r.getMessage() for r in caplog.records] == [
        "[a/0 - step 8] got exception waiting for work [pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:10442. [UNISON_FT_VERBOSE=1 shows the traceback]",
        "a real torchft warning",
    ]
    assert all(r.exc_info is None for r in caplog.records)
    monkeypatch.setenv("RUST_LOG", "debug")
    quiet_torchft()
    assert os.environ["RUST_LOG"] == "debug"  # the user's choice is kept


@pytest.mark.launch
@pytest.mark.lighthouse
@pytest.mark.timeout(WAIT_S + 60)
def test_a_replica_group_of_two_processes_speaks_with_one_voice(tmp_path):
    """Group rank 1 computes what rank 0 does (each rank of a group is a full learner under
    torchft), but only group rank 0 prints the table (it printed it too, as did its checkpoints)."""
    serve = ["--start-lighthouse", "--lighthouse-port", "0", "--min-replicas", "1", "--replica-id", "a"]
    cmd = [*LAUNCH, "--nproc", "2", *serve, SCRIPT, "--min-replicas", "1", "--epochs", "1"]
    done = run_or_report(cmd, WAIT_S)
    shown = done.stdout + done.stderr
    assert done.returncode == 0, shown[-3000:]
    headers = [line for line in shown.splitlines() if re.search(r"\bepoch\s+train_loss\s+valid_loss", line)]
    assert len(headers) == 1 and headers[0].startswith("[rank0]"), shown[-3000:]
    rows = {rank: values(line) for line in shown.splitlines() if (rank := line[:7]) in ("[rank0]", "[rank1]")
            and "VALUES" in line}  # fmt: skip
    assert rows["[rank0]"] == rows["[rank1]"], rows  # the same computation on both ranks
