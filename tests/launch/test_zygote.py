"""The warm start (`unison.launch.zygote`): workers forked from a process that has imported torch.

Each launched case runs tests/fault_scripts/zygote_probe.py, which records what its process looks
like; the cold start (`UNISON_WARM_START=0`, a new interpreter per worker, as torchrun starts
them) is the reference a warm worker must match.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.hangs import run_or_report, wait_for_file
from unison.launch.zygote import Zygote, loaded_differently, warm_start_allowed

PROBE = Path(__file__).resolve().parent.parent / "fault_scripts" / "zygote_probe.py"


def launch(
    out: Path, mode: str, warm: bool = True, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "UNISON_WARM_START": "1" if warm else "0"}
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", str(PROBE), str(out), mode]
    # fresh: these tests check the launcher's own zygote, forked from a launcher that imported torch
    # itself (a warm launch's is forked from the suite's preloaded runner: tests/warm_runner.py)
    return run_or_report(cmd, 180, env=env, cwd=cwd, fresh=True)


def records(out: Path, attempt: int = 0) -> list[dict]:
    return [json.loads((out / f"rank{r}.attempt{attempt}.json").read_text()) for r in (0, 1)]


def test_the_warm_start_is_for_cpu_launches_and_can_be_turned_off() -> None:
    assert warm_start_allowed({}, None, None) is (not Path("/dev/nvidia0").exists())
    assert warm_start_allowed({"UNISON_WARM_START": "0"}, None, None) is False
    assert warm_start_allowed({"UNISON_WARM_START": "off"}, None, None) is False
    assert warm_start_allowed({}, (0, 1), None) is False  # --gpus
    assert warm_start_allowed({}, None, "nccl") is False


@pytest.mark.launch
def test_a_warm_worker_sees_what_a_cold_one_sees_and_draws_its_own_random_numbers(tmp_path: Path) -> None:
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    for out, is_warm in ((warm, True), (cold, False)):
        proc = launch(out, "ok", warm=is_warm, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    warm_ranks, cold_ranks = records(warm), records(cold)
    assert [r["preloaded"] for r in warm_ranks] == [True, True]  # dynamo was there before the script
    assert [r["preloaded"] for r in cold_ranks] == [False, False]
    assert warm_ranks[0]["ppid"] == warm_ranks[1]["ppid"]  # both forked by the one zygote
    # ... which was forked from the launcher (it shares the launcher's torch), not a new interpreter
    assert "unison.launch.zygote" not in warm_ranks[0]["parent"], warm_ranks[0]["parent"]
    for w, c in zip(warm_ranks, cold_ranks, strict=True):
        assert w["sid"] == w["pid"] and c["sid"] == c["pid"]  # each leads its own session
        assert w["ppid"] != c["ppid"]
        for key in ("cwd", "file", "path0"):
            assert w[key] == c[key], key
        assert w["argv"][1:] == [str(warm), "ok"] and c["argv"][1:] == [str(cold), "ok"]
        assert w["argv"][0] == c["argv"][0] == str(PROBE)
        assert w["env"] == c["env"]  # the variables the agent gave (none of the zygote's)
        assert w["elastic_log"] == c["elastic_log"] == [[0, True, 0], [0, True, 0]]
        # dynamo (and the FSDP and DTensor it loads) preloaded for the warm one alone: the bootstrap's
        # group keeper makes that safe (tests/launch/test_worker.py)
        assert w["inherited"] == ["torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor"]
        assert c["inherited"] == []
        assert w["signals"] == c["signals"]
        assert c["signals"]["SIGPIPE"] == "SIG_IGN"  # (a write to a dead peer's socket: EPIPE)
    for source in ("torch", "numpy", "random"):  # seeded from the OS in each process, as a new interpreter is
        assert warm_ranks[0][source] != warm_ranks[1][source], source


@pytest.mark.launch
@pytest.mark.parametrize(
    ("mode", "status", "said"), [("exit3", 3, "exit code 3"), ("sigkill", 137, "SIGKILL")]
)
def test_a_warm_worker_ends_as_it_would_cold(tmp_path: Path, mode: str, status: int, said: str) -> None:
    proc = launch(tmp_path / "out", mode)
    assert proc.returncode == status, proc.stderr
    assert f"rank 1 failed ({said}" in proc.stderr or f"rank 1 failed (signal {said}" in proc.stderr, (
        proc.stderr
    )


def _stub_of_rank(launcher: int, rank: str) -> psutil.Process | None:
    """The process torch's agent started for `rank` (`python -m unison.launch.worker ...`)."""
    for proc in psutil.Process(launcher).children():
        try:
            if "unison.launch.worker" in " ".join(proc.cmdline()) and proc.environ().get("RANK") == rank:
                return proc
        except psutil.Error:
            continue
    return None


