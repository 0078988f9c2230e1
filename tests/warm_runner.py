"""A warm interpreter that runs the suite's Python scripts as forks of itself.

Many slow tests run `python some_script.py ...` (a plain one-process reference, a torchft replica,
an example), and each such interpreter spends about 2 CPU-s importing torch and `torch._dynamo`
(which every optimizer imports) before it does anything: on the 2-core machine the suite runs on,
a large share of its CPU. `start(args, ...)` gives those commands to a server (one per pytest
process, started on first use) that imported torch, dynamo and unison once, and forks a child per
command: the script itself runs unchanged in the child.

The child gets what a fresh interpreter would have: the caller's argv, environment, working
directory, stdin/stdout/stderr (its pipes or files, passed over the socket), `sys.path`
(the script's folder, then `PYTHONPATH`), stdout's buffering (`PYTHONUNBUFFERED`),
`faulthandler` (`PYTHONFAULTHANDLER`), torch's thread count (`OMP_NUM_THREADS`), fresh seeds
(`random`, torch's and NumPy's generators), atexit handlers and non-daemon threads run at exit,
and a process group of its own.
It is a child of the server, not of the test: `proc.pid` is the real process (signals, psutil's
tree), and its exit status comes back over the socket (a `WarmProcess` dropped before its process
ended closes that socket, and the server then kills the process: nothing outlives its test).
What it does not get: a fresh import of the preloaded modules, and the interpreter's final
garbage collection (the child leaves with `os._exit` after atexit, as unison's own workers do).

Run warm: `[sys.executable, "script.py", ...]`, `[sys.executable, "-m", "unison.cli", "check-exact",
...]` (whose launches are then forks of its child, `check.forked_launch`, unless its environment
would make a launch fresh) and `[sys.executable, "-m", "unison.launch", ...]`. A launcher forks its
zygote only where torch is not imported yet, or where `UNISON_PRELOADED_PID` names the process
(`zygote.can_fork`): the child sets it for a launch, whose zygote is then a fork of this preloaded
child, its workers forks of that: a launch costs about 0.8 CPU-s where a fresh one costs 3.8 (a
2-process launch of a script that only imports unison). A launch stays fresh where its environment
sets a variable read when a library loads (`zygote.loaded_differently`) to another value than the
server loaded under, or asks for cold workers (`UNISON_WARM_START=0`); and where a test passes
`fresh=True`, as the ones that look for leftover workers by their command line do (a warm launch's
workers show the server's). Everything else runs as a `subprocess.Popen`, a worker bootstrap above
all, which tests check for what it imports. So does every command under `UNISON_TEST_FRESH=1` (to
tell the runner apart from a failure).

    proc = start([sys.executable, str(script), "--out", out], stdout=PIPE, stderr=PIPE)
    out, err = proc.communicate(timeout=300)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unison.check.forked_launch import ForkedLaunch

#: Set to 1 to run every command as a fresh interpreter (to tell the runner apart from a failure).
FRESH_ENV = "UNISON_TEST_FRESH"
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "unison")
START_TIMEOUT_S = 60


# ---- the server ---------------------------------------------------------------------------------
def _send(conn: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    framed = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(conn, [framed], list(fds))
    else:
        conn.sendall(framed)


def _exactly(conn: socket.socket, size: int, have: bytes = b"") -> bytes | None:
    while len(have) < size:
        chunk = conn.recv(size - len(have))
        if not chunk:
            return None
        have += chunk
    return have


def _receive(conn: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One length-prefixed JSON message (and the fds sent with its first bytes); None at EOF."""
    fds: list[int] = []
    if max_fds:
        first, fds, _, _ = socket.recv_fds(conn, 4, max_fds)
        head = _exactly(conn, 4, first) if first else None
    else:
        head = _exactly(conn, 4)
    if head is None:
        return None, fds
    body = _exactly(conn, struct.unpack("!I", head)[0])
    return (json.loads(body) if body is not None else None), fds


