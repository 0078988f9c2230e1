"""`unison.spawn`: run a function on N local processes, from a script or a notebook.

torch's elastic agent (the one behind torchrun) does the work: it rendezvouses on a free local
port, starts the processes with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set,
and stops them all as soon as one fails. unison adds the start-method choice that makes notebook
functions work, each worker's share of the CPU, and an error naming the failing rank.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import types
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from unittest import mock

import torch

from unison.distributed import deadline
from unison.distributed.devices import cuda_check_without_init, to_cpu
from unison.distributed.env import huge_pages_env, threads_for_spawned
from unison.distributed.heartbeat_store import heartbeat_store
from unison.env_names import TIMEOUT_ENV
from unison.launch.bar_relay import BarRelay
from unison.launch.failures import failure_message
from unison.launch.options import START_METHODS
from unison.launch.rendezvous import WatchWorkers
from unison.launch.stub import default_handler

#: The signals torch's agent takes over while it runs.
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_TAIL_LINES = 12


class SpawnError(RuntimeError):
    """A worker of `spawn` failed: `.rank`, `.exitcode`, `.error` ("ValueError: bad batch"), `.traceback`."""

    def __init__(self, rank: int, exitcode: int, error: str, traceback: str = ""):
        self.rank, self.exitcode, self.error, self.traceback = rank, exitcode, error, traceback
        tail = "".join(f"\n{line}" for line in traceback.rstrip().splitlines()[-_TAIL_LINES:])
        super().__init__(f"rank {rank} failed (exit code {exitcode}): {error}{tail}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (SpawnError, (self.rank, self.exitcode, self.error, self.traceback))


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    max_restarts: int = 0,
    timeout: float | None = None,
    start_method: str | None = None,
) -> Any:
    """Run `fn(*args, **kwargs)` on `nprocs` local processes; return rank 0's result.

    Each process gets the launcher's variables (so `learn.distrib_ctx()` and `rank_distrib()` just
    work), its share of the CPU cores as intra-op threads, and `timeout` (seconds, bounding every
    collective of a group unison makes). A failure in any rank stops all of them and raises
    `SpawnError` naming that rank, with its traceback. Other ranks' results are discarded.

        def train(lr):
            learn = make_learner(lr)
            with learn.distrib_ctx():
                learn.fit(2)
            return learn.validate()
        unison.spawn(train, nprocs=2, args=(1e-3,))   # works in a notebook too
    """
    if not callable(fn):
        raise TypeError(f"spawn: fn must be callable, got {type(fn).__name__}")
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"spawn: nprocs must be a positive int, got {nprocs!r}")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"spawn: args must be a tuple or list of arguments, got {type(args).__name__}")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"spawn: max_restarts must be an int >= 0, got {max_restarts!r}")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"spawn: timeout must be a positive number of seconds, got {timeout!r}")
    if start_method not in (None, *START_METHODS):
        raise ValueError(f"spawn: start_method must be one of {START_METHODS} or None, got {start_method!r}")
    args, kwargs = tuple(args), dict(kwargs or {})
    method = start_method or _auto_start_method(fn, args, kwargs)
    # (is_initialized alone: torch.cuda.is_available() would itself initialise CUDA before the fork.)
    if method == "fork" and torch.cuda.is_initialized():
        raise RuntimeError(
            "spawn: CUDA is already initialised in this process and forked workers cannot use it; call "
            "spawn before any CUDA work (restart the kernel), or define fn in a module and use "
            "start_method='spawn'"
        )

    from torch.distributed.elastic.multiprocessing import SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from unison.launch.logs import HeldPortLogsSpecs
    from unison.launch.torch_compat import launch_config

    log_dir = tempfile.mkdtemp(prefix="unison-spawn-")
    # From a terminal, the workers' output is forwarded a line at a time, prefixed with the rank,
    # and rank 0's bars are drawn below it (as `unison launch` does); elsewhere (a notebook, a
    # pipe) the workers write to the caller's stdout and stderr themselves.
    relay = BarRelay.for_terminal(sys.stderr)
    forwarded = {"redirects": Std.ALL, "tee": Std.ALL} if relay else {}
    logs_specs = HeldPortLogsSpecs(log_dir=log_dir, **forwarded)
    # Forking: torch's launcher asks torch.cuda.is_available() (LaunchConfig, the agent), which
    # initialises CUDA unless answered by NVML; the children could not use their GPUs then.
    fork_safe = cuda_check_without_init if method == "fork" else contextlib.nullcontext
    with fork_safe():
        config = launch_config(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nprocs,
            run_id=f"unison-spawn-{uuid.uuid4().hex}",
            # The agent rendezvous through a file (no socket, nothing a spawn picks can clash with);
            # workers get MASTER_ADDR 127.0.0.1, where rank 0 hosts their store on loopback only.
            rdzv_backend="c10d",
            rdzv_endpoint=os.path.join(log_dir, "rendezvous"),
            rdzv_configs={"store_type": "file"},
            local_addr="127.0.0.1",
            max_restarts=max_restarts,
            start_method=method,
            logs_specs=logs_specs,
            log_line_prefix_template="[rank${rank}] " if relay else None,
            shutdown_timeout=10,  # a worker that ignores SIGTERM is killed after this
        )
    try:
        # As under `unison launch`: the heartbeat store lives here, not in rank 0 (a frozen rank 0
        # would take down the store the others diagnose it with), and a stopped worker told to
        # terminate is continued so it ends at once (torch's agent would wait 30 s to kill it).
        bars = relay.env() if relay else {}
        with (
            heartbeat_store() as beats,
            _agent_state({**beats, **bars}),
            WatchWorkers(),
            fork_safe(),
            relay.console() if relay else contextlib.nullcontext(),
        ):
            run = elastic_launch(config, _worker)
            # Intra-op threads per worker: the user's OMP_NUM_THREADS if set, else an even share of the
            # cores (inside a `unison launch` worker: of that worker's share).
            results = run(fn, args, kwargs, threads_for_spawned(nprocs), timeout, method == "fork")
    except ChildFailedError as exc:
        raise _spawn_error(exc.failures) from None
    except SignalException as exc:
        if exc.sigval == signal.SIGINT:  # Ctrl-C / the notebook's interrupt: the workers are stopped
            raise KeyboardInterrupt from None
        raise
    finally:
        logs_specs.store_port.release()
        shutil.rmtree(log_dir, ignore_errors=True)
    return results[0]


def mp_spawn(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str | None = None,
) -> Any:
    """`torch.multiprocessing.spawn`'s form: run `fn(i, *args)` for `i` in `range(nprocs)`.

    A drop-in for the PyTorch DDP primer's `mp.spawn(main_worker, nprocs=n, args=(...))`: the same signature
    and the process index first, on `spawn`'s machinery (each process also gets RANK, WORLD_SIZE,
    MASTER_ADDR and a free MASTER_PORT, so `init_method="env://"` just works; a failure in any
    process stops all of them and raises `SpawnError` naming it). Returns rank 0's result where
    torch returns None. `daemon` is accepted (the processes never outlive the caller anyway);
    `start_method=None` picks as `spawn` does, so notebook functions work.

        def main_worker(gpu, ngpus_per_node, args):
            dist.init_process_group("gloo", init_method="env://", rank=gpu, world_size=ngpus_per_node)
        mp_spawn(main_worker, nprocs=2, args=(2, args))     # was: mp.spawn(main_worker, nprocs=2, ...)
    """
    if not join:
        raise ValueError(
            "mp_spawn: join=False is not supported (it returns torch's ProcessContext); call it from a "
            "thread, or use torch.multiprocessing.spawn"
        )
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"mp_spawn: args must be a tuple or list of arguments, got {type(args).__name__}")
    return spawn(_with_index, nprocs, args=(fn, tuple(args)), start_method=start_method)


def _with_index(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """mp.spawn's calling convention: the process index (its local rank) first."""
    return fn(int(os.environ["LOCAL_RANK"]), *args)


