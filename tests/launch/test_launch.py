"""`unison launch` and `unison env`: option checks, real launches, failures, restarts, seed examples.

Every launch is a real subprocess (torch's elastic agent and real workers) with a bounded wait.
Launches that do not depend on each other run at the same time to keep the suite short.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.hangs import communicate_or_report
from tests.warm_runner import WarmProcess
from tests.warm_runner import start as warm_start
from unison.cli import env_report
from unison.cli import main as cli_main
from unison.distributed.env import threads_per_worker
from unison.launch import launcher as launch_mod
from unison.launch.options import LaunchError

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"
PY = sys.executable
UNISON = str(Path(sys.executable).parent / "unison")
LAUNCH = [PY, "-m", "unison.launch"]
WAIT_S = 90  # bound on any one launch
# What `--gpus 0,99` must say here: no GPU at all (a CPU machine), or GPU 99 absent.
NO_GPU = "this machine has no GPU" if torch.cuda.device_count() == 0 else "GPU [99] not present"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    cmd: list[str], env: dict[str, str] | None = None, unset: tuple[str, ...] = (), cwd: Path = ROOT
) -> tuple[subprocess.Popen | WarmProcess, float]:
    """Start `cmd` in `cwd` (stdout and stderr captured apart); return it with its start time.
    A launch or a script on this machine runs as a fork of the warm runner (tests/warm_runner.py);
    anything else (the console script, `ip netns exec`, torchrun) is a `subprocess.Popen`."""
    full_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset}
    proc = warm_start(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, time.monotonic()


def finish(
    started: tuple[subprocess.Popen | WarmProcess, float], timeout: float = WAIT_S
) -> tuple[int, str, str, float]:
    """Wait for a started command (killing it past `timeout`); return rc, stdout, stderr, seconds."""
    proc, t0 = started
    out, err = communicate_or_report(proc, timeout)
    return proc.returncode, out, err, time.monotonic() - t0


def run(
    cmd: list[str], env: dict[str, str] | None = None, timeout: float = WAIT_S, cwd: Path = ROOT
) -> tuple[int, str, str, float]:
    return finish(start(cmd, env, cwd=cwd), timeout)


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def tagged(text: str, tag: str) -> list[dict]:
    """The JSON payloads of lines `[rankR] TAG {...}` (or `TAG {...}`), with the prefix's rank added."""
    found = []
    for line in text.splitlines():
        m = re.match(rf"^(?:\[rank(\d+)\] )?{tag} (\{{.*\}})$", line)
        if m:
            found.append({**json.loads(m.group(2)), "_prefix": m.group(1)})
    return found