def _alive(pid: int) -> bool:
    """Whether `pid` runs (not a zombie); it may be reaped between any two looks at it."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.launch
def test_a_killed_worker_process_takes_its_fork_down_and_the_restart_is_forked_again(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    restartable = [sys.executable, "-m", "unison.launch", "--nproc", "2", "--max-restarts", "1"]
    cmd = [*restartable, str(PROBE), str(out), "hold"]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120  # (the worker's end below shares it)
        wait_for_file(job, out / "rank1.attempt0.json", 120, "rank 1 never started", poll_s=0.1)
        worker = json.loads((out / "rank1.attempt0.json").read_text())["pid"]
        stub = _stub_of_rank(job.pid, "1")
        assert stub is not None and stub.pid != worker
        stub.send_signal(signal.SIGKILL)  # what a test, or an operator, kills: the process the agent watches
        while _alive(worker):
            assert time.monotonic() < deadline, "the forked worker outlived its stub"
            time.sleep(0.05)
        _, err = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 0, err
    first = json.loads(
        (out / "rank1.attempt0.json").read_text()
    )  # (rank 0 may have been stopped before it wrote)
    again = records(out, 1)
    assert again[1]["ppid"] == first["ppid"] == again[0]["ppid"]  # the restart came from the same zygote
    assert again[1]["preloaded"]


@pytest.mark.procs
def test_a_stub_whose_zygote_is_gone_runs_the_script_itself(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint('ran;', 'torch.fx.experimental.symbolic_shapes' in sys.modules)\n")
    env = {**os.environ, "UNISON_ZYGOTE": str(tmp_path / "gone" / "zygote.sock")}
    proc = run_or_report([sys.executable, "-m", "unison.launch.worker", str(script)], 60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ran; False"


def test_only_variables_read_when_a_library_loads_keep_a_worker_from_the_zygote() -> None:
    loaded = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "THP_MEM_ALLOC_ENABLE": "1", "RANK": "0"}
    same = {
        **loaded,
        "RANK": "1",
        "MASTER_PORT": "29500",
        "OMP_NUM_THREADS": "1",
    }  # per rank; applied at start
    assert loaded_differently(same, loaded) is None
    assert loaded_differently({**same, "THP_MEM_ALLOC_ENABLE": "0"}, loaded) == "THP_MEM_ALLOC_ENABLE"
    assert loaded_differently({**same, "LD_PRELOAD": "libx.so"}, loaded) == "LD_PRELOAD"
    assert loaded_differently({**same, "TORCHINDUCTOR_CACHE_DIR": "/c"}, loaded) == "TORCHINDUCTOR_CACHE_DIR"
    gone = {k: v for k, v in same.items() if k != "THP_MEM_ALLOC_ENABLE"}
    assert loaded_differently(gone, loaded) == "THP_MEM_ALLOC_ENABLE"


@pytest.mark.procs
def test_a_worker_whose_library_settings_differ_from_the_zygotes_starts_cold(tmp_path: Path) -> None:
    """A zygote started as a new interpreter (a launcher that cannot fork: it runs threads, or has
    torch loaded already) forks a worker loaded alike; one with another THP_MEM_ALLOC_ENABLE runs cold."""
    script = tmp_path / "script.py"
    warm_check = "'torch.fx.experimental.symbolic_shapes' in sys.modules"
    script.write_text(f"import os, sys\nprint('warm:', {warm_check}, os.environ['THP_MEM_ALLOC_ENABLE'])\n")
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}
    with Zygote.start(env) as zygote:
        assert zygote.proc is not None  # a new interpreter (fork=False)
        for thp, warm in (("1", True), ("0", False)):
            worker_env = {**env, **zygote.env(), "THP_MEM_ALLOC_ENABLE": thp}
            proc = run_or_report(
                [sys.executable, "-m", "unison.launch.worker", str(script)], 90, env=worker_env
            )
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout.strip() == f"warm: {warm} {thp}"