@contextlib.contextmanager
def _agent_state(extra_env: Mapping[str, str]) -> Iterator[None]:
    """Set up the caller for torch's agent (and the workers' `extra_env`), and put back what the
    agent changes (signals, environment)."""
    # Workers get their own MASTER_PORT (a free one) instead of sharing the agent's store: with a
    # shared store torch makes every rank a client of `init_method="tcp://host:port"` too, so a
    # group the user makes on a port of their choosing (examples/mp_spawn.py) would wait forever for a server.
    # Huge pages as `unison launch` exports them (a fresh interpreter reads the variable at start).
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **huge_pages_env(), **extra_env}
    in_main = threading.current_thread() is threading.main_thread()  # (the agent skips handlers otherwise)
    saved_handlers = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS if in_main}
    try:
        with mock.patch.dict(os.environ, env):  # also puts back TORCHELASTIC_SIGNALS_TO_HANDLE, the agent's
            yield
    finally:
        for sig, handler in saved_handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


# Start method. "spawn" (fresh interpreters) is torch's default and the safe one: nothing of the
# parent's state leaks in (CUDA, OpenMP's thread pool, locks held by other threads). But a fresh
# interpreter finds `fn` by importing it, and a function defined in a notebook or REPL (a
# `__main__` without a file), a lambda or a closure cannot be imported; for those alone we fork,
# as Accelerate's notebook_launcher does. Forking has two known hazards, both handled:
# - CUDA cannot be used in a forked child once the parent initialised it: refused up front.
# - GNU OpenMP (torch's intra-op pool on Linux) deadlocks in a forked child that runs a parallel
#   region with more than one thread after the parent ran one (tested: 2 threads each side hang).
#   libgomp keeps its pool per thread, so the worker runs `fn` in a new thread, which builds a
#   fresh pool; the forked main thread only waits for it.
# "forkserver" would not help: its server cannot import a notebook's `__main__` either.
def _auto_start_method(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """'spawn' if a fresh interpreter can rebuild fn and its arguments by import, else 'fork'."""
    try:
        _check_picklable((fn, args, kwargs), fresh_interpreter=True)
    except Exception:
        return "fork"
    return "spawn"


def _check_picklable(obj: Any, fresh_interpreter: bool) -> None:
    """Raise if `obj` cannot be pickled (tensors are skipped: they travel fine and may be large).

    With `fresh_interpreter`, also refuse functions and classes of an interactive `__main__`
    (a notebook's): they pickle by name, but a new interpreter has no such names.
    """
    interactive = fresh_interpreter and getattr(sys.modules.get("__main__"), "__file__", None) is None

    class Probe(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return 0 if isinstance(obj, torch.Tensor) else None

        def reducer_override(self, obj: Any) -> Any:
            if interactive and isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
                raise pickle.PicklingError(f"{obj.__qualname__} is defined in an interactive session")
            return NotImplemented

    with open(os.devnull, "wb") as sink:
        Probe(sink, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)


def _worker(
    fn: Callable[..., Any], args: tuple, kwargs: dict, threads: int, timeout: float | None, forked: bool
):
    """Runs in each worker, under the agent's error recorder (which writes the traceback file)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if timeout is not None:
        os.environ[TIMEOUT_ENV] = str(timeout)

    def call() -> Any:
        torch.set_num_threads(threads)  # per thread under OpenMP: set in the thread that runs fn
        return fn(*args, **kwargs)

    if forked:
        # A forked child inherits the parent's Python signal handlers (the agent's, the kernel's):
        # put back the defaults, so SIGTERM from the agent ends it even inside a C++ collective.
        for sig in _AGENT_SIGNALS:
            signal.signal(sig, default_handler(sig))
        result = deadline.within(threading.TIMEOUT_MAX, call, "fn")  # a fresh thread, waited for as it runs
    else:
        result = call()
    if os.environ.get("RANK") != "0":
        return None  # only rank 0's result is sent back
    # CUDA tensors would travel as IPC handles into memory of a process that is about to exit.
    result = to_cpu(result)
    try:
        _check_picklable(result, fresh_interpreter=False)
    except Exception as exc:
        raise TypeError(
            f"spawn: rank 0 returned a {type(result).__name__} that cannot be sent back to the caller "
            f"({type(exc).__name__}: {exc}); return tensors or plain data"
        ) from None
    return result


def _spawn_error(failures: Mapping[int, Any]) -> SpawnError:
    """The root cause among the failed ranks: one that left a traceback, earliest first."""
    details = {rank: _describe(failure) for rank, failure in failures.items()}
    rank = min(details, key=lambda r: (not details[r][1], failures[r].timestamp, r))
    return SpawnError(rank, failures[rank].exitcode, details[rank][0], _user_frames(details[rank][1]))


def _user_frames(traceback: str) -> str:
    """`traceback` without the launcher's frames (torch's error recorder, this module, its thread's)."""
    lines, skip = [], False
    for line in traceback.splitlines():
        if line.startswith('  File "'):
            path = line[8 : line.find('"', 8)]
            skip = path in (__file__, deadline.__file__) or "torch/distributed/elastic/" in path
        elif not line.startswith("    "):
            skip = False
        if not skip:
            lines.append(line)
    return "\n".join(lines)


def _describe(failure: Any) -> tuple[str, str]:
    """(one-line error, traceback text) of a torch elastic ProcessFailure."""
    error, traceback = failure_message(failure)  # from its error file, if it wrote one
    if error or traceback:
        return error, traceback
    if failure.exitcode < 0:
        return f"killed by signal {failure.signal_name()}", ""
    return "the process exited without a Python traceback (see its output above)", ""
