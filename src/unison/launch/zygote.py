"""The warm start: `unison launch` forks its workers from a process that has already imported torch.

A cold worker is a fresh interpreter that imports torch and `torch._dynamo`, which every
`torch.optim` optimizer imports: for a short job or a restart, most of a worker's start
(docs/benchmarks.md, "Starting workers warm"). So each launch has one *zygote* beside torch's
agent that imports both once (`PRELOAD`), and the agent's workers are forked from it:

- the zygote is forked from the launcher itself, right after the launcher has imported torch
  for its agent and before it changes anything of torch's (its loggers) or starts a thread; it
  then imports the rest of `PRELOAD`, beside the launcher. A launcher that
  cannot fork safely (`can_fork`: torch already loaded, or other threads running, as when a
  program calls `launch` itself) starts it as a new interpreter, `python -m unison.launch.zygote`.
- torch's agent still starts, watches, signals and restarts every worker as it always does: it
  runs `python -m unison.launch.worker script.py ...`, which imports no torch. With
  `UNISON_ZYGOTE` set, that process (the *stub*, `launch.stub`) hands its stdin, stdout and
  stderr, arguments, environment and folder to the zygote, which forks the worker; the stub then
  forwards every signal it gets to the worker and ends as the worker ended (the same exit code,
  or killed by the same signal), so the agent sees what it would have seen. If the stub is
  killed (SIGKILL), the zygote kills the worker.
- a variable read once, when a library loads (`THP_MEM_ALLOC_ENABLE`, `LD_PRELOAD`, `PYTHON*`,
  `OMP_*` but the thread count, which the bootstrap applies, `TORCHINDUCTOR_*`, ...), must have
  the value the zygote loaded under; a worker whose value differs runs cold (its stub runs it).
- the forked worker leads a session of its own and dies with the zygote (`PR_SET_PDEATHSIG`),
  which dies with the launcher; it then runs the same bootstrap (`launch.worker.main`) as a cold
  one. torch's CPU generator and NumPy's global random state are seeded from the OS, as a new
  interpreter's are (Python's `random` is reseeded by `os.fork` itself).
- what is not the same: `ps` shows the worker with the launcher's command line (its stub, the
  agent's child, shows the script), and a variable a script sets for torch before
  `import torch` is read too late (torch is already imported): set it in the launch's
  environment instead, or start cold.

Only CPU launches start warm (no `--gpus`, no NVIDIA or AMD device on the machine):
forking after torch is imported is safe only while CUDA has not been touched, which this
machine's tests cannot check on a GPU. `UNISON_WARM_START=0` starts every worker cold.

>>> # the launcher: with Zygote.start(fork=can_fork()) as zygote: ... exported(zygote.env()) ...
>>> # each stub (`launch.stub`): run_in_zygote(os.environ["UNISON_ZYGOTE"], ["train.py", "--epochs", "3"])
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from typing import NoReturn, cast

from unison.env_names import LAUNCHER_PID_ENV, PRELOADED_PID_ENV, WARM_START_ENV, ZYGOTE_ENV
from unison.launch.rendezvous import end_leftovers
from unison.launch.stub import REQUEST_HEADER, catchable_signals, default_handler
from unison.launch.worker import die_with_parent

__all__ = ["PRELOAD", "Zygote", "can_fork", "serve", "warm_start_allowed"]

#: What the zygote imports before it forks: torch, `torch._dynamo` (which every `torch.optim`
#: optimizer imports; it loads FSDP and DTensor) and the bootstrap. With FSDP loaded before the
#: gloo group, a script that frees DDP after `destroy_process_group()` deadlocked in torch's
#: group destructor (pytorch/pytorch#56297; the torch tutorial, 4 launches in 20): the bootstrap's
#: `launch.group_keeper` keeps the group past that point, so the destructor never runs there
#: (0 in 20).
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing.errors",
    "unison",
    "unison.launch.worker",
)
# Variables read once, when a library loads (the dynamic loader, Python, libgomp, MKL, OpenBLAS,
# torch's allocator, logging and compiler settings): a worker forked from a zygote that loaded
# under another value would silently run with the zygote's, so such a worker starts cold instead.
_LOAD_TIME_PREFIXES: tuple[str, ...] = ("LD_", "PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_")
_LOAD_TIME_PREFIXES += ("PYTORCH_", "TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_COMPILE")
_LOAD_TIME_NAMES = ("THP_MEM_ALLOC_ENABLE", "TORCH_LOGS", "GOTO_NUM_THREADS")
_APPLIED_BY_WORKER = ("OMP_NUM_THREADS",)  # `launch.worker.set_threads` applies it to torch


def warm_start_allowed(environ: Mapping[str, str], gpus: object, backend: str | None) -> bool:
    """Whether a launch forks its workers from a zygote: on CPU machines, unless turned off.

    >>> warm_start_allowed({"UNISON_WARM_START": "0"}, None, None)
    False
    """
    if environ.get(WARM_START_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if gpus is not None or backend == "nccl" or not sys.platform.startswith("linux"):
        return False
    return not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))


# ---- the launcher's side ---------------------------------------------------------------------
class Zygote:
    """The zygote process of one launch; a context manager that stops it (and so its workers).

    For example:

        with Zygote.start() as zygote:
            with exported(zygote.env()):
                launch_agent(config, sys.executable, args)
    """

    def __init__(self, pid: int, folder: str, proc: subprocess.Popen[bytes] | None = None):
        self.pid, self.folder, self.proc = pid, folder, proc
        self.path = os.path.join(folder, "zygote.sock")

    @classmethod
    def start(cls, env: Mapping[str, str] | None = None, *, fork: bool = False) -> Zygote:
        """Start the zygote with `env` (this process's environment by default: what the workers inherit).

        `fork=True` (see `can_fork`): fork it from this process, which has imported torch and
        nothing else yet; the zygote shares its torch import and imports only the rest
        of `PRELOAD`. Else it is a fresh interpreter, `python -m unison.launch.zygote`.
        """
        folder = tempfile.mkdtemp(prefix="unison-zygote-")  # 0700: only this user reaches the socket
        path = os.path.join(folder, "zygote.sock")
        env = {**(os.environ if env is None else env)}
        env[LAUNCHER_PID_ENV] = env.get(LAUNCHER_PID_ENV, str(os.getpid()))
        if fork:
            sys.stdout.flush()  # else the zygote holds a copy of what is buffered, and a worker prints it
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _in_child(_serve_forked, path, env)
            return cls(pid, folder)
        proc = subprocess.Popen(
            [sys.executable, "-m", "unison.launch.zygote", path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # a Ctrl-C at the terminal reaches the agent, which stops the workers
        )
        return cls(proc.pid, folder, proc)

    def env(self) -> dict[str, str]:
        """What the stubs need: the zygote's socket."""
        return {ZYGOTE_ENV: self.path}

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """End the zygote; a worker still alive dies with it (its parent-death signal)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)  # not reaped until below: the pid is still the zygote's
        with contextlib.suppress(ChildProcessError, subprocess.TimeoutExpired):
            if self.proc is not None:
                self.proc.wait(timeout=10)  # (a new interpreter: Popen reaps it)
            else:
                os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            os.remove(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self.folder)


def can_fork() -> bool:
    """Whether `Zygote.start` may fork this process: torch not loaded yet (so it loads under the
    environment the launcher sets first, such as `THP_MEM_ALLOC_ENABLE`), or loaded by a process
    that preloaded `PRELOAD` alone and says so (`PRELOADED_PID_ENV` holds its pid: the test
    suite's warm runner), and no other Python thread (forking is safe only then).

    >>> can_fork() in (True, False)
    True
    """
    preloaded = os.environ.get(PRELOADED_PID_ENV) == str(os.getpid())
    return ("torch" not in sys.modules or preloaded) and threading.active_count() == 1


def _serve_forked(path: str, env: Mapping[str, str]) -> None:
    """In the zygote forked from the launcher: leave its session and streams, then `serve`."""
    os.setsid()  # a Ctrl-C at the terminal reaches the agent, which stops the workers
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.closerange(3, _open_fd_limit())  # as a fresh interpreter's Popen would (stderr is kept)
    os.environ.clear()
    os.environ.update(env)
    serve(path)


def _in_child(body: Callable[..., object], *args: object) -> NoReturn:
    """Run `body(*args)` in a child this process has just forked, then end the child: nothing may
    return into the parent's code (the launcher's, or the zygote's loop), not even an error (its
    traceback is printed)."""
    try:
        body(*args)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    os._exit(1)


def _open_fd_limit() -> int:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if 0 < soft < 1 << 20 else 1 << 16


# ---- the zygote ------------------------------------------------------------------------------
def loaded_differently(env: Mapping[str, str], loaded: Mapping[str, str]) -> str | None:
    """The first variable read at library load whose value in a worker's `env` is not the one the
    zygote `loaded` under, or None (the worker may be forked).

    >>> loaded_differently({"THP_MEM_ALLOC_ENABLE": "1", "RANK": "1"}, {"RANK": "0"})
    'THP_MEM_ALLOC_ENABLE'
    """
    for name in sorted(set(env) | set(loaded)):
        read_at_load = name in _LOAD_TIME_NAMES or name.startswith(_LOAD_TIME_PREFIXES)
        if read_at_load and name not in _APPLIED_BY_WORKER and env.get(name) != loaded.get(name):
            return name
    return None


def _receive_request(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    """A stub's request: its three standard streams (passed as descriptors) and what to run."""
    head, fds, _, _ = socket.recv_fds(conn, REQUEST_HEADER.size, 3)
    stream = conn.makefile("rb")  # reads whole lengths: the rest of a request may come in pieces
    head += stream.read(REQUEST_HEADER.size - len(head))
    if len(fds) != 3 or len(head) != REQUEST_HEADER.size:
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"expected a request and 3 descriptors (stdin, stdout, stderr), got {len(fds)}")
    (size,) = REQUEST_HEADER.unpack(head)
    return json.loads(stream.read(size)), fds


