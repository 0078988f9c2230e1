"""Each rank's output under `unison launch` (unison.launch.logs), in this process: the files
`RankLogsSpecs` lays out, the `[rank<R>] ` prefix torch's own tailer puts on the console, the
console filters, the restart lines read from real error files, and a console that goes away.

What torch's agent does around them is done here with torch's own pieces (its `TailLog`, its
`ErrorHandler`, its agent's logger); no launch: the in-process tier.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import time
from string import Template

import pytest
from torch.distributed.elastic.multiprocessing.api import Std
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from torch.distributed.elastic.multiprocessing.tail_log import TailLog

from unison.callbacks.preemption import Preempted
from unison.checkpoint.errors import DiskFullError
from unison.launch.launcher import parse_options, plan_launch
from unison.launch.logs import RankLogsSpecs, RestartRefused, pointless_restart

AGENT_LOG = logging.getLogger("torch.distributed.elastic.multiprocessing.api")  # what torch's agent logs to


def record(path: str, exc: BaseException, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's error file at `path`, written by torch's ErrorHandler from a raised `exc`."""
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", path)
    try:
        raise exc
    except BaseException as raised:  # noqa: B036  (Preempted is a SystemExit)
        ErrorHandler().record_exception(raised)


def node_envs(*ranks: int, restart: int = 0, most: int = 3) -> dict[int, dict[str, str]]:
    """What torch's agent gives `reify`: each local rank's environment (global ranks `ranks`)."""
    return {
        local: {
            "RANK": str(rank),
            "TORCHELASTIC_RESTART_COUNT": str(restart),
            "TORCHELASTIC_MAX_RESTARTS": str(most),
        }
        for local, rank in enumerate(ranks)
    }


