"""The suite's warm runner (tests/warm_runner.py) runs a script as a fresh interpreter would."""

import gc
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests.hangs import wait_ended
from tests.warm_runner import WarmProcess, server_env, start

PROBE = textwrap.dedent(
    """
    import atexit, json, os, random, sys, threading, time
    import torch

    seen = {
        "argv": sys.argv, "cwd": os.getcwd(), "var": os.environ.get("PROBE_VAR"), "path0": sys.path[0],
        "extra_path": os.environ["EXTRA"] in sys.path, "threads": torch.get_num_threads(),
        "stdin": sys.stdin.read(), "name": __name__, "faulthandler": __import__("faulthandler").is_enabled(),
    }
    print(json.dumps(seen))
    print("to stderr", file=sys.stderr)
    print(random.random(), torch.rand(1).item(), file=sys.stderr)  # each run its own: reseeded
    if sys.argv[1] == "thread":  # a non-daemon thread is waited for, atexit runs after it
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
        atexit.register(lambda: print("atexit ran", flush=True))
    if sys.argv[1] == "signal":
        import signal
        os.kill(os.getpid(), signal.SIGTERM)
    sys.exit(int(sys.argv[2]))
    """
)


def _run(script, how, *args, fresh, tmp_path):
    env = {**os.environ, "PROBE_VAR": "v", "EXTRA": str(tmp_path / "extra"), "OMP_NUM_THREADS": "1"}
    if how == "plain":  # torch's thread count without the variable: a thread per usable core
        del env["OMP_NUM_THREADS"]
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "extra"), env.get("PYTHONPATH", "")])
    proc = start(
        [sys.executable, str(script), how, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=env,
        fresh=fresh,
    )
    out, err = proc.communicate("some input", timeout=120)
    return proc, out, err


@pytest.mark.procs
def test_a_warm_script_sees_and_ends_as_a_fresh_interpreter_would(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    for how, args in (("plain", ["3"]), ("thread", ["0"]), ("signal", ["0"])):
        warm, warm_out, warm_err = _run(script, how, *args, fresh=False, tmp_path=tmp_path)
        cold, cold_out, cold_err = _run(script, how, *args, fresh=True, tmp_path=tmp_path)
        assert isinstance(warm, WarmProcess) and isinstance(cold, subprocess.Popen)
        want = {"plain": 3, "thread": 0, "signal": -signal.SIGTERM}[how]
        assert warm.returncode == cold.returncode == want, (how, warm_err, cold_err)
        warm_lines, cold_lines = warm_out.splitlines(), cold_out.splitlines()
        assert warm_lines[0] == cold_lines[0], how  # argv, cwd, env, sys.path, threads, stdin, ...
        assert warm_lines[1:] == cold_lines[1:], how  # the thread's line, then atexit's
        assert warm_err.splitlines()[0] == cold_err.splitlines()[0] == "to stderr"
        assert warm_err.splitlines()[1] != cold_err.splitlines()[1]  # each draws its own numbers
    assert cold_lines == [cold_lines[0]]  # (the signal run: nothing after the kill)


@pytest.mark.procs
def test_a_warm_script_killed_or_timed_out_reports_as_popen_does(tmp_path):
    script, printed = tmp_path / "sleep.py", tmp_path / "printed"
    script.write_text(
        f"import time, pathlib\nprint('started', flush=True)\npathlib.Path({str(printed)!r}).touch()\n"
        "time.sleep(60)\n"
    )
    proc = start([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert isinstance(proc, WarmProcess)
    # (the kill must come after the print: a loaded machine took more than the 0.5 s below to get there)
    deadline = time.monotonic() + 30
    while not printed.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.communicate(timeout=0.5)
    assert proc.poll() is None
    proc.kill()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL and out == "started\n" and err == ""


@pytest.mark.procs
def test_a_warm_process_dropped_unwaited_is_killed_by_the_server(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    proc = start([sys.executable, str(script)])
    pid = proc.pid
    assert psutil.pid_exists(pid)
    del proc
    gc.collect()  # its socket closes: the server takes the test for gone
    wait_ended(pid, 30, "the dropped process")


LAUNCHED = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from unison.distributed import rank_distrib

    # a worker forked by a zygote forked from the warm server carries the server's modules
    warm = "tests.warm_runner" in sys.modules
    print(json.dumps({"rank": rank_distrib(), "warm": warm, "threads": torch.get_num_threads(),
                      "var": os.environ.get("PROBE_VAR"), "world": os.environ.get("WORLD_SIZE")}))
    sys.stdout.flush()
    done = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank0-printed")
    if rank_distrib() == 0:
        open(done, "w").close()
        sys.exit(0)
    import time
    deadline = time.monotonic() + 60
    while not os.path.exists(done) and time.monotonic() < deadline:  # (else rank 0 is stopped unheard)
        time.sleep(0.02)
    os.remove(done)
    sys.exit(3)
    """
)


# What fastai's import and `ray.init` set in os.environ when a test runs them in the pytest process:
# the launches after them still run warm.
SET_BY_LIBRARIES = {"KMP_DUPLICATE_LIB_OK": "True", "KMP_INIT_AT_FORK": "FALSE", "PYTHONBREAKPOINT": "0"}


@pytest.mark.launch
def test_a_launch_runs_warm_unless_a_load_time_variable_differs_and_ends_as_a_fresh_one(tmp_path):
    """`python -m unison.launch` through the runner: its zygote and workers are forks of the warm
    child (the worker sees the server's modules), with what a fresh launch gives them (threads, the
    environment, the failed rank's exit code as the launch's status); a variable read when a library
    loads, set to another value than the server's, or cold workers asked for, run it fresh."""
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED)
    env = {**server_env(), "PROBE_VAR": "v"}  # (a library an earlier test loaded may have set one)
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", "--all-ranks-stdout", str(script)]
    seen = {}
    for how, extra, fresh in (
        ("warm", SET_BY_LIBRARIES, False),
        ("fresh", {}, True),
        ("load-time", {"OMP_PROC_BIND": "false"}, False),
        ("cold", {"UNISON_WARM_START": "0"}, False),
    ):
        proc = start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**env, **extra}, fresh=fresh)
        out, err = proc.communicate(timeout=120)
        assert isinstance(proc, WarmProcess) == (how in ("warm", "fresh") and not fresh), how
        assert proc.returncode == 3, (how, err[-3000:])  # rank 1's exit code, passed on
        assert "rank 1 failed (exit code 3)" in err, (how, err[-3000:])
        # (the JSON alone: torch's tailer may show a line written in two parts as two prefixed parts)
        found = [re.search(r'\{"rank".*?\}', line) for line in out.splitlines()]
        seen[how] = sorted((json.loads(m.group(0)) for m in found if m), key=lambda s: s["rank"])
    assert [s["warm"] for s in seen["warm"]] == [True, True]
    for how in ("fresh", "load-time", "cold"):
        assert [s["warm"] for s in seen[how]] == [False, False], how
    strip = [{k: v for k, v in s.items() if k != "warm"} for s in seen["warm"]]
    assert strip == [{k: v for k, v in s.items() if k != "warm"} for s in seen["fresh"]]
    assert strip[1] == {"rank": 1, "threads": 1, "var": "v", "world": "2"}