def _reseed() -> None:
    """Seed what a new interpreter seeds from the OS and this fork would share with its siblings:
    torch's CPU generator and NumPy's global state (`random` is reseeded by `os.fork` itself)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None and hasattr(numpy, "random"):
        numpy.random.seed()


def _become_worker(request: dict[str, object], fds: list[int], zygote: int) -> None:
    """In the forked child: take the stub's streams, environment and folder, then run the bootstrap."""
    os.setsid()  # as torch's agent starts a cold worker: its own session
    die_with_parent(zygote)
    # Each signal handled as in a cold worker, which its stub is: ignored where the stub's ignored
    # (SIGPIPE by every interpreter: a write to a dead peer's socket raises EPIPE instead of
    # killing; what the launcher's parent ignored and torch's agent does not catch), else the
    # default. The launcher's own dispositions, which this fork inherited, do not reach it.
    ignored = request.get("ignored", [int(signal.SIGPIPE), int(signal.SIGXFSZ)])
    assert isinstance(ignored, list)
    for sig in catchable_signals():
        if signal.getsignal(sig) is None:  # a handler set outside Python (faulthandler's): kept
            continue
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_IGN if int(sig) in ignored else default_handler(sig))
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    env = request["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    os.environ.pop(ZYGOTE_ENV, None)  # the worker's environment is a cold worker's
    os.chdir(str(request["cwd"]))
    _reseed()
    from unison.launch.worker import main

    argv = request["argv"]
    assert isinstance(argv, list)
    main([str(a) for a in argv], forked=True)


def serve(path: str) -> NoReturn:
    """The zygote's loop: import `PRELOAD`, then fork a worker for each stub and report how it ended.

    Single-threaded (forking is safe only then). The socket is bound before the imports, so the
    stubs connect at once and wait in the backlog while torch loads.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    loaded = dict(os.environ)
    if launcher.isdigit():
        die_with_parent(int(launcher))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    for name in PRELOAD:
        importlib.import_module(name)
    me = os.getpid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the pipe
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "wake")
    stubs: dict[int, socket.socket] = {}  # worker pid -> its stub's connection
    while True:
        for key, _ in selector.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                try:
                    conn.settimeout(30)
                    request, fds = _receive_request(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                env = request.get("env")
                cold = loaded_differently(env, loaded) if isinstance(env, dict) else "env"
                pid = os.fork() if cold is None else None  # cold: the stub runs the worker itself
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    selector.close()
                    for other in (listener, conn, *stubs.values()):
                        other.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    _in_child(_become_worker, request, fds, me)
                for fd in fds:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    conn.sendall(f"cold {cold}\n".encode() if pid is None else f"pid {pid}\n".encode())
                if pid is None:
                    conn.close()
                    continue
                conn.setblocking(False)
                stubs[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            elif key.data == "wake":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
            else:  # a stub's connection: it only ever closes, when the stub is gone
                pid = key.data
                with contextlib.suppress(BlockingIOError, ConnectionError):
                    if cast(socket.socket, key.fileobj).recv(64):
                        continue
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)  # its stub was killed: so is the worker, as a cold one
        _reap(stubs, selector, int(launcher) if launcher.isdigit() else None)


def _reap(stubs: dict[int, socket.socket], selector: selectors.BaseSelector, launcher: int | None) -> None:
    """Tell each ended worker's stub how it ended; end what the worker left in its session, as the
    launcher does for a cold worker (`rendezvous.WatchWorkers`)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if launcher is not None:
            end_leftovers({pid}, launcher)
        conn = stubs.pop(pid, None)
        if conn is not None:
            selector.unregister(conn)
            with contextlib.suppress(OSError):
                conn.setblocking(True)
                conn.sendall(f"status {os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
