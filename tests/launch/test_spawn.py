"""unison.spawn: rank 0's result, failures that name the rank, start methods, a notebook, an example.

Worker functions live at module level: with the "spawn" start method the workers import them
from here (conftest puts the repository on PYTHONPATH).
"""

import errno
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed.launcher.api

from tests.hangs import communicate_or_report, run_or_report
from unison.distributed.env import threads_per_worker
from unison.launch.spawn import SpawnError, _auto_start_method, spawn

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


# ---- worker functions ---------------------------------------------------------------------------
def _rank_times(x):
    return int(os.environ["RANK"]) * x


def _describe_worker(tag):
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    names += ("UNISON_TIMEOUT",)
    return {
        "env": {name: os.environ.get(name) for name in names},
        "threads": torch.get_num_threads(),
        "tensor": torch.arange(4.0),
        "tag": tag,
    }


def _fails_on_rank1():
    if os.environ["RANK"] == "1":
        raise ValueError("bad batch")
    from unison.distributed import setup_distrib

    setup_distrib()  # rank 0 waits (inside torch's C++) for rank 1, which never comes


def _fails_once(marker):
    if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise RuntimeError("first attempt fails")
    return f"{marker} after {os.environ['TORCHELASTIC_RESTART_COUNT']} restart"


def _steal_the_store_port_then_sum(flag):
    """Rank 1 takes MASTER_PORT as another program would before rank 0 binds it (port_thief.py)."""
    import torch.distributed as dist

    from tests.scripts.port_thief import take_the_store_port
    from unison.distributed import setup_distrib

    rank = int(os.environ["RANK"])
    taken = take_the_store_port(rank, int(os.environ["MASTER_PORT"]), Path(flag))
    setup_distrib()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    gathered = [None, None]
    dist.all_gather_object(gathered, taken)
    return total.item(), gathered


# ---- helpers ------------------------------------------------------------------------------------
def _helper(p):
    """multiprocessing's long-lived helpers (resource tracker), not workers."""
    try:
        return any("resource_tracker" in part or "forkserver" in part for part in p.cmdline())
    except psutil.Error:
        return True


def _workers_alive(before, exclude=()):
    """Processes started by this test process since `before`, not counting helpers and `exclude` trees."""
    alive = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid in before or p.status() == psutil.STATUS_ZOMBIE or _helper(p):
                continue
            if p.pid in exclude or any(parent.pid in exclude for parent in p.parents()):
                continue
        except psutil.NoSuchProcess:
            continue
        alive.append(p)
    return alive


def _pids():
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="module")
def example_job(tmp_path_factory):
    """examples/mp_spawn.py, run in the background: other spawns run while it does."""
    out = tmp_path_factory.mktemp("mp_spawn_example")
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLES / "mp_spawn.py")],
            stdout=stdout,
            stderr=stderr,
            cwd=out,
            start_new_session=True,  # its own process group: stopped with its workers if left running
        )
    proc.out = out
    yield proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---- tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, error, text",
    [
        (lambda: spawn(_rank_times, 0), ValueError, "nprocs must be a positive int, got 0"),
        (lambda: spawn(_rank_times, -2), ValueError, "nprocs must be a positive int"),
        (lambda: spawn(_rank_times, 2.0), ValueError, "nprocs must be a positive int"),
        (lambda: spawn(_rank_times, True), ValueError, "nprocs must be a positive int"),
        (lambda: spawn("train.py", 2), TypeError, "fn must be callable, got str"),
        (lambda: spawn(_rank_times, 2, args=5), TypeError, "args must be a tuple or list"),
        (lambda: spawn(_rank_times, 2, timeout=0), ValueError, "timeout must be a positive number"),
        (lambda: spawn(_rank_times, 2, max_restarts=-1), ValueError, "max_restarts must be an int >= 0"),
        (lambda: spawn(_rank_times, 2, start_method="thread"), ValueError, "start_method must be one of"),
    ],
)
def test_bad_input_is_refused_before_any_process_starts(call, error, text):
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    start = time.monotonic()
    with pytest.raises(error, match=text):
        call()
    assert time.monotonic() - start < 1
    assert {p.pid for p in me.children(recursive=True)} <= before  # no agent, no worker was started