def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the command (stdio, env, cwd, argv, path), run it, exit."""
    import faulthandler
    import io
    import runpy
    import threading
    import traceback

    from unison.env_names import PRELOADED_PID_ENV
    from unison.launch.zygote import _reseed

    for number, fd in enumerate(fds):
        os.dup2(fd, number)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.setpgid(0, 0)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    encoding = os.environ.get("PYTHONIOENCODING") or sys.stdout.encoding
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False), encoding=encoding)
    out = open(1, "wb", buffering=0 if unbuffered else -1, closefd=False)
    sys.stdout = io.TextIOWrapper(out, encoding=encoding, write_through=unbuffered)
    err = open(2, "wb", buffering=0 if unbuffered else -1, closefd=False)
    sys.stderr = io.TextIOWrapper(err, encoding=encoding, errors="backslashreplace", line_buffering=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(file=sys.stderr, all_threads=True)
    else:
        faulthandler.disable()
    _reseed()  # torch's and NumPy's generators, as a new interpreter seeds them (fork reseeds `random`)
    if request.get("launch"):  # its zygote may be forked from here (`zygote.can_fork`)
        os.environ[PRELOADED_PID_ENV] = str(os.getpid())
    argv, module = request["argv"], request["module"]
    first = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *[p for p in sys.path[1:] if p not in extra]]
    sys.argv = list(argv)
    import torch

    # OpenMP read the server's OMP_NUM_THREADS when torch loaded: apply the child's, or what a fresh
    # interpreter's OpenMP would take without one (a thread per usable core).
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(
        int(threads) if threads.isdigit() and int(threads) > 0 else len(os.sched_getaffinity(0))
    )
    code, killed_by = 0, 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        killed_by = int(signal.SIGINT)
    except BaseException:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  (what interpreter exit does: join threads)
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    if killed_by:  # ended by the signal, as an uncaught KeyboardInterrupt ends an interpreter
        signal.signal(killed_by, signal.SIG_DFL)
        os.kill(os.getpid(), killed_by)
    os._exit(code & 0xFF)  # sys.exit(-1) is 255, as an interpreter's


def serve(path: str) -> None:
    """The server: preload, then fork a child per request until stdin closes (the test process ended)."""
    import importlib

    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    children: dict[int, socket.socket] = {}
    owners: dict[socket.socket, int] = {}
    print("ready", flush=True)
    while True:
        for key, _ in selector.select(timeout=1.0):
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 1024):  # the test process is gone: so are we
                    for pid in children:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    return
            elif key.data == "accept":
                conn, _ = listener.accept()
                request, fds = _receive(conn, max_fds=3)
                if request is None or len(fds) != 3:
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:  # the child: never back into this loop
                    try:
                        signal.set_wakeup_fd(-1)
                        listener.close()
                        for other in owners:
                            other.close()
                        conn.close()
                        _run_child(request, fds)
                    finally:
                        os._exit(1)
                for fd in fds:
                    os.close(fd)
                _send(conn, {"pid": pid})
                children[pid], owners[conn] = conn, pid
                selector.register(conn, selectors.EVENT_READ, "client")
            elif key.data == "child":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            else:  # a client closed its end before its child ended: it is gone, so is the child
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                with contextlib.suppress(OSError):
                    if conn.recv(1):
                        continue
                selector.unregister(conn)  # (else its end-of-file wakes this loop until the child is reaped)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(owners[conn], signal.SIGKILL)
        while children:  # reap every ended child, and tell its client how it ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is None:
                continue
            owners.pop(conn, None)
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(conn)
            with contextlib.suppress(OSError):
                _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
            conn.close()


# ---- the client -----------------------------------------------------------------------------------
class _Server:
    """This process's server: started on first use, ended with this process."""

    proc: subprocess.Popen | None = None
    path = ""
    env: dict[str, str] = {}  # what it was started with: torch loaded under it

    @classmethod
    def address(cls) -> str:
        if cls.proc is not None and cls.proc.poll() is None:
            return cls.path
        folder = tempfile.mkdtemp(prefix="unison-warm-")
        cls.path = os.path.join(folder, "runner.sock")
        cmd = [sys.executable, "-c", f"from tests.warm_runner import serve; serve({cls.path!r})"]
        root = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        for name in ("PYTEST_CURRENT_TEST", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # each child sets its own
            env.pop(name, None)
        cls.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=root, start_new_session=True
        )
        cls.env = env
        atexit.register(cls.stop)
        assert cls.proc.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(cls.proc.stdout, selectors.EVENT_READ)
        if not selector.select(START_TIMEOUT_S) or cls.proc.stdout.readline().strip() != b"ready":
            cls.stop()
            raise RuntimeError(f"the warm runner did not start in {START_TIMEOUT_S} s")
        return cls.path

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            assert cls.proc.stdin is not None
            cls.proc.stdin.close()  # it kills what it still runs and leaves
            try:
                cls.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                cls.proc.kill()
        cls.proc = None