def test_every_line_reaches_the_console_with_its_global_ranks_prefix(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    plan = plan_launch(parse_options(["--nproc", "2", str(script)]), str(tmp_path / "logs"))
    envs = node_envs(2, 3)  # the second node of a 2 x 2 job: global ranks 2 and 3
    dest = plan.logs.reify(envs)
    attempt = tmp_path / "logs" / "attempt_0"
    assert dest.stdouts == {0: str(attempt / "rank2.stdout.log"), 1: str(attempt / "rank3.stdout.log")}
    assert dest.stderrs == {0: str(attempt / "rank2.stderr.log"), 1: str(attempt / "rank3.stderr.log")}
    assert dest.tee_stdouts == dest.stdouts and dest.tee_stderrs == dest.stderrs  # every stream shown
    assert [e["TORCHELASTIC_ERROR_FILE"] for e in envs.values()] == [
        str(attempt / "rank2.error.json"),
        str(attempt / "rank3.error.json"),
    ]
    # the prefixes torch's agent makes from the plan's template (local_elastic_agent._start_workers)
    template = Template(plan.config.log_line_prefix_template)
    prefixes = {lr: template.safe_substitute(role_name="default", rank=env["RANK"], local_rank=lr)
                for lr, env in envs.items()}  # fmt: skip
    console = io.StringIO()
    tail = TailLog("stdout", dest.tee_stdouts, console, prefixes, interval_sec=0.01).start()
    with open(dest.stdouts[0], "a") as rank2, open(dest.stdouts[1], "a") as rank3:
        rank2.write("epoch 0 loss 0.5\n")
        rank3.write("a line\nanother line\n")
    # torch's tailer drops what lands between its last empty read and stop() (it reads to the end
    # only if the file grew before it saw `finished`): wait for the lines, then stop it
    deadline = time.monotonic() + 30
    while console.getvalue().count("\n") < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    tail.stop()
    assert sorted(console.getvalue().splitlines()) == [
        "[rank2] epoch 0 loss 0.5",
        "[rank3] a line",
        "[rank3] another line",
    ]


@pytest.mark.parametrize(
    "ranks_filter, redirects, shown",
    [
        (None, "0", {(0, "out"), (0, "err"), (1, "out"), (1, "err")}),
        ({1}, "0", {(1, "out"), (1, "err")}),  # torchrun's --local-ranks-filter 1
        (None, "1", {(0, "err"), (1, "err")}),  # --redirects 1: every stdout to its file only
        (None, "3", set()),
        (None, "0:3,1:2", {(1, "out")}),  # per local rank: 0 both off, 1 stderr off
        ({0}, "0:2", {(0, "out")}),
    ],
)
def test_the_console_shows_the_streams_the_filters_leave(tmp_path, ranks_filter, redirects, shown):
    specs = RankLogsSpecs(str(tmp_path), ranks_filter=ranks_filter, redirects=redirects)
    streams = {"out": Std.OUT, "err": Std.ERR}
    got = {(lr, name) for lr in (0, 1) for name, std in streams.items() if specs.on_console(lr, std)}
    assert got == shown
    dest = specs.reify(node_envs(0, 1))
    assert {(lr, "out") for lr in dest.tee_stdouts} | {(lr, "err") for lr in dest.tee_stderrs} == shown
    assert len(dest.stdouts) == len(dest.stderrs) == 2  # every stream is kept in its file all the same


def test_a_restart_says_which_rank_failed_and_how_from_its_error_file(tmp_path, monkeypatch, capsys):
    specs = RankLogsSpecs(str(tmp_path))
    first = specs.reify(node_envs(0, 1))
    record(first.error_files[1], ValueError("boom"), monkeypatch)
    # torch's agent logs the failure it restarts after (exit code, local rank)
    AGENT_LOG.warning("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 1, 1, 4242, "python")
    again = specs.reify(node_envs(0, 1, restart=1, most=3))
    assert capsys.readouterr().err == (
        "unison launch: restarting the workers (restart 1 of 3): "
        "rank 1 failed (exit code 1): ValueError: boom\n"
    )
    assert again.stdouts[0] == str(tmp_path / "attempt_1" / "rank0.stdout.log")  # the first kept apart
    assert (tmp_path / "attempt_0" / "rank1.error.json").exists()
    # a replica group of several (--replica-id b): only this group restarts, and says so
    group = RankLogsSpecs(str(tmp_path / "b"), replica="b")
    first = group.reify(node_envs(0, 1))
    record(first.error_files[0], RuntimeError("lost"), monkeypatch)
    AGENT_LOG.warning("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 1, 0, 4243, "python")
    group.reify(node_envs(0, 1, restart=1, most=2))
    assert capsys.readouterr().err == (
        "unison launch: replica b: worker rank 0 exited with exit code 1: RuntimeError: lost; "
        "restarting replica b (1/2); the other replicas keep training\n"
    )


def test_a_restart_into_the_same_failure_is_refused(tmp_path, monkeypatch, capsys):
    specs = RankLogsSpecs(str(tmp_path))
    first = specs.reify(node_envs(0, 1))
    full = DiskFullError("disk full (ENOSPC) writing /ck/checkpoint.pth")
    record(first.error_files[1], full, monkeypatch)
    assert pointless_restart(str(tmp_path / "attempt_0")) == (
        "rank 1 failed with DiskFullError: disk full (ENOSPC) writing /ck/checkpoint.pth"
    )
    with pytest.raises(RestartRefused, match=r"^not restarting: rank 1 failed with DiskFullError: disk full"):
        specs.reify(node_envs(0, 1, restart=1))
    assert pointless_restart(str(tmp_path / "nowhere")) is None


def test_a_node_joining_restarts_preempted_workers_without_counting_it(tmp_path, monkeypatch, capsys):
    """A node (re)joining stops every worker with SIGTERM: they stop checkpointed (Preempted) and the
    restart, with torch's restart count unchanged, goes on; the same Preempted after a counted
    restart (the job was told to stop) is refused."""
    specs = RankLogsSpecs(str(tmp_path))
    first = specs.reify(node_envs(0, 1))
    record(first.error_files[0], Preempted("SIGTERM", 0, 2, "/ck/c.pth"), monkeypatch)
    specs.reify(node_envs(0, 1, restart=0))
    assert capsys.readouterr().err == (
        "unison launch: restarting the workers: a node (re)joined the job "
        "(not counted against --max-restarts)\n"
    )
    second = specs.attempts - 1
    record(
        str(tmp_path / f"attempt_{second}" / "rank0.error.json"),
        Preempted("SIGTERM", 0, 4, None),
        monkeypatch,
    )
    with pytest.raises(
        RestartRefused, match="^not restarting: rank 0 failed with Preempted: preempted by SIGTERM"
    ):
        specs.reify(node_envs(0, 1, restart=1))


def test_workers_killed_after_the_grace_are_counted(tmp_path):
    specs = RankLogsSpecs(str(tmp_path))
    assert specs.stragglers("SIGTERM", 20.0) == ""
    for pid in (11, 12):  # what torch's agent logs for each worker it must kill
        AGENT_LOG.warning("Unable to shutdown process %s via %s, forcefully exiting via %s", pid, 15, 9)
    assert (
        specs.stragglers("SIGTERM", 20.0)
        == " (2 workers did not end within 20 s of SIGTERM and were killed (SIGKILL))"
    )
    assert RankLogsSpecs(str(tmp_path)).stragglers("SIGTERM", None) == ""  # a new launch counts afresh
    AGENT_LOG.warning("Unable to shutdown process %s via %s, forcefully exiting via %s", 13, 15, 9)
    assert specs.stragglers("SIGINT", None) == " (1 worker did not end of SIGINT and was killed (SIGKILL))"


def test_the_launchers_line_starts_a_line_of_its_own_after_a_cut_off_rank_line(tmp_path, capsys):
    specs = RankLogsSpecs(str(tmp_path))
    with specs.console_guard():
        sys.stdout.write("[rank0]     learn.fit(3)")  # the rank was killed mid-line
        specs.say("unison launch: restarting the workers (restart 1 of 1)")
        sys.stdout.write("[rank0] second attempt\n")
    out, err = capsys.readouterr()
    assert out == "[rank0]     learn.fit(3)\n[rank0] second attempt\n"
    assert err == "unison launch: restarting the workers (restart 1 of 1)\n"


def test_a_rank_line_read_in_two_parts_shows_one_prefix_and_another_ranks_line_its_own(tmp_path, capsys):
    """torch's tailer reads a rank's file by lines and prefixes what it read: a line the rank wrote in
    two parts (print's text, then its newline, read in between on a loaded machine) came out as
    `[rank1] {...}[rank1] ` (seen in a loaded double run, 2026-11-27)."""
    specs = RankLogsSpecs(str(tmp_path))
    with specs.console_guard():
        sys.stdout.write('[rank1] {"rank": 1}')  # what the tailer read before the newline came
        sys.stdout.write("[rank1] \n")  # the rest of that line
        sys.stdout.write("[rank0] half")
        sys.stdout.write("[rank1] whole\n")  # another rank's line: the open one ends first
        sys.stdout.write("[rank0]  a line\n")  # rank 0's next part comes after: its own prefix again
    out, _ = capsys.readouterr()
    assert out == '[rank1] {"rank": 1}\n[rank0] half\n[rank1] whole\n[rank0]  a line\n'


def test_a_console_whose_reader_left_drops_lines_once_said_and_keeps_the_logs(tmp_path, monkeypatch, capfd):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone: writing raises BrokenPipeError (EPIPE)
    gone = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", gone)
    specs = RankLogsSpecs(str(tmp_path))
    with specs.console_guard():
        for n in range(3):
            print(f"[rank0] step {n}")  # the tailers go on writing: nothing raises
    assert specs.console_lost
    err = capfd.readouterr().err
    assert err.count("unison launch: note: the console's stdout was closed (BrokenPipeError)") == 1
    assert f"every rank's output is kept in {tmp_path} (attempt_<k>/rank<R>.stdout.log)" in err
    monkeypatch.undo()
    gone.close()