def test_start_method_is_spawn_when_importable_else_fork(monkeypatch):
    assert _auto_start_method(_rank_times, (1,), {}) == "spawn"
    assert _auto_start_method(_rank_times, (torch.zeros(3),), {"t": torch.ones(2)}) == "spawn"
    assert _auto_start_method(lambda: 0, (), {}) == "fork"
    local = 3
    assert _auto_start_method(lambda: local, (), {}) == "fork"
    assert _auto_start_method(_rank_times, (lambda: 0,), {}) == "fork"  # an argument that cannot travel

    # A notebook: functions and classes live in a `__main__` that has no file to import.
    notebook = types.ModuleType("__main__")
    exec("def train():\n    return 1\nclass Net:\n    pass\n", notebook.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    assert _auto_start_method(notebook.train, (), {}) == "fork"
    assert _auto_start_method(_rank_times, (notebook.Net(),), {}) == "fork"
    # A script: the workers import its functions by running it again (it needs a main guard).
    notebook.__file__ = "/somewhere/train.py"
    assert _auto_start_method(notebook.train, (), {}) == "spawn"


@pytest.mark.procs
def test_returns_rank0_value_two_spawns_in_a_row_beside_another_job(monkeypatch, example_job):
    assert example_job.poll() is None, "the mp_spawn example should still be running"
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    assert spawn(_rank_times, 2, args=(10,), start_method="fork") == 0  # (forked: cheaper)
    info = spawn(_describe_worker, 2, kwargs={"tag": "x"}, timeout=42)

    threads = threads_per_worker(2)
    env = info["env"]
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("0", "0", "2")
    assert env["MASTER_ADDR"] == "127.0.0.1"
    assert int(env["MASTER_PORT"]) > 0 and env["MASTER_PORT"] != "29500"
    assert (info["threads"], env["OMP_NUM_THREADS"], env["UNISON_TIMEOUT"]) == (threads, str(threads), "42")
    assert torch.equal(info["tensor"], torch.arange(4.0)) and info["tag"] == "x"
    # The agent's signal handlers and environment are gone again.
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ


@pytest.mark.procs
@pytest.mark.parametrize("start_method", [None, "fork"])  # None: "spawn" for a module function
def test_a_failing_rank_is_named_promptly_and_no_worker_is_left(start_method, example_job):
    before, start = _pids(), time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(_fails_on_rank1, 2, start_method=start_method)
    err = info.value
    assert time.monotonic() - start < 60  # no hang: start-up and the agent's 10 s grace, on a loaded machine
    assert (err.rank, err.exitcode) == (1, 1)
    assert str(err).startswith("rank 1 failed (exit code 1): ValueError: bad batch")
    assert "in _fails_on_rank1" in str(err) and 'raise ValueError("bad batch")' in err.traceback
    assert "torch/distributed/elastic" not in err.traceback  # the launcher's own frames are dropped
    assert str(pickle.loads(pickle.dumps(err))) == str(err)
    assert _workers_alive(before, exclude={example_job.pid}) == []


@pytest.mark.procs
def test_a_killed_rank_is_named():
    def die_on_rank1():  # a closure: forked
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    start = time.monotonic()
    with pytest.raises(SpawnError, match=r"rank 1 failed \(exit code -9\): killed by signal SIGKILL"):
        spawn(die_on_rank1, 2)
    assert time.monotonic() - start < 60  # no hang: start-up and the agent's 10 s grace, on a loaded machine


@pytest.mark.procs
def test_max_restarts_runs_the_function_again():
    result = spawn(_fails_once, 2, args=("done",), max_restarts=1, start_method="fork")
    assert result == "done after 1 restart"
    with pytest.raises(SpawnError, match="RuntimeError: first attempt fails"):
        spawn(_fails_once, 2, args=("done",), start_method="fork")


@pytest.mark.procs
def test_no_other_process_can_take_the_store_port_before_rank_0_binds_it(tmp_path):
    total, taken = spawn(
        _steal_the_store_port_then_sum, 2, args=(str(tmp_path / "tried"),), start_method="fork"
    )
    assert taken == [None, errno.EADDRINUSE] and total == 3.0


@pytest.mark.procs
def test_script_closure_forks_safely_after_the_parent_used_openmp(tmp_path):
    # GNU OpenMP deadlocks a forked child that runs a parallel region with 2+ threads after the
    # parent ran one; spawn runs the function in a fresh thread of the child, which gets a new pool.
    script = tmp_path / "closure.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from unison.launch.spawn import _auto_start_method, spawn

            torch.set_num_threads(2)
            big = torch.randn(4_000_000)
            for _ in range(3):
                (big.exp() * 2).sum()  # the parent runs OpenMP parallel regions


            def make_job(scale):
                def job():  # a closure: it cannot be imported, so it is forked
                    for _ in range(3):
                        (big.exp() * scale).sum()
                    return torch.get_num_threads()
                return job


            job = make_job(2)
            print("start method:", _auto_start_method(job, (), {}))
            print("threads per worker:", spawn(job, 2))
            """
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = run_or_report([sys.executable, str(script)], 90, env=env)
    assert out.returncode == 0, out.stderr
    assert "start method: fork\nthreads per worker: 2\n" in out.stdout


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_notebook_defines_and_spawns_its_own_function(tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("ipykernel")
    # A kernelspec of our own that runs this interpreter (not whatever "python3" resolves to).
    prefix = tmp_path / "jupyter"
    subprocess.run(
        [sys.executable, "-m", "ipykernel", "install", "--prefix", str(prefix), "--name", "unison-test"],
        check=True,
        capture_output=True,
    )
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    # Two threads per worker after the kernel itself used two: the OpenMP-after-fork case.
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    nb = nbformat.read(EXAMPLES / "spawn_notebook.ipynb", as_version=4)
    nb.cells.append(
        nbformat.v4.new_code_cell(
            "import sys\n"
            "from unison.launch.spawn import _auto_start_method\n"
            "torch.randn(4_000_000).exp().sum()  # an OpenMP region in the kernel\n"
            "print('kernel:', sys.executable, _auto_start_method(train, (), {}))\n"
            "print('big op:', spawn(lambda: float(torch.ones(4_000_000).exp().sum()), 2))"
        )
    )
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="unison-test", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    text = "".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
    )
    assert f"kernel: {sys.executable} fork" in text
    assert "ranks that trained: [0, 1]" in text
    assert "same weights as 1 process: True" in text
    one = text.split("valid loss, 1 process:")[1].split()[0]
    two = text.split("valid loss, 2 processes:")[1].split()[0]
    assert one == two
    assert f"big op: {float(torch.ones(4_000_000).exp().sum())}" in text


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_mp_spawn_example(example_job):
    assert example_job.wait(timeout=200) == 0, (example_job.out / "stderr").read_text()[-3000:]
    out = (example_job.out / "stdout").read_text()
    assert "epoch 1, group made by the script (tcp://), 2 processes x batch 8: ranks agree: True" in out
    assert "epoch 2, resumed from stage1 under distrib_ctx (env://): ranks agree: True" in out
    diff = float(out.split("1 process at batch 16| = ")[1].split()[0])
    assert diff < 1e-5


# Frozen rank 0 used to hang the call for good (its store, which rank 1's watchdog published its
# "left" beat to while shutting down, lives in the frozen process); a frozen rank 1 took 42 s
# (torch's agent waited 30 s to kill a stopped process that never acts on its SIGTERM).
@pytest.mark.procs
@pytest.mark.timeout(200)
@pytest.mark.parametrize("frozen", [0, 1])
def test_a_frozen_rank_ends_the_spawn_within_timeout_plus_30s_naming_it(tmp_path, frozen):
    script = ROOT / "tests" / "fault_scripts" / "spawn_freeze.py"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), str(frozen), "10"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out, _ = communicate_or_report(proc, 150, f"spawn with frozen rank {frozen}")
    ended = time.time()
    frozen_for = ended - float((tmp_path / "frozen_at").read_text())
    assert proc.returncode == 3, out[-3000:]
    assert f"rank {frozen} stopped taking part" in out, out[-3000:]
    assert frozen_for < 10 + 30, (frozen_for, out[-3000:])  # (a loaded machine: not 5 s, which
    # a healthy first collective can outlast there)