# ---- options, checked in this process (no launch) -------------------------------------------------
@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc", "0", "{s}"], "--nproc must be at least 1, got 0"),
        (["--nproc", "2", "missing_script.py"], "script not found: missing_script.py"),
        (["--gpus", "0,99", "{s}"], NO_GPU),
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "--master-port", "1", "{s}"],
            "--node-rank 2 is outside --nnodes 2",
        ),
        (["--nnodes", "2", "{s}"], "needs --master-addr and --master-port"),
        (["--nnodes", "1:3", "--master-addr", "127.0.0.1", "--master-port", "5", "{s}"], "needs an elastic"),
        (["--standalone", "--nnodes", "2", "{s}"], "--standalone is one machine"),
        (["--rdzv-endpoint", "nohostport", "{s}"], "expected HOST:PORT"),
        (["--master-addr", "no-such-host.invalid", "--master-port", "5", "{s}"], "cannot resolve host"),
        (["--timeout", "0", "{s}"], "--timeout must be a positive"),
        (["--max-restarts", "-1", "{s}"], "--max-restarts must be >= 0"),
        (
            [
                "--nnodes",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                "5",
                "--max-restarts",
                "1",
                "{s}",
            ],
            "--max-restarts across machines needs an elastic rendezvous",
        ),
        (["--nproc", "two", "{s}"], "--nproc two: expected a number of processes or one of auto"),
        # torchrun's options: refused with what to use instead, or checked as torchrun checks them
        (["-m", "--no-python", "x"], "-m/--module and --no-python exclude each other"),
        (["-m", "no_such_module_for_unison", "x"], "no module named 'no_such_module_for_unison'"),
        (["--no-python", "no-such-program-for-unison"], "not an executable file, nor a program on PATH"),
        (["--logs-specs", "mine", "{s}"], "unison launch writes its own per-rank logs (use --log-dir D"),
        (["--local-ranks-filter", "0,a", "{s}"], "--local-ranks-filter 0,a: expected local ranks"),
        (["--redirects", "7", "{s}"], "--redirects 7: expected 0-3"),
        (["--rdzv-backend", "c10d", "--nnodes", "2", "{s}"], "needs --rdzv-endpoint HOST:PORT"),
        (
            ["--nproc-per-node", "gpu", "{s}"] if not torch.cuda.is_available() else ["--nproc", "0", "{s}"],
            "this machine has no GPU" if not torch.cuda.is_available() else "--nproc must be at least 1",
        ),
        (["--monitor-interval", "0", "{s}"], "--monitor-interval must be positive"),
    ],
)
def test_bad_options_raise_one_line(argv: list[str], message: str, script: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch_mod.parse_options([a.format(s=script) for a in argv])
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert time.monotonic() - t0 < 10


def test_gpu_checks_against_device_count(monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(LaunchError, match=r"--gpus 0,3: GPU \[3\] not present; this machine has 2"):
        launch_mod.parse_options(["--gpus", "0,3", script])
    with pytest.raises(LaunchError, match="--nproc 3 conflicts with --gpus 0,1"):
        launch_mod.parse_options(["--nproc", "3", "--gpus", "0,1", script])
    assert launch_mod.parse_options(["--gpus", "all", script]).nproc == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")  # ids count within what is visible
    plan = launch_mod.plan_launch(launch_mod.parse_options(["--gpus", "1", script]), "/tmp/unused")
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "5" and plan.config.nproc_per_node == 1


def test_port_in_use_on_node_zero(script: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), script]
        with pytest.raises(LaunchError, match=f"--master-port {port} is already in use"):
            launch_mod.parse_options(["--node-rank", "0", *argv])
        launch_mod.parse_options(["--node-rank", "1", *argv])  # node 1 only connects to it


def test_plans_use_torch_rendezvous(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    one = launch_mod.plan_launch(launch_mod.parse_options(["--nproc", "2", "--timeout", "7", script]), "/x")
    # One machine: the agents rendezvous through a file (no port at all, never 29500).
    assert one.config.rdzv_backend == "c10d" and one.config.rdzv_configs["store_type"] == "file"
    assert "unison-rendezvous-" in one.config.rdzv_endpoint and one.config.local_addr == "127.0.0.1"
    assert one.env["OMP_NUM_THREADS"] == str(threads_per_worker(2))
    assert one.env["UNISON_TIMEOUT"] == "7.0" and one.env["GLOO_SOCKET_IFNAME"] == "lo"
    assert one.env["THP_MEM_ALLOC_ENABLE"] == "1"  # torch's huge pages for large CPU tensors
    assert one.args == ["-m", "unison.launch.worker", script]
    port = str(free_port())
    static = launch_mod.parse_options(
        [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            "--timeout",
            "30",
            "--legacy-local-rank",
            script,
            "--lr",
            "3",
        ]
    )
    plan = launch_mod.plan_launch(static, "/x")
    assert (plan.config.rdzv_backend, plan.config.rdzv_endpoint) == ("static", f"127.0.0.1:{port}")
    assert plan.config.rdzv_configs == {"rank": 1, "timeout": 30}
    assert plan.args == ["-m", "unison.launch.worker", script, "--local_rank=${local_rank}", "--lr", "3"]
    elastic = launch_mod.parse_options(["--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}", script])
    plan = launch_mod.plan_launch(elastic, "/x")
    # torch's c10d rendezvous, each store call bounded by its read_timeout (a cut link outlasts it)
    assert (plan.config.rdzv_backend, plan.config.min_nodes, plan.config.max_nodes) == ("unison-c10d", 1, 2)
    assert plan.config.run_id == "unison" and plan.config.local_addr == "127.0.0.1"
    # every c10d round (a restart, a node joining) gets a fresh store (pytorch#135712), so the
    # workers' keys need no per-round value, which the nodes would not agree on (restart counts)
    assert plan.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    again = launch_mod.plan_launch(launch_mod.parse_options(["--max-restarts", "2", script]), "/x")
    assert again.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and again.config.max_restarts == 2
    fixed = launch_mod.parse_options(["--master-port", port, "--max-restarts", "1", script])
    plan = launch_mod.plan_launch(fixed, "/x")
    assert (plan.config.rdzv_backend, plan.config.rdzv_endpoint) == ("c10d", f"127.0.0.1:{port}")
    assert plan.config.rdzv_configs["is_host"] is True
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")  # the user's choice wins, nothing re-exported
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    plan = launch_mod.plan_launch(launch_mod.parse_options([script]), "/x")
    assert plan.env["OMP_NUM_THREADS"] == "3" and "GLOO_SOCKET_IFNAME" not in plan.env
    assert "THP_MEM_ALLOC_ENABLE" not in plan.env


def test_env_report_and_cli(capsys: pytest.CaptureFixture[str]) -> None:
    report = env_report(
        {
            "MASTER_ADDR": "127.0.0.1",
            "RANK": "1",
            "SLURM_PROCID": "1",
            "PET_NNODES": "2",
            "TORCHX_RANK0_HOST": "h",
        }
    )
    assert "PET_NNODES=2" in report and "TORCHX_RANK0_HOST=h" in report  # Kubeflow's and TorchX's
    assert "torch " in report and "unison " in report
    assert re.search(r"backends: gloo yes, nccl (yes|no), mpi (yes|no)", report)
    assert "RANK=1" in report and "SLURM_PROCID=1" in report
    assert "gloo interface towards MASTER_ADDR=127.0.0.1: lo (127.0.0.1)" in report
    assert re.search(r"threads: torch uses \d+", report)
    assert cli_main(["env"]) == 0 and "backends:" in capsys.readouterr().out
    assert cli_main(["nonsense"]) == 2 and "unknown command" in capsys.readouterr().err
    assert launch_mod.gloo_interface("127.0.0.1") == "lo"


# ---- the command line, in real processes -----------------------------------------------------------
@pytest.mark.procs
def test_bad_input_fails_fast_on_the_command_line(tmp_path: Path) -> None:
    """A clear one-line error in well under 10 s, exit status 2, before anything starts.

    (One after the other: each must be fast on its own; the other checks run in-process above.)
    """
    script = tmp_path / "ok.py"
    script.write_text("raise SystemExit('must never run')\n")
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        cases = [
            ([UNISON, "launch", "--nproc", "2", str(tmp_path / "nope.py")], "script not found"),
            ([*LAUNCH, "--gpus", "0,99", str(script)], NO_GPU),
            (
                [*LAUNCH, "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                 "--master-port", port, str(script)],
                f"--master-port {port} is already in use",
            ),
        ]  # fmt: skip
        for cmd, message in cases:
            rc, out, err, secs = run(cmd, timeout=30)
            assert rc == 2, (cmd, out, err)
            assert message in err, (cmd, err)
            assert err.strip().count("\n") == 0, f"not one line:\n{err}"
            assert err.startswith("unison launch: error: ")
            assert secs < 10, f"{cmd} took {secs:.1f}s"
            assert "must never run" not in out + err


@pytest.mark.procs
def test_option_errors_come_before_torch_is_imported(tmp_path: Path) -> None:
    """Bad options are answered before torch loads (which alone takes seconds): the console script
    and `python -m unison.launch` both import no torch module before the one-line error."""
    script = tmp_path / "ok.py"
    script.write_text("raise SystemExit('must never run')\n")
    cases = [
        [UNISON, "launch", "--nproc", "0", str(script)],
        [*LAUNCH, "--nproc", "0", str(script)],
        [*LAUNCH, "--nnodes", "2", "--redirects", "9", str(script)],
        [*LAUNCH, "--max-restarts", "-1", "--rdzv-endpoint", "127.0.0.1:1", str(script)],
    ]
    for cmd in cases:
        rc, _, err, _ = run(cmd, env={"PYTHONPROFILEIMPORTTIME": "1"}, timeout=30)
        assert rc == 2, (cmd, err)
        errors = [line for line in err.splitlines() if not line.startswith("import time:")]
        assert len(errors) == 1 and errors[0].startswith("unison launch: error: "), err[-2000:]
        imported = [
            line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if line.startswith("import time:")
        ]
        assert "unison.launch.launcher" in imported  # the import log is real
        assert not [m for m in imported if m.split(".")[0] == "torch"], cmd


@pytest.mark.launch
def test_two_launches_at_once_env_output_and_logs(tmp_path: Path) -> None:
    """Two single-machine launches together (free ports), each checked for what its workers get."""
    probe = str(SCRIPTS / "probe.py")
    logs = tmp_path / "logs"
    a = start(
        [
            *LAUNCH,
            "--nproc",
            "2",
            "--legacy-local-rank",
            "--timeout",
            "30",
            "--log-dir",
            str(logs),
            probe,
            "x",
            "--y=1",
        ],
        unset=("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "UNISON_TIMEOUT"),
    )
    b = start([UNISON, "launch", "--nproc", "2", "--all-ranks-stdout", probe], env={"OMP_NUM_THREADS": "2"})
    rc_a, out_a, err_a, _ = finish(a)
    rc_b, out_b, err_b, _ = finish(b)
    assert rc_a == 0, err_a
    assert rc_b == 0, err_b

    # A: stdout and stderr from every rank by default, each line prefixed with its rank.
    p0, p1 = sorted(tagged(out_a, "PROBE"), key=lambda p: p["RANK"])
    assert (p0["_prefix"], p1["_prefix"]) == ("0", "1")
    assert all(re.match(r"\[rank[01]\] ", line) for line in out_a.splitlines())
    assert {"[rank0] STDERR rank 0", "[rank1] STDERR rank 1"} <= set(err_a.splitlines())
    # and in the log folder, under the global rank
    assert tagged((logs / "attempt_0" / "rank1.stdout.log").read_text(), "PROBE")[0]["pid"] == p1["pid"]
    assert (logs / "attempt_0" / "rank0.stderr.log").read_text().strip() == "STDERR rank 0"
    for rank, p in ((0, p0), (1, p1)):
        assert (p["RANK"], p["LOCAL_RANK"], p["WORLD_SIZE"], p["LOCAL_WORLD_SIZE"]) == (
            str(rank),
            str(rank),
            "2",
            "2",
        )
        assert p["MASTER_ADDR"] == "127.0.0.1" and p["MASTER_PORT"] not in (None, "29500")
        assert p["argv"] == [f"--local_rank={rank}", "x", "--y=1"]
        assert p["UNISON_TIMEOUT"] == "30.0" and p["GLOO_SOCKET_IFNAME"] == "lo"
        # The launcher's rule: the cores over its 2 workers and those other launches already run (b's 2)
        assert p["threads"] == int(p["OMP_NUM_THREADS"]) in (threads_per_worker(2), threads_per_worker(4))
        assert p["allreduce"] == 3.0
        # the script (torch's @record) writes beside torch's path; the bootstrap renames it there whole
        assert p["TORCHELASTIC_ERROR_FILE"] == str(logs / "attempt_0" / f"rank{rank}.error.json.partial")
        assert not alive(p["pid"])

    # B: every rank's stdout; the user's OMP_NUM_THREADS is kept; no --local_rank; its own port.
    probes = sorted(tagged(out_b, "PROBE"), key=lambda p: p["RANK"])
    assert [p["_prefix"] for p in probes] == ["0", "1"]
    assert all(p["threads"] == 2 and p["OMP_NUM_THREADS"] == "2" and p["argv"] == [] for p in probes)
    assert probes[0]["MASTER_PORT"] != p0["MASTER_PORT"]
    assert not list(Path(p0["TORCHELASTIC_ERROR_FILE"]).parent.glob("*.error.json"))  # no failure, no file


@pytest.mark.launch
def test_no_other_process_can_take_the_store_port_before_rank_0_binds_it(tmp_path: Path) -> None:
    """torch's agent picked a free MASTER_PORT and let it go; rank 0 bound it seconds later, and on a
    loaded machine another process had taken it by then: `OSError: [Errno 98] Address already in
    use`, an attempt lost (and a restart spent). Here rank 1 takes the port as any program would,
    before rank 0 binds it: the launcher holds the port from its choice, so the thief is refused
    and the job runs."""
    flag = tmp_path / "tried"
    rc, out, err, _ = finish(start([*LAUNCH, "--nproc", "2", str(SCRIPTS / "port_thief.py"), str(flag)]))
    assert tagged(out, "THIEF") == [{"errno": errno.EADDRINUSE, "_prefix": "1"}], out + err[-3000:]
    assert rc == 0, err[-3000:]
    assert tagged(out, "SUM") == [{"value": 3.0, "_prefix": "0"}]


def _pids(piddir: Path) -> list[int]:
    return [int(p.read_text()) for p in piddir.glob("pid*")]


@pytest.mark.launch
def test_worker_failure_gives_one_summary_and_stops_everyone(tmp_path: Path) -> None:
    fail = str(SCRIPTS / "fail.py")
    for mode, status, how, shown in [
        ("raise", 1, "exit code 1", "ValueError: boom from rank 1: bad batch 7"),
        ("kill", 137, "signal SIGKILL", None),
    ]:
        piddir = tmp_path / mode
        piddir.mkdir()
        rc, out, err, _ = run([*LAUNCH, "--nproc", "2", fail, mode, str(piddir)])
        # Timed from the failure (rank 1 fails right after both pid files exist), not from the
        # start: start-up under a loaded machine is not the fault path.
        stopped_after = time.time() - max(p.stat().st_mtime for p in piddir.glob("pid*"))
        assert rc == status, err
        assert stopped_after < 10, f"{mode}: the job took {stopped_after:.1f}s to stop after the failure"
        summary = err[err.index("unison launch: rank") :]
        assert err.count("unison launch: rank") == 1, err  # ONE summary
        assert summary.startswith(f"unison launch: rank 1 failed ({how})"), summary
        if shown:
            assert shown in summary.splitlines()[0], err
            assert '  |   File "' in summary and "load_batch()" in summary  # the user's traceback
            assert "runpy" not in summary and "_worker.py" not in summary
        assert "0 (signal SIGTERM)" in summary  # rank 0 was stopped, not left running
        pids = _pids(piddir)
        assert len(pids) == 2 and not any(alive(p) for p in pids), "a worker outlived the launcher"


@pytest.mark.launch
def test_exit_status_is_the_workers(tmp_path: Path) -> None:
    """sys.exit(3) on rank 1: status 3, and the end of its stderr in the summary (no traceback)."""
    rc, _, err, _ = run([*LAUNCH, "--nproc", "2", str(SCRIPTS / "fail.py"), "exit3", str(tmp_path)])
    assert rc == 3
    assert "unison launch: rank 1 failed (exit code 3)\n  | giving up with status 3" in err
    assert not any(alive(p) for p in _pids(tmp_path))


# ---- the seed examples ------------------------------------------------------------------------------
DIGEST = re.compile(r"^(?:\[rank\d\] )?rank (\d) weights_sum (\S+) sha256 (\w+) valid_acc (\S+)$", re.M)


def digests(out: str) -> dict[int, tuple[str, str, str]]:
    return {int(r): rest for r, *rest in DIGEST.findall(out)}


@pytest.mark.launch
def test_local_rank_example_under_unison_launch_and_torchrun(tmp_path: Path) -> None:
    example = str(ROOT / "examples" / "local_rank.py")
    # the example's own command with unison for torch.distributed.launch; every rank's stdout shows
    ours = start([*LAUNCH, "--nproc_per_node=2", "--legacy-local-rank", example])
    # torchrun's ranks share its stdout unprefixed, each flushing its buffer when full: a line can be
    # cut in two by the other rank's output, so each rank's stdout is read from its own file.
    logs = tmp_path / "torchrun"
    torchrun = start(
        [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
        + ["--log-dir", str(logs), "--redirects", "1", example],
        env={"OMP_NUM_THREADS": "1"},
    )
    rc, out, err, _ = finish(ours)
    assert rc == 0, err
    rc2, _, err2, _ = finish(torchrun)
    assert rc2 == 0, err2
    out2 = "".join(path.read_text() for path in sorted(logs.rglob("stdout.log")))
    a, b = digests(out), digests(out2)
    assert sorted(a) == sorted(b) == [0, 1], (out, out2)
    assert a[0] == a[1], "ranks ended with different weights"
    assert b[0] == b[1] == a[0], "torchrun and unison launch trained differently"
    assert float(a[0][2]) > 0.6  # it learned something


@pytest.mark.launch
def test_cpu_multinode_example_by_hand_on_loopback() -> None:
    example = str(ROOT / "examples" / "cpu_multinode.py")
    port = str(free_port())
    procs = [
        start(
            [
                PY,
                example,
                "--world-size",
                "2",
                "--rank",
                str(r),
                "--host",
                "127.0.0.1",
                "--port",
                port,
                "--timeout",
                "60",
            ]
        )
        for r in (0, 1)
    ]
    results = [finish(p) for p in procs]
    for rc, _, err, _ in results:
        assert rc == 0, err
    (d0,), (d1,) = (digests(out).values() for _, out, _, _ in results)
    assert d0 == d1, "ranks ended with different weights"


@pytest.mark.launch
def test_backend_option_reaches_every_worker(tmp_path: Path) -> None:
    """`--backend gloo` (CPU training on a GPU machine): every worker's group is gloo, by the variable."""
    with pytest.raises(LaunchError, match="--backend: invalid choice: 'mpi'"):
        launch_mod.parse_options(["--backend", "mpi", str(SCRIPTS / "probe.py")])
    script = tmp_path / "which.py"
    script.write_text(
        "import os\n"
        "import torch.distributed as dist\n"
        "from unison.distributed import setup_distrib, teardown_distrib\n"
        "setup_distrib()\n"
        "print('BACKEND', os.environ['UNISON_BACKEND'], dist.get_backend(), dist.get_rank())\n"
        "teardown_distrib()\n"
    )
    rc, out, err, _ = run([*LAUNCH, "--nproc", "2", "--backend", "gloo", str(script)])
    assert rc == 0, err
    assert sorted(line.split("] ", 1)[1] for line in out.splitlines() if "BACKEND" in line) == [
        "BACKEND gloo gloo 0",
        "BACKEND gloo gloo 1",
    ]


@pytest.mark.launch
def test_the_restart_line_names_the_oom_killed_rank_not_the_survivor_the_agent_named(tmp_path: Path) -> None:
    """torch's agent names the failure with the earliest timestamp; a survivor that failed on its dead
    peer wrote its error file (and its time) before the agent saw the OOM-killed rank, which left
    none, so the agent named the survivor (seen in a loaded suite run: 'rank 0 failed (signal
    SIGTERM)'). The restart line names the rank the OOM killer ended."""
    import json

    from unison.launch.failures import OomCount, oom_count
    from unison.launch.logs import RankLogsSpecs

    attempt = tmp_path / "attempt_0"
    attempt.mkdir()
    stalled = "RankStalledError: rank 1 stopped taking part: stuck at epoch 0 training batch 3"
    (attempt / "rank0.error.json").write_text(json.dumps({"message": {"message": stalled}}))
    specs = RankLogsSpecs(str(tmp_path))
    specs.ranks = {0: 0, 1: 1}
    now = oom_count()
    if now is None:
        pytest.skip("no OOM-kill count here (no memory cgroup, no /proc/vmstat)")
    specs.oom_kills = OomCount(now.kills - 1, now.source, now.own_cgroup)  # one OOM kill during the attempt
    for noted in ((-15, 0), (1, 0)):  # the agent stopped the survivor, or it exited on its own
        specs.notes.failed = noted
        doubt = "" if now.own_cgroup else "possibly "  # the machine's count: maybe another job's kill
        assert specs._last_failure(str(attempt)) == (
            f": rank 1 failed (signal SIGKILL, {doubt}killed by the kernel's OOM killer (out of memory))"
        )
    specs.oom_kills = now  # no OOM kill: the agent's pick stands
    specs.notes.failed = (-15, 0)
    assert specs._last_failure(str(attempt)) == ": rank 0 failed (signal SIGTERM)"
