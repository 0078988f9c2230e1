"""torchrun's options on `unison launch`, with torchrun's meaning.

`unison launch` takes every option of `torchrun` (torch 2.13's `torch/distributed/run.py`), in both
spellings (`--nproc-per-node` / `--nproc_per_node`), so a command line or an sbatch script can swap
`torchrun` for `unison launch` and change nothing else. Each option either works as in torchrun or
is refused with one line that says what to use instead. This module adds them to the parser and
turns them into what the launcher needs; `launcher.parse_options` does the checks shared with
unison's own options.

    unison launch --standalone --nproc-per-node 2 train.py 50 10     # torchrun's README command
    unison launch --nproc_per_node auto -m mypkg.train --lr 0.1      # a module, one process per core
    unison launch --nnodes 2 --rdzv-backend c10d --rdzv-endpoint head:29500 --rdzv-id 7 train.py

What unison does differently (and says so in `unison launch --help`):
- a bare `--rdzv-endpoint H:P` means an elastic c10d rendezvous (torchrun's default backend,
  `static`, is chosen with `--rdzv-backend static`);
- `--node-rank` with an elastic rendezvous is ignored, as torchrun ignores it (ranks come from the
  rendezvous), with a note instead of torchrun's log warning;
- `--log-dir` keeps unison's layout `<dir>/attempt_<k>/rank<R>.{stdout,stderr}.log`; every rank's
  output is always written there (`--tee` is therefore always on) and shown on the console unless
  `--redirects` or `--local-ranks-filter` says otherwise;
- `--logs-specs` (a LogsSpecs plugin) is refused: unison's per-rank logs replace it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.machinery import PathFinder
from typing import Any

from unison.signals import launcher_signals

__all__ = [
    "LaunchError",
    "TorchrunChoices",
    "parse_gpus",
    "parse_nnodes",
    "add_torchrun_options",
    "parse_nproc",
    "torchrun_choices",
]


class LaunchError(ValueError):
    """Bad launch options or environment, found before any process starts (one readable line)."""


NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
START_METHODS = ("spawn", "fork", "forkserver")


def _both(name: str) -> tuple[str, ...]:
    """`--a-b` and `--a_b`, as torchrun spells its options."""
    dashed = f"--{name}"
    under = "--" + name.replace("-", "_")
    return (dashed, under) if under != dashed else (dashed,)


def add_torchrun_options(p: argparse.ArgumentParser) -> None:
    """Add torchrun's options that unison's parser does not already have (see the module docstring)."""
    g = p.add_argument_group("torchrun's options (same meaning as in torchrun)")
    add = g.add_argument
    add("--standalone", action="store_true", help="one machine, a rendezvous on a free port (the default)")
    add(*_both("rdzv-backend"), choices=RDZV_BACKENDS, metavar="B", help="c10d (elastic) or static; etcd")
    add(*_both("rdzv-conf"), default="", metavar="K=V,...", help="more rendezvous settings (torch's)")
    add("-m", "--module", action="store_true", help="run the script argument as a module, like python -m")
    add(*_both("no-python"), action="store_true", help="run the script argument as a program, not python")
    add(*_both("run-path"), action="store_true", help="accepted: the script always runs with runpy.run_path")
    add("-r", "--redirects", default="0", metavar="S", help="off the console: 1 out, 2 err, 3 both")
    add("-t", "--tee", default="0", metavar="S", help="accepted: every stream is always written to the logs")
    add(*_both("local-ranks-filter"), default="", metavar="R,..", help="local ranks shown on the console")
    add(*_both("role"), default="default", help="the workers' role name (torch's agent)")
    add(*_both("monitor-interval"), type=float, default=0.1, metavar="S", help="seconds between checks")
    add(*_both("start-method"), choices=START_METHODS, default="spawn", help="accepted (no effect)")
    add(*_both("event-log-handler"), default="null", metavar="NAME", help="torch's event log handler")
    add(*_both("duplicate-stdout-filters"), default="", metavar="A,B", help="stdout lines to a file")
    add(*_both("duplicate-stderr-filters"), default="", metavar="A,B", help="stderr lines to a file")
    add(*_both("local-addr"), metavar="H", help="this machine's address for the rendezvous")
    add(*_both("logs-specs"), metavar="NAME", help="refused: unison writes its own per-rank logs")
    add(*_both("numa-binding"), metavar="MODE", help="bind workers to CPUs near their GPU (CUDA only)")
    add(
        *_both("signals-to-handle"),
        metavar="SIGS",
        help="forwarded to the workers (SIGTERM,SIGINT,SIGHUP,"
        "SIGQUIT,SIGUSR1; or TORCHELASTIC_SIGNALS_TO_HANDLE); they checkpoint and exit 75 on it",
    )
    add(*_both("shutdown-timeout"), type=int, metavar="S", help="seconds before stopped workers are killed")
    add(*_both("virtual-local-rank"), action="store_true", help="LOCAL_RANK 0 everywhere, one GPU each")
    add(*_both("use-env"), action="store_true", help="torch.distributed.launch's: always so here")
    p.set_defaults(**pet_defaults(os.environ))


#: torchrun reads each option it is not given from `PET_<NAME>` (Kubeflow's PyTorchJob sets them).
_PET_OPTIONS = (
    "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "max_restarts",
    "monitor_interval", "start_method", "event_log_handler", "role", "log_dir", "redirects", "tee",
    "local_ranks_filter", "duplicate_stdout_filters", "duplicate_stderr_filters", "node_rank",
    "master_addr", "master_port", "local_addr", "signals_to_handle", "shutdown_timeout",
)  # fmt: skip
_PET_FLAGS = ("standalone", "module", "no_python", "run_path", "virtual_local_rank")


def pet_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """Parser defaults from torchrun's `PET_*` variables (an option on the command line wins).

    >>> pet_defaults({"PET_NPROC_PER_NODE": "4", "PET_STANDALONE": "1"})
    {'nproc': '4', 'standalone': True}
    """
    found: dict[str, Any] = {}
    for name in _PET_OPTIONS:
        value = environ.get(f"PET_{name.upper()}")
        if value:
            found["nproc" if name == "nproc_per_node" else name] = value
    for name in _PET_FLAGS:
        value = environ.get(f"PET_{name.upper()}", "0")
        if value not in ("", "0"):
            found[name] = True
    return found


def parse_nproc(spec: str | None) -> int | None:
    """`--nproc-per-node`: a count, or torchrun's `auto` (GPUs, else cores), `cpu`, `gpu`, `xpu`.

    >>> parse_nproc("3"), parse_nproc(None)
    (3, None)
    """
    if spec is None:
        return None
    word = spec.strip().lower()
    if word not in NPROC_WORDS:
        try:
            return int(word)
        except ValueError:
            raise LaunchError(
                f"--nproc {spec}: expected a number of processes or one of {', '.join(NPROC_WORDS)}"
            ) from None
    import torch

    from unison.distributed.env import usable_cores

    cores = usable_cores()
    if word == "cpu":
        return cores
    if word == "auto":  # torchrun: the accelerators if any, else the cores
        return torch.cuda.device_count() if torch.cuda.is_available() else cores
    count = torch.cuda.device_count() if word == "gpu" else torch.xpu.device_count()
    if count == 0:
        raise LaunchError(f"--nproc-per-node {spec}: this machine has no {word.upper()}; use a number or cpu")
    return count


@dataclass(frozen=True)
class TorchrunChoices:
    """What torchrun's options asked for, checked: the entry point, the console, the agent's extras."""

    #: how a worker runs the script argument: "script" (python file), "module" (-m) or "program"
    entry: str = "script"
    rdzv_backend: str | None = None
    rdzv_conf: dict[str, Any] = field(default_factory=dict)
    #: local ranks shown on the console (None: all)
    ranks_filter: frozenset[int] | None = None
    redirects: str = "0"
    #: LaunchConfig fields passed to torch's agent as given (role, monitor_interval, ...)
    agent: dict[str, Any] = field(default_factory=dict)
    #: one-line notes for the console (an option torchrun would ignore)
    notes: tuple[str, ...] = ()


def _check_entry(a: argparse.Namespace) -> str:
    if a.module and a.no_python:
        raise LaunchError("-m/--module and --no-python exclude each other (as in torchrun): choose one")
    if a.module:
        top = a.script.split(".")[0]
        if not top or PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None:
            raise LaunchError(f"-m {a.script}: no module named {top!r} here or on sys.path")
        return "module"
    if a.no_python:
        if not (os.path.isfile(a.script) and os.access(a.script, os.X_OK)) and shutil.which(a.script) is None:
            raise LaunchError(f"--no-python {a.script}: not an executable file, nor a program on PATH")
        return "program"
    return "script"


def _ranks(spec: str, option: str) -> frozenset[int] | None:
    if not spec.strip():
        return None
    try:
        ranks = frozenset(int(r) for r in spec.split(","))
    except ValueError:
        raise LaunchError(f"{option} {spec}: expected local ranks like 0,1") from None
    if any(r < 0 for r in ranks):
        raise LaunchError(f"{option} {spec}: ranks are >= 0")
    return ranks


def _std(spec: str, option: str) -> str:
    """torchrun's `--redirects` value checked as torch's `Std.from_str` reads it, without torch."""
    if not re.fullmatch(r"[0-3]|\d+:[0-3](,\d+:[0-3])*", spec.strip()):
        raise LaunchError(f"{option} {spec}: expected 0-3 (none, out, err, both) or 0:1,1:2")
    return spec


def _rdzv_conf(spec: str) -> dict[str, Any]:
    if not spec:
        return {}
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    try:
        return _parse_rendezvous_config(spec)
    except ValueError as exc:
        raise LaunchError(f"--rdzv-conf {spec}: {exc}") from None


def torchrun_choices(a: argparse.Namespace) -> TorchrunChoices:
    """Check torchrun's options in `a` and normalise the ones unison reads itself; one line on bad input.

    Moves `--standalone` and `--rdzv-backend static --rdzv-endpoint H:P` onto unison's own modes
    (edits `a.rdzv_endpoint`, `a.master_addr`, `a.master_port`, `a.node_rank` in place).
    """
    if a.logs_specs:
        raise LaunchError(
            f"--logs-specs {a.logs_specs}: unison launch writes its own per-rank logs (use --log-dir D; "
            "--redirects and --local-ranks-filter choose what the console shows); use torchrun for a plugin"
        )
    notes: list[str] = []
    single = a.nnodes.split(":")[-1] == "1"  # at most one machine
    if a.standalone:  # torchrun: one machine, a fresh rendezvous; explicit rendezvous values are ignored
        if a.rdzv_endpoint or a.master_port is not None or not single:
            raise LaunchError(
                "--standalone is one machine with its own rendezvous: drop --nnodes/--rdzv-endpoint/"
                "--master-port, or drop --standalone for a multi-machine job"
            )
    backend = None if a.standalone else a.rdzv_backend
    if backend == "static" and a.rdzv_endpoint:  # torchrun's static rendezvous at H:P
        host, _, port = a.rdzv_endpoint.rpartition(":")
        if not port.isdigit():
            raise LaunchError(f"--rdzv-endpoint {a.rdzv_endpoint}: expected HOST:PORT")
        a.master_addr, a.master_port, a.rdzv_endpoint = host.strip("[]"), int(port), None
    elif backend not in (None, "static") and not a.rdzv_endpoint:  # (static: --master-addr/--master-port)
        if not single:
            raise LaunchError(f"--rdzv-backend {backend} across machines needs --rdzv-endpoint HOST:PORT")
        backend = None  # one machine: unison's own rendezvous (a free port) is the same thing
    if a.rdzv_endpoint and a.rdzv_endpoint.rpartition(":")[2] == "0" and single:
        a.rdzv_endpoint = None  # torchrun's "localhost:0": a free port here, unison's standalone mode
    if a.rdzv_endpoint and a.node_rank is not None:
        notes.append("--node-rank is ignored with an elastic rendezvous (the rendezvous assigns ranks)")
        a.node_rank = None
    if a.rdzv_endpoint and (a.master_addr or a.master_port is not None):
        notes.append("--master-addr/--master-port are ignored with --rdzv-endpoint (as torchrun does)")
        a.master_addr = a.master_port = None
    as_given = ("role", "monitor_interval", "start_method", "event_log_handler", "virtual_local_rank")
    agent: dict[str, Any] = {name: getattr(a, name) for name in as_given}
    try:  # torch's spelling of the signals the agent handles (see `unison.signals`)
        agent["signals_to_handle"] = launcher_signals(a.signals_to_handle)
    except ValueError as exc:
        raise LaunchError(f"--signals-to-handle: {exc}") from None
    if not a.monitor_interval > 0:
        raise LaunchError(f"--monitor-interval must be positive (seconds), got {a.monitor_interval}")
    if a.shutdown_timeout is not None:
        if a.shutdown_timeout < 0:
            raise LaunchError(f"--shutdown-timeout must be >= 0, got {a.shutdown_timeout}")
        agent["shutdown_timeout"] = a.shutdown_timeout
    for stream in ("stdout", "stderr"):
        filters = getattr(a, f"duplicate_{stream}_filters")
        if filters:
            # torchrun's escape: ",," is a comma inside one filter
            agent[f"duplicate_{stream}_filters"] = [
                f.replace("\0", ",") for f in filters.replace(",,", "\0").split(",")
            ]
    if a.local_addr:
        agent["local_addr"] = a.local_addr
    if a.numa_binding:
        agent["numa_options"] = _numa(a.numa_binding)
    return TorchrunChoices(
        entry=_check_entry(a),
        rdzv_backend=backend,
        rdzv_conf=_rdzv_conf(a.rdzv_conf),
        ranks_filter=_ranks(a.local_ranks_filter, "--local-ranks-filter"),
        redirects=_std(a.redirects, "--redirects"),
        agent=agent,
        notes=tuple(notes),
    )


def _numa(mode: str) -> Any:
    import torch

    if not torch.cuda.is_available():
        raise LaunchError(f"--numa-binding {mode}: binds workers near their GPU, and this machine has none")
    from torch.numa.binding import AffinityMode, NumaOptions

    try:
        return NumaOptions(affinity_mode=AffinityMode(mode))
    except ValueError:
        modes = ", ".join(m.value for m in AffinityMode)
        raise LaunchError(f"--numa-binding {mode}: expected one of {modes}") from None


def parse_gpus(spec: str) -> tuple[int, ...]:
    """GPU ids from `--gpus` ("0,1" or "all"), checked against `torch.cuda.device_count()`."""
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise LaunchError(
            f"--gpus {spec}: this machine has no GPU (torch.cuda.device_count() is 0, torch "
            f"{torch.__version__}); use --nproc N to run N CPU processes"
        )
    if spec.strip().lower() == "all":
        return tuple(range(count))
    try:
        ids = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise LaunchError(f"--gpus {spec}: expected GPU ids like 0,1 or 'all'") from None
    absent = [i for i in ids if not 0 <= i < count]
    if not ids or absent or len(set(ids)) != len(ids):
        why = f"GPU {absent} not present" if absent else "ids must be distinct and non-empty"
        raise LaunchError(f"--gpus {spec}: {why}; this machine has {count} GPU(s): 0..{count - 1}")
    return ids


def parse_nnodes(spec: str, elastic: bool) -> tuple[int, int]:
    """`(min, max)` machines from `--nnodes` ("2", or "1:4" for an elastic rendezvous)."""
    try:
        lo, _, hi = spec.partition(":")
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise LaunchError(f"--nnodes {spec}: expected a number of machines (or MIN:MAX)") from None
    if not 1 <= low <= high:
        raise LaunchError(f"--nnodes {spec}: needs 1 <= MIN <= MAX")
    if low != high and not elastic:
        raise LaunchError(f"--nnodes {spec}: a range needs an elastic rendezvous (--rdzv-endpoint H:P)")
    return low, high
