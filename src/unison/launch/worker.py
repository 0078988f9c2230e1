"""The bootstrap every `unison launch` worker runs before the user's script.

torch's elastic agent starts each worker as `python -m unison.launch.worker script.py [args...]`
with the rank variables already exported (RANK, LOCAL_RANK, WORLD_SIZE, ...). This module

1. ties the worker's life to the launcher's: if the launcher dies (even by SIGKILL) the
   kernel kills the worker too (Linux `PR_SET_PDEATHSIG`), so no orphan keeps running;
2. line-buffers stdout/stderr, so the launcher's console tailer always sees whole lines;
3. sets torch's intra-op threads to `OMP_NUM_THREADS` (exported by the launcher:
   `threads_per_worker(local_world_size)` unless the user set it);
4. runs the script as `__main__` exactly as `python script.py args...` would (`sys.argv[0]`
   as typed, `__file__` absolute, the script's folder first on `sys.path`), or a module as
   `python -m module args...` would (`-m`), or execs a program (`--exec`, torchrun's
   `--no-python`); on an exception it writes the traceback to torch's error file
   (`TORCHELASTIC_ERROR_FILE`, with the error handler behind torch's `@record`), so the
   launcher's failure summary can show it. The file reaches torch's path whole or not at all
   (written beside it, then renamed): torch's agent reads it with `json.load` and fails on an
   empty or torn one, which cancelled a restart when a rank was stopped while writing it;
5. ends the process as the interpreter does, minus finalization (`end_process`): threading's
   own exit hooks run (they stop `concurrent.futures` pools, such as torch.compile's), the
   script's threads are joined, `atexit` handlers run, open files are flushed, then
   `os._exit`, skipping interpreter finalization. A gloo process group still alive at
   finalization aborts the process when one of its threads frees a finished collective's
   tensors (it needs the GIL, which finalization no longer gives: "terminate called without
   an active exception", SIGABRT after correct results; pytorch/pytorch#179291). Nothing a
   user relies on is skipped;
6. keeps a reference to each default process group the script makes (`launch.group_keeper`),
   so that freeing DDP after `destroy_process_group()` cannot run torch's gloo group destructor,
   which deadlocks there (pytorch/pytorch#56297); the group's threads end with the process.

On a CPU machine `unison launch` also starts a zygote (`launch.zygote`): this process then hands
its streams and arguments to it and relays signals and the exit status (it is the *stub*), and
the zygote forks the worker that runs the steps above, with torch already imported.

>>> # what the agent runs for each rank:
>>> # python -m unison.launch.worker train.py --epochs 3
>>> # python -m unison.launch.worker -m mypkg.train --epochs 3
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import json
import os
import runpy
import signal
import sys
import threading
from types import TracebackType
from typing import NoReturn

from unison.env_names import LAUNCHER_PID_ENV, ZYGOTE_ENV
from unison.launch.group_keeper import GroupKeeper
from unison.launch.stub import end_as

_PR_SET_PDEATHSIG = 1
#: The worker's arguments before the target, by the launcher's entry kind (see `options.TorchrunChoices`).
ENTRY_FLAGS: dict[str, tuple[str, ...]] = {"script": (), "module": ("-m",), "program": ("--exec",)}


def die_with_launcher() -> None:
    """Ask the kernel to SIGKILL this process when its parent (torch's agent) dies (Linux only)."""
    expected = os.environ.get(LAUNCHER_PID_ENV, "")
    die_with_parent(int(expected) if expected.isdigit() else None)


def die_with_parent(parent: int | None) -> None:
    """SIGKILL this process when its parent dies (Linux `PR_SET_PDEATHSIG`); end now if the parent
    is no longer `parent` (it died before the request: nobody is left to supervise this process)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: no prctl
        return
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def set_threads() -> int:
    """Apply `OMP_NUM_THREADS` (or the launcher's rule) to torch; return the thread count."""
    import torch

    from unison.distributed.env import threads_per_worker

    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    n = int(raw) if raw.isdigit() else 0
    if n < 1:
        n = threads_per_worker(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    torch.set_num_threads(n)
    return n


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """`tb` without the bootstrap's and runpy's frames, so tracebacks start in the user's script.

    None when no other frame is left (a SyntaxError in the script carries its own location).
    """
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name not in (__file__, runpy.__file__) and not name.startswith("<frozen runpy"):
            return tb
        tb = tb.tb_next
    return None


def run_script(script: str, args: list[str]) -> None:
    """Run `script` as `__main__` with `sys.argv = [script, *args]` (like `python script.py args`).

    `__file__` is the absolute path, as `python` gives it: a script that changes directory can
    still find its own files.
    """
    sys.argv = [script, *args]
    path = os.path.abspath(script)
    sys.path[0] = os.path.dirname(path)
    runpy.run_path(path, run_name="__main__")


def run_module(module: str, args: list[str]) -> None:
    """Run `module` as `__main__` like `python -m module args` (the current folder first on sys.path)."""
    sys.argv = [module, *args]  # runpy puts the module's file here, as python -m does
    sys.path[0] = os.getcwd()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def exec_program(program: str, args: list[str]) -> None:
    """Replace this process with `program args` (torchrun's --no-python); the parent-death signal stays."""
    target = os.path.abspath(program) if os.path.isfile(program) else program
    try:
        os.execvp(target, [program, *args])
    except OSError as exc:
        raise SystemExit(f"unison launch: cannot run {program}: {exc.strerror}") from None


#: Suffix of the error file while it is written (torch's agent never reads this name).
STAGED_SUFFIX = ".partial"


def stage_error_file() -> str | None:
    """Point TORCHELASTIC_ERROR_FILE (read by torch's `@record` and error handler) at a staging name.

    Returns torch's own path, where `publish_error_file` renames a whole file; None outside
    torch's agent.
    """
    final = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not final:
        return None
    os.environ["TORCHELASTIC_ERROR_FILE"] = final + STAGED_SUFFIX
    return final


def publish_error_file(final: str | None) -> None:
    """Rename the staged error file onto `final` if it holds whole JSON; else drop it.

    A rename is atomic: the agent sees no file (it then reports the exit code or signal) or a
    whole one, never the empty or torn file a write cut short leaves.
    """
    if final is None:
        return
    staged = final + STAGED_SUFFIX
    try:
        with open(staged) as fh:
            json.load(fh)
        os.replace(staged, final)
    except FileNotFoundError:
        return
    except (OSError, ValueError):  # torn (a full disk) or unreadable: no file beats a bad one
        with contextlib.suppress(OSError):
            os.remove(staged)


def exit_status(exc: SystemExit) -> int:
    """The status Python would exit with for `exc` (a message is printed to stderr, status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _flush_open_files() -> None:
    """Flush every open writable file object, as finalization would when it closes them."""
    kinds = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.FileIO)
    for obj in gc.get_objects():
        if issubclass(type(obj), kinds):  # not isinstance: it would read odd objects' __class__
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()


def shutdown_threads() -> None:
    """Do what the interpreter does with threads at exit, before the `atexit` handlers.

    That is `threading._shutdown`: run the hooks registered with `threading._register_atexit`
    (newest first), then join every non-daemon thread. The hooks come first because they are
    what ends threads that would otherwise wait forever: `concurrent.futures` registers one
    that wakes its pools' idle workers and tells them to stop. Joining before them, as this
    module once did, hung any worker holding a pool in a module global (torch.compile's
    inductor keeps one) after its script had finished.
    """
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
        return
    for hook in reversed(getattr(threading, "_threading_atexits", [])):  # not the main thread
        hook()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()


def end_process(status: int) -> NoReturn:
    """Exit with `status` as the interpreter would, without interpreter finalization.

    In Python's own order (`Py_FinalizeEx`): threading's exit hooks and the script's non-daemon
    threads (`shutdown_threads`), then the `atexit` handlers (logging, DataLoader workers,
    `weakref.finalize`), flush files and the console, then `os._exit`. Finalization is skipped
    because torch's gloo threads may still be freeing a finished collective when it starts, and
    they abort the process then (module docstring).

        end_process(0)
    """
    shutdown_threads()
    atexit._run_exitfuncs()
    _flush_open_files()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    os._exit(status)


def main(argv: list[str] | None = None, forked: bool = False) -> None:
    """Bootstrap this worker, then run the user's script (see the module docstring).

    `forked`: this process was forked by the launch's zygote (`launch.zygote`), which has tied
    it to its own life; otherwise, where the launcher started a zygote, this process becomes
    the stub of a worker forked from it, and runs nothing itself.
    """
    given = sys.argv[1:] if argv is None else argv  # what a stub hands on to the zygote
    entry = {"-m": "module", "--exec": "program"}.get(given[0] if given else "", "script")
    argv = given if entry == "script" else given[1:]
    if not argv:
        raise SystemExit(
            "usage: python -m unison.launch.worker [-m | --exec] script [args...] (run by `unison launch`)"
        )
    if not forked:
        die_with_launcher()
    if entry == "program":
        exec_program(argv[0], argv[1:])
    zygote = os.environ.get(ZYGOTE_ENV)
    if zygote and not forked:
        from unison.launch.stub import run_in_zygote

        run_in_zygote(zygote, given)  # returns only when no zygote answers: this process runs it, cold
        os.environ.pop(ZYGOTE_ENV, None)
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    handler = get_error_handler()  # what torch's @record uses
    handler.initialize()
    hook_before = sys.excepthook
    error_file = stage_error_file()
    GroupKeeper().start()  # torch's gloo teardown deadlock: the script's group outlives its DDP
    try:
        set_threads()  # imports unison: a broken install is reported like the script's own errors
        (run_module if entry == "module" else run_script)(argv[0], argv[1:])
    except SystemExit as exc:  # the script's own exit, perhaps after its own @record wrote the file
        publish_error_file(error_file)
        end_process(exit_status(exc))
    except (Exception, KeyboardInterrupt) as exc:
        exc.__traceback__ = _user_frames(exc.__traceback__)
        interrupted = isinstance(exc, KeyboardInterrupt)
        if not interrupted:
            with contextlib.suppress(OSError):  # a full disk: the summary shows the stderr log instead
                handler.record_exception(exc)  # TORCHELASTIC_ERROR_FILE: the launcher's summary shows it
            publish_error_file(error_file)
        hook = sys.excepthook
        if getattr(hook, "__name__", "") == "_distributed_excepthook":
            hook = hook_before  # torch's "[rankN]: " prefix: the launcher prefixes every line already
        hook(type(exc), exc, exc.__traceback__)
        if interrupted:  # Ctrl-C: the traceback once, with one prefix, then end as an interrupted Python
            end_as(-signal.SIGINT)  # does (killed by SIGINT), so the launcher reports the signal
        end_process(1)
    end_process(0)


if __name__ == "__main__":
    main()