class WarmProcess(ForkedLaunch):
    """A command run by the warm server, with `subprocess.Popen`'s interface for what tests use:
    `pid`, `args`, `returncode`, `poll`, `wait`, `communicate`, `send_signal`, `terminate`, `kill`
    (the signals sent to its pid, as `ForkedLaunch` sends them; its status comes over the socket)."""

    def __init__(
        self, args: list[str], conn: socket.socket, pid: int, pipes: dict[str, int | None], text: bool
    ) -> None:
        self.args, self.pid, self.returncode = args, pid, None
        self._conn, self._text = conn, text
        self._pipes = {name: fd for name, fd in pipes.items() if fd is not None}
        self._piped = set(self._pipes)
        self._read: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self._input: bytes | None = None
        self.stdin = self.stdout = self.stderr = None

    def _status(self, block_s: float | None) -> None:
        if self.returncode is not None:
            return
        self._conn.settimeout(block_s)
        try:
            message, _ = _receive(self._conn)
        except (TimeoutError, BlockingIOError):
            return
        finally:
            self._conn.settimeout(None)
        if message is None:
            raise RuntimeError(f"the warm runner ended while running {self.args}")
        self.returncode = message["returncode"]
        self._conn.close()

    def poll(self) -> int | None:
        self._status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._status(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def _decoded(self, name: str) -> Any:
        if name not in self._piped:
            return None
        data = b"".join(self._read[name])
        if not self._text:
            return data
        return data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")

    def communicate(self, input: str | bytes | None = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Write `input`, read stdout and stderr to their end and wait for the exit, within `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if input is not None and self._input is None:
            self._input = input.encode() if isinstance(input, str) else input
        selector = selectors.DefaultSelector()
        for name in ("stdout", "stderr"):
            if name in self._pipes:
                selector.register(self._pipes[name], selectors.EVENT_READ, name)
        if "stdin" in self._pipes:
            if self._input:
                os.set_blocking(self._pipes["stdin"], False)
                selector.register(self._pipes["stdin"], selectors.EVENT_WRITE, "stdin")
            else:
                os.close(self._pipes.pop("stdin"))
        try:
            while selector.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
                for key, _ in selector.select(left):
                    fd = key.fileobj
                    assert isinstance(fd, int)
                    if key.data == "stdin":
                        try:
                            sent = os.write(fd, self._input[:65536]) if self._input else 0
                        except BrokenPipeError:
                            sent, self._input = 0, b""
                        self._input = self._input[sent:] if self._input else b""
                        if not self._input:
                            selector.unregister(fd)
                            os.close(self._pipes.pop("stdin"))
                        continue
                    chunk = os.read(fd, 65536)
                    if chunk:
                        self._read[key.data].append(chunk)
                    else:
                        selector.unregister(fd)
                        os.close(self._pipes.pop(key.data))
        finally:
            selector.close()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        return self._decoded("stdout"), self._decoded("stderr")


#: Read when a library loads, but applied by the child itself (sys.path, streams, threads, the
#: breakpoint hook, which reads its variable at each call) or without effect on what a test checks
#: (bytecode files; huge pages, which `unison launch` sets). Some a library writes into the pytest
#: process's os.environ when a test imports or runs it there, so that every later launch of that
#: pytest process would run fresh: the compiler's cache folder (inductor, when a test compiles),
#: Intel OpenMP's two (fastai on import; torch's wheel loads GNU OpenMP, which reads neither) and
#: the breakpoint hook (Ray on `ray.init`).
_APPLIED_BY_CHILD = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONIOENCODING")
_APPLIED_BY_CHILD += ("PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "THP_MEM_ALLOC_ENABLE")
_APPLIED_BY_CHILD += ("TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK")
_APPLIED_BY_CHILD += ("PYTHONBREAKPOINT",)


def server_env() -> dict[str, str]:
    """The environment the server loaded under (started if it was not): a test that checks what
    runs warm starts from it, not from os.environ, which earlier tests' libraries may have changed."""
    _Server.address()
    return dict(_Server.env)


def _launch_runs_warm(env: dict[str, str] | None) -> bool:
    """Whether a launch with `env` may run in a child of the server (see the module's docstring)."""
    from unison.env_names import WARM_START_ENV
    from unison.launch.zygote import loaded_differently

    env = dict(os.environ if env is None else env)
    if env.get(WARM_START_ENV, "1") == "0":
        return False
    _Server.address()  # (started, so its environment is known)
    mine = {k: v for k, v in env.items() if k not in _APPLIED_BY_CHILD}
    server = {k: v for k, v in _Server.env.items() if k not in _APPLIED_BY_CHILD}
    return loaded_differently(mine, server) is None


def _warm_target(
    args: Sequence[Any], cwd: Any = None, env: dict[str, str] | None = None
) -> tuple[list[str], str | None] | None:
    """(argv, module) where `args` runs a script file, `unison check-exact` or `unison launch` on
    this interpreter; else None. `unison launch`'s other modules always start fresh: a worker's
    bootstrap is checked for what it imports."""
    args = [os.fspath(a) for a in args]
    if len(args) < 2 or args[0] != sys.executable:
        return None
    if args[1] == "-m" and args[2:4] == ["unison.cli", "check-exact"]:
        return [args[2], *args[3:]], args[2]
    if args[1] == "-m" and args[2:3] == ["unison.launch"] and _launch_runs_warm(env):
        return [args[2], *args[3:]], args[2]
    script = os.path.join(os.fspath(cwd) if cwd is not None else os.getcwd(), args[1])
    if not args[1].startswith("-") and args[1].endswith(".py") and os.path.isfile(script):
        return args[1:], None
    return None


def start(
    args: Sequence[Any],
    *,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    cwd: Any = None,
    env: dict[str, str] | None = None,
    text: bool = True,
    fresh: bool = False,
) -> WarmProcess | subprocess.Popen:
    """`subprocess.Popen(args, ...)` for a Python command, run as a fork of the warm server (see the
    module's docstring). stdin: None or PIPE; stdout: None, PIPE or a file; stderr: also STDOUT."""
    target = None if fresh or os.environ.get(FRESH_ENV) == "1" else _warm_target(args, cwd, env)
    if target is None:
        return subprocess.Popen(args, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd, env=env, text=text)
    argv, module = target
    sys.audit("subprocess.Popen", args[0], list(args), cwd, env)  # the tier check counts it (tests/tiers.py)
    opened: list[int] = []
    ours: dict[str, int | None] = {"stdin": None, "stdout": None, "stderr": None}

    def pipe(name: str, write_end_is_theirs: bool) -> int:
        read, write = os.pipe()
        theirs, mine = (write, read) if write_end_is_theirs else (read, write)
        ours[name] = mine
        opened.append(theirs)
        return theirs

    child_in = pipe("stdin", False) if stdin == subprocess.PIPE else 0
    if stdout == subprocess.PIPE:
        child_out = pipe("stdout", True)
    else:
        child_out = stdout.fileno() if stdout is not None else 1
    if stderr == subprocess.STDOUT:
        child_err = child_out
    elif stderr == subprocess.PIPE:
        child_err = pipe("stderr", True)
    else:
        child_err = stderr.fileno() if stderr is not None else 2
    request = {
        "argv": argv,
        "module": module,
        "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
        "env": dict(env if env is not None else os.environ),
        # A launch, or check-exact's launches (`check.forked_launch`), may fork from the child.
        "launch": module == "unison.launch" or (module == "unison.cli" and _launch_runs_warm(env)),
    }
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(_Server.address())
        _send(conn, request, [child_in, child_out, child_err])
        reply, _ = _receive(conn)
    finally:
        for fd in opened:
            os.close(fd)
    if reply is None:
        raise RuntimeError(f"the warm runner did not take {list(args)}")
    return WarmProcess([os.fspath(a) for a in args], conn, reply["pid"], ours, text)


if __name__ == "__main__":
    serve(sys.argv[1])
