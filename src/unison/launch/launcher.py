"""`unison launch`: start a training script on N processes, GPUs or machines, with torch's elastic agent.

    unison launch --nproc 2 train.py --epochs 3              # 2 CPU processes on this machine
    unison launch --gpus 0,1 train.py                        # one process per GPU
    unison launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29400 train.py
    python -m unison.launch --nproc 4 train.py               # the same, without the console script

The agent, the rendezvous, restarts and error files are torch's
(`torch.distributed.launcher.api.launch_agent`); this module checks the options before
anything starts, chooses the rendezvous, exports what workers need, and reports a failure
in one summary. Each worker runs `python -m unison.launch.worker script.py args...`; on a CPU
machine that process has the worker forked from the launch's zygote, which has imported torch
already (`launch.zygote`, the warm start).

Long on purpose (about 600 lines): the typed launch configuration (`LaunchOptions`) and its one
parser must stay beside the plan they produce, so that every option and its check is read in
one place; network, failure reports, logs and the rendezvous each live in their own module.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

from unison.distributed.network import UnresolvedHost, interface_for, port_in_use, reach_host, resolve
from unison.env_names import BACKEND_ENV, LAUNCHER_PID_ENV, LAUNCHER_THREADS_ENV, LIGHTHOUSE_ENV, TIMEOUT_ENV
from unison.launch.bar_relay import BarRelay
from unison.launch.failures import failure_summary, said_preempted, unreadable_error_files
from unison.launch.lighthouse import (
    ReplicaOptions,
    add_replica_options,
    replica_options,
    served_lighthouse,
)
from unison.launch.neighbours import other_launches, sharing_note
from unison.launch.options import (
    LaunchError,
    TorchrunChoices,
    add_torchrun_options,
    parse_gpus,
    parse_nnodes,
    parse_nproc,
    torchrun_choices,
)
from unison.launch.rendezvous import (
    WatchWorkers,
    check_rdzv_endpoint,
    private_rendezvous_file,
    rdzv_failure_hint,
    rdzv_store_configs,
)
from unison.launch.worker import ENTRY_FLAGS
from unison.launch.zygote import Zygote, can_fork, warm_start_allowed
from unison.signals import PREEMPTED_EXIT

if TYPE_CHECKING:  # torch loads when a launch starts, after the options are checked (fast errors)
    from torch.distributed.launcher.api import LaunchConfig

    from unison.launch.logs import RankLogsSpecs

#: Seconds a worker gets to end after the launcher is told to stop (SIGTERM, SIGINT) before SIGKILL: the
#: launcher then ends inside the 30 s a cluster usually grants (Kubernetes' terminationGracePeriodSeconds,
#: SLURM's KillWait). torch's agent waits 30 s; --shutdown-timeout or TORCH_ELASTIC_SHUTDOWN_TIMEOUT set it.
SHUTDOWN_GRACE_S = 20

__all__ = [
    "SHUTDOWN_GRACE_S",
    "LaunchError",
    "LaunchOptions",
    "LaunchPlan",
    "gloo_interface",
    "launch",
    "main",
    "parse_options",
    "plan_launch",
]

_EPILOG = """\
Single machine: a c10d rendezvous on 127.0.0.1:0 (the store picks a free port), so any number
of launches can run at once. Several machines: run one command per machine, either static
(--nnodes N --node-rank I --master-addr H --master-port P; node 0 hosts the rendezvous on P)
or elastic (--rdzv-endpoint H:P, same command everywhere; --nnodes MIN:MAX allowed).

Every worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
(from torch's agent), UNISON_TIMEOUT (with --timeout) and:
  threads  each worker uses floor(usable cores / processes on this machine) threads, at least
           1: OMP_NUM_THREADS is exported unless you set it, and torch.set_num_threads follows it.
  gloo     GLOO_SOCKET_IFNAME is the interface that routes to the master address (loopback on
           one machine), unless you set it.
  memory   THP_MEM_ALLOC_ENABLE=1 (Linux), unless you set it: torch backs CPU tensors of 2 MB
           and more with transparent huge pages (fewer page faults; see benchmarks/RESULTS.md).
Warm start: on a CPU machine the workers are forked from a process that has imported torch
(restarts start in milliseconds); UNISON_WARM_START=0 starts each as a new interpreter.
Output: every rank's stdout and stderr, each line prefixed with the rank ([rank1] ...);
--local-ranks-filter 0 shows local rank 0 alone, --redirects 1 (2, 3) keeps stdout (stderr,
both) off the console. Every rank's output is also written to
<log-dir>/attempt_<k>/rank<R>.{stdout,stderr}.log (kept with --log-dir or --redirects).
--timeout S bounds every collective of a group unison makes (distrib_ctx, setup_distrib), and
is applied to a group the script made itself when a Learner joins it (to_distributed); a
group used without unison keeps the timeout given to init_process_group.
torchrun's options are accepted with torchrun's meaning (-m, --standalone, --rdzv-backend,
--nproc-per-node auto, --no-python, ...), in both spellings; a bare --rdzv-endpoint H:P means
an elastic c10d rendezvous, and --logs-specs is refused (use --log-dir).
On failure: one summary naming the first failing rank, its exit code or signal and the end of
its traceback; the exit status is the worker's (128+N for signal N); 2 for bad options.
Preempted: a signal of --signals-to-handle (default SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1) is
forwarded to the workers; a Learner's ranks stop at one step, write their checkpoint and exit 75,
which is the job's status ("resume me"), never restarted into (docs/faults.md, Preemption).
--max-restarts K: torch's agent restarts every worker up to K times (a script resumes with a
Checkpoint callback and fit(resume=True)); across machines this needs --rdzv-endpoint.
Per-step fault tolerance (distrib_ctx(fault_tolerant=True), docs/fault-tolerance.md): each launch
is one torchft replica group; --lighthouse http://host:port joins a lighthouse, --start-lighthouse
[--min-replicas N --lighthouse-port P] serves one for the launch's life, --replica-id NAME names
the group; --max-restarts K then restarts this group alone while the others keep training.
"""


def gloo_interface(host: str) -> str | None:
    """The network interface that routes to `host`: what `unison launch` exports as GLOO_SOCKET_IFNAME.

    For scripts that make their own gloo group across machines (no packet is sent to find it):

        os.environ.setdefault("GLOO_SOCKET_IFNAME", gloo_interface("10.0.0.1") or "")
        gloo_interface("127.0.0.1")
    """
    found = interface_for(host)
    return found[0] if found else None


@dataclass(frozen=True)
class LaunchOptions:
    """The parsed and checked options of `unison launch`.

    For example:

        opts = parse_options(["--nproc", "2", "train.py", "--lr", "0.1"])
        opts.nproc, opts.script_args, opts.mode
    """

    script: str
    script_args: tuple[str, ...] = ()
    nproc: int = 1
    gpus: tuple[int, ...] | None = None
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "unison"
    max_restarts: int = 0
    timeout: float | None = None
    log_dir: str | None = None
    legacy_local_rank: bool = False
    all_ranks_stdout: bool = False  # accepted; every rank's stdout is shown by default
    verbose: bool = False
    backend: str | None = None  # "gloo": CPU training on a GPU machine (exported as UNISON_BACKEND)
    torchrun: TorchrunChoices = field(default_factory=TorchrunChoices)
    replica: ReplicaOptions = field(default_factory=ReplicaOptions)  # one torchft replica group

    @property
    def mode(self) -> str:
        """'standalone' (one machine, free port), 'static' (master addr/port) or 'elastic' (rdzv endpoint)."""
        if self.rdzv_endpoint:
            return "elastic"
        return "static" if self.master_port is not None else "standalone"

    @property
    def master_host(self) -> str:
        """The host every node reaches for the rendezvous (loopback for a standalone launch)."""
        if self.rdzv_endpoint:
            return self.rdzv_endpoint.rsplit(":", 1)[0].strip("[]")
        return self.master_addr or "127.0.0.1"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        raise LaunchError(f"{message} (see unison launch --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="unison launch",
        description="Run a training script on several processes, GPUs or machines (torch elastic agent).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = p.add_argument
    add("--nproc", "--nproc-per-node", "--nproc_per_node", metavar="N", help="processes: N, auto, cpu, gpu")
    add("--gpus", metavar="IDS", help="GPU ids for this machine, e.g. 0,1 or 'all': one process per GPU")
    add("--nnodes", default="1", metavar="N", help="number of machines (N, or MIN:MAX with --rdzv-endpoint)")
    add("--node-rank", "--node_rank", type=int, metavar="I", help="this machine's rank, 0..N-1 (static)")
    add("--master-addr", "--master_addr", metavar="H", help="address of node 0, which hosts the rendezvous")
    add("--master-port", "--master_port", type=int, metavar="P", help="free port on node 0 (rendezvous)")
    add("--rdzv-endpoint", "--rdzv_endpoint", metavar="H:P", help="elastic rendezvous (c10d)")
    add("--rdzv-id", "--rdzv_id", default="unison", metavar="ID", help="job id shared by the nodes (unison)")
    add("--max-restarts", "--max_restarts", type=int, default=0, metavar="K", help="restarts on failure")
    add(
        "--timeout",
        type=float,
        metavar="S",
        help="seconds a collective may wait in a group unison makes or a Learner joins (distrib_ctx), "
        "and the static rendezvous; a group the script uses alone keeps its own timeout",
    )
    add("--log-dir", "--log_dir", metavar="D", help="keep every rank's stdout/stderr/error file in D")
    add("--legacy-local-rank", action="store_true", help="pass --local_rank=N before the script's args")
    add("--all-ranks-stdout", action="store_true", help="accepted: every rank's stdout is shown anyway")
    add(
        "--backend",
        choices=("gloo", "nccl"),
        help="process-group backend for every worker (gloo: train on the CPUs of a GPU machine)",
    )
    add("-v", "--verbose", action="store_true", help="show torch's elastic agent logs (and torchft's)")
    add("script", help="the training script (a module with -m, a program with --no-python)")
    add("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    add_torchrun_options(p)
    add_replica_options(p)
    return p


def _scheduler_defaults(a: argparse.Namespace, argv: Sequence[str]) -> None:
    """Under `srun --ntasks-per-node=1 unison launch ...` or in a PyTorchJob's pod: the machines, this
    one's rank and node 0's address and port come from SLURM or the pod (`launch.kubernetes.node_layout`)."""
    from unison.launch.kubernetes import node_layout

    given = {arg.split("=")[0].replace("_", "-") for arg in argv if arg.startswith("--")}
    if given & {"--nnodes", "--node-rank", "--master-addr", "--rdzv-endpoint", "--standalone"}:
        return
    try:
        layout = node_layout(os.environ)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    if layout is not None and layout[0] > 1:
        nodes, a.node_rank, a.master_addr, port = layout
        a.nnodes, a.master_port = str(nodes), a.master_port if "--master-port" in given else port


def parse_options(argv: Sequence[str]) -> LaunchOptions:
    """Parse and check `unison launch` arguments; raise `LaunchError` (one line) on bad input.

    Checks everything that can be checked before a process starts: the script exists, counts
    are positive, GPUs exist, the node rank is inside the world, node 0's port is free.

        parse_options(["--nproc", "0", "train.py"])
    """
    a = _parser().parse_args(list(argv))
    _scheduler_defaults(a, argv)
    a.nproc = parse_nproc(a.nproc)
    replica = replica_options(a)  # a LighthouseOptionError is a LaunchError
    torchrun = torchrun_choices(a)  # may move torchrun's spellings onto unison's own options
    if torchrun.entry == "script" and not os.path.isfile(a.script):
        where = os.path.abspath(a.script)
        raise LaunchError(f"script not found: {a.script} (looked for {where})")
    elastic = bool(a.rdzv_endpoint)
    min_nodes, max_nodes = parse_nnodes(a.nnodes, elastic)
    nproc = 1 if a.nproc is None else a.nproc
    gpus = None
    if a.gpus is not None:
        gpus = parse_gpus(a.gpus)
        if a.nproc is not None and a.nproc != len(gpus):
            raise LaunchError(f"--nproc {a.nproc} conflicts with --gpus {a.gpus} ({len(gpus)} GPUs)")
        nproc = len(gpus)
    if nproc < 1:
        raise LaunchError(f"--nproc must be at least 1, got {nproc}")
    node_rank = a.node_rank or 0
    if not 0 <= node_rank < max_nodes:
        raise LaunchError(f"--node-rank {node_rank} is outside --nnodes {a.nnodes} (0..{max_nodes - 1})")
    if a.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0, got {a.max_restarts}")
    if a.timeout is not None and not (a.timeout > 0 and math.isfinite(a.timeout)):
        raise LaunchError(f"--timeout must be a positive number of seconds, got {a.timeout}")
    if a.log_dir and os.path.exists(a.log_dir) and not os.path.isdir(a.log_dir):
        raise LaunchError(f"--log-dir {a.log_dir} is a file, not a folder")
    master_addr, master_port = a.master_addr, a.master_port
    if elastic:
        host, sep, port = a.rdzv_endpoint.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchError(f"--rdzv-endpoint {a.rdzv_endpoint}: expected HOST:PORT")
        _resolve(host.strip("[]"))
    elif max_nodes > 1 or master_addr or master_port is not None:
        if max_nodes > 1 and (master_addr is None or master_port is None):
            raise LaunchError(
                f"--nnodes {a.nnodes} needs --master-addr and --master-port (node 0's address and a "
                "free port there), or --rdzv-endpoint H:P"
            )
        if master_port is None:
            raise LaunchError("--master-addr needs --master-port (a free port on node 0)")
        if not 0 < master_port < 65536:
            raise LaunchError(f"--master-port must be in 1..65535, got {master_port}")
        if max_nodes > 1 and a.max_restarts > 0:
            raise LaunchError(
                "--max-restarts across machines needs an elastic rendezvous: use --rdzv-endpoint H:P "
                "(torch's static rendezvous cannot restart a multi-machine job)"
            )
        master_addr = master_addr or "127.0.0.1"
        _resolve(master_addr)
        if node_rank == 0 and port_in_use(master_port):
            raise LaunchError(
                f"--master-port {master_port} is already in use on this machine (node 0 hosts the "
                "rendezvous there): choose a free port"
            )
    passed: tuple[str, ...] = ("rdzv_endpoint", "rdzv_id", "max_restarts", "timeout", "log_dir")
    passed += ("legacy_local_rank", "all_ranks_stdout", "verbose", "backend")
    return LaunchOptions(
        a.script, tuple(a.script_args), nproc, gpus, min_nodes, max_nodes, node_rank,
        master_addr, master_port, **{name: getattr(a, name) for name in passed}, torchrun=torchrun,
        replica=replica,
    )  # fmt: skip


def _resolve(host: str) -> None:
    """A host that does not resolve is a bad option (`LaunchError`, one line)."""
    try:
        resolve(host)
    except UnresolvedHost as exc:
        raise LaunchError(str(exc)) from None


@dataclass
class LaunchPlan:
    """What `launch` hands to torch: the agent's config, the worker command, the exported variables."""

    config: LaunchConfig
    args: list[str]
    env: dict[str, str]
    logs: RankLogsSpecs
    gloo_interface: str | None = None
    notes: list[str] = field(default_factory=list)  # lines printed after `describe`'s

    def describe(self, opts: LaunchOptions) -> str:
        """One line about the launch, for the console."""
        where = "this machine" if opts.max_nodes == 1 else f"node {opts.node_rank} of {opts.max_nodes}"
        if opts.mode == "elastic":
            where = f"elastic job {opts.rdzv_id!r} at {opts.rdzv_endpoint}"
        elif opts.mode == "static" and opts.max_nodes > 1:
            where += f", master {opts.master_addr}:{opts.master_port}"
        return (
            f"unison launch: {opts.nproc} process(es) on {where}; "
            f"{self.env.get('OMP_NUM_THREADS', '?')} thread(s) each; gloo via {self.gloo_interface or '?'}"
        )


def plan_launch(opts: LaunchOptions, log_dir: str) -> LaunchPlan:
    """Build torch's `LaunchConfig`, the worker arguments and the variables to export."""
    from torch.distributed.elastic.utils import macros

    from unison.distributed.env import huge_pages_env, threads_per_worker
    from unison.launch.logs import RankLogsSpecs
    from unison.launch.torch_compat import BOUNDED_C10D, launch_config, register_bounded_c10d

    env: dict[str, str] = {LAUNCHER_PID_ENV: str(os.getpid()), **opts.replica.env()}
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "")
    others = {} if env["OMP_NUM_THREADS"] else other_launches()  # their workers share the cores
    if not env["OMP_NUM_THREADS"]:  # ours, not the user's: a spawn inside a worker divides it
        threads = threads_per_worker(opts.nproc + sum(others.values()))
        env["OMP_NUM_THREADS"] = env[LAUNCHER_THREADS_ENV] = str(threads)
    env.update(huge_pages_env())
    if opts.timeout is not None:
        env[TIMEOUT_ENV] = repr(opts.timeout)
    if opts.verbose:  # torchft's own INFO lines and tracebacks too, under fault tolerance
        env["UNISON_FT_VERBOSE"] = "1"
    if opts.backend is not None:
        env[BACKEND_ENV] = opts.backend  # read by setup_distrib and the trainers in every worker
    if opts.gpus is not None:  # ids count within an existing CUDA_VISIBLE_DEVICES, as torch does
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] if visible else str(i) for i in opts.gpus)
    # A torchft lighthouse reached over a network (not loopback): the other replica groups are reached
    # the same way, so gloo and the addresses a group advertises use the interface that routes to it.
    iface = interface_for(reach_host(opts.replica.lighthouse) or opts.master_host)
    gloo = os.environ.get("GLOO_SOCKET_IFNAME") or (iface[0] if iface else None)
    if gloo and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = gloo
    rdzv_timeout = math.ceil(opts.timeout) if opts.timeout is not None else None
    local_addr: str | None  # this node's address for the rendezvous (None: torch's choice)
    if opts.mode == "standalone":  # one machine: nothing listens beyond loopback
        # The agents rendezvous through a file (no socket at all); workers get MASTER_ADDR
        # 127.0.0.1, where rank 0 hosts their store (setup_distrib binds it to loopback).
        run_id, local_addr = uuid.uuid4().hex, "127.0.0.1"
        backend, endpoint = "c10d", private_rendezvous_file(run_id)
        configs: dict[str, object] = {"store_type": "file"}
    elif opts.mode == "static" and opts.max_nodes == 1 and opts.max_restarts:  # restartable: c10d, here
        backend, endpoint, run_id = "c10d", f"{opts.master_addr}:{opts.master_port}", uuid.uuid4().hex
        local_addr, configs = opts.master_addr, {"is_host": True}
    elif opts.mode == "static":
        backend, endpoint, run_id = "static", f"{opts.master_addr}:{opts.master_port}", opts.rdzv_id
        local_addr = None
        configs = {"rank": opts.node_rank, **({"timeout": rdzv_timeout} if rdzv_timeout else {})}
    else:
        backend, endpoint, run_id = "c10d", str(opts.rdzv_endpoint), opts.rdzv_id
        backend = opts.torchrun.rdzv_backend or backend  # torchrun's --rdzv-backend (etcd, ...)
        local_addr = iface[1] if iface else None  # the address the other nodes can reach us at
        # With restarts, a node cut off for longer than --timeout fails its workers, not the job: the
        # next rendezvous waits for it as torch's does (join 600 s, store reads 60 s; --rdzv-conf sets them).
        wait = None if opts.max_restarts else rdzv_timeout
        configs = {"join_timeout": wait} if wait else {}
        configs.update(rdzv_store_configs(endpoint, wait))  # the endpoint's owner hosts the store
        if backend == "c10d":  # each store call ends within read_timeout, also across a cut link
            backend = register_bounded_c10d()
    if backend in ("c10d", BOUNDED_C10D):
        # A restarted worker must not read the previous attempt's keys (gloo/NCCL addresses) from a
        # store that outlives it (pytorch/pytorch#135712), and the workers get nothing every node
        # agrees on per round to keep them apart (group.group_key_prefix): rank 0 of each attempt
        # hosts a fresh store. Elastic jobs restart on a node joining even with --max-restarts 0.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    configs.update({k: v for k, v in opts.torchrun.rdzv_conf.items() if k != "store_type"})  # --rdzv-conf
    agent = dict(opts.torchrun.agent)  # torchrun's options for torch's agent, as given
    user_grace = "shutdown_timeout" in agent
    if "shutdown_timeout" not in agent and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        agent["shutdown_timeout"] = SHUTDOWN_GRACE_S  # a worker ignoring SIGTERM ends inside the grace
    local_addr = agent.pop("local_addr", local_addr)
    replica = (opts.replica.replica_id or "(unnamed)") if opts.replica.active else None
    logs = RankLogsSpecs(
        log_dir, ranks_filter=opts.torchrun.ranks_filter, redirects=opts.torchrun.redirects, replica=replica
    )
    config = launch_config(
        user_grace=user_grace,
        min_nodes=opts.min_nodes,
        max_nodes=opts.max_nodes,
        nproc_per_node=opts.nproc,
        run_id=run_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=configs,
        max_restarts=opts.max_restarts,
        local_addr=local_addr,
        logs_specs=logs,
        log_line_prefix_template="[rank${rank}] ",
        **agent,
    )
    args = ["-m", "unison.launch.worker", *ENTRY_FLAGS[opts.torchrun.entry], opts.script]
    if opts.legacy_local_rank:  # where torch.distributed.launch put it: before the script's args
        args.append(f"--local_rank={macros.local_rank}")
    args.extend(opts.script_args)
    note = sharing_note(others, opts.nproc, int(env["OMP_NUM_THREADS"]))
    notes = [note] if note else []
    return LaunchPlan(config, args, env, logs, gloo_interface=gloo, notes=notes)


def launch(opts: LaunchOptions) -> int:
    """Run the job `opts` describes with torch's elastic agent; return the exit status.

    For example:

        launch(parse_options(["--nproc", "2", "train.py"]))
    """
    warm = opts.torchrun.entry != "program" and warm_start_allowed(os.environ, opts.gpus, opts.backend)
    zygote = _start_zygote() if warm else None
    from unittest import mock  # (it loads asyncio: only for a launch, not for an option error)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import launch_agent

    from unison.launch.logs import RestartRefused

    quiet_torch_logs(opts.verbose)
    if opts.rdzv_endpoint and opts.torchrun.rdzv_backend in (None, "c10d"):  # etcd's is no TCPStore
        try:
            check_rdzv_endpoint(opts.rdzv_endpoint, opts.rdzv_id)
        except (LaunchError, UnresolvedHost) as exc:
            print(f"unison launch: error: {exc}", file=sys.stderr)
            if zygote is not None:
                zygote.stop()
            return 2
    log_dir = os.path.abspath(opts.log_dir or tempfile.mkdtemp(prefix="unison-launch-"))
    # Output kept off the console (--redirects) is never dropped: its files outlive the launch.
    keep_logs = bool(opts.log_dir) or opts.torchrun.redirects != "0"
    plan: LaunchPlan | None = None
    try:
        plan = plan_launch(opts, log_dir)
        notes = [f"unison launch: note: {note}" for note in opts.torchrun.notes]
        print(*notes, plan.describe(opts), *plan.notes, sep="\n", file=sys.stderr, flush=True)
        if keep_logs and not opts.log_dir:
            print(f"unison launch: redirected output goes to {log_dir}", file=sys.stderr)
        with contextlib.suppress(AttributeError, ValueError):
            if isinstance(sys.stdout, io.TextIOWrapper):
                sys.stdout.reconfigure(line_buffering=True)
        relay = _bar_relay(plan.logs)
        with (
            served_lighthouse(opts.replica) as lighthouse,
            WatchWorkers(),
            plan.logs.console_guard(),
            relay.console() if relay else contextlib.nullcontext(),
        ):
            if lighthouse:  # --start-lighthouse: serves the other replica groups' launches too
                print(f"unison launch: lighthouse serving at {lighthouse}", file=sys.stderr, flush=True)
                plan.env[LIGHTHOUSE_ENV] = lighthouse
            bars = relay.env() if relay else {}
            warm_env = zygote.env() if zygote else {}
            # Exported for torch's agent, which passes os.environ on to the workers; put back after it.
            with (
                _heartbeats(opts) as beats,
                mock.patch.dict(os.environ, {**plan.env, **beats, **bars, **warm_env}),
            ):
                launch_agent(plan.config, sys.executable, plan.args)
        return 0
    except ChildFailedError as err:
        if said_preempted(log_dir, None):  # the signal reached the workers, not this launcher
            return PREEMPTED_EXIT
        kept = log_dir if keep_logs else None
        summary, code = failure_summary(err, plan.logs if plan is not None else None, kept)
        print(summary, file=sys.stderr, flush=True)
        return code
    except RestartRefused as refused:
        if said_preempted(log_dir, None):  # never restarted into
            return PREEMPTED_EXIT
        print(f"unison launch: {refused}", file=sys.stderr, flush=True)
        return 1
    except SignalException as sig:
        if said_preempted(log_dir, sig.sigval.name):  # the workers checkpointed and stopped
            return PREEMPTED_EXIT
        from unison.launch.torch_compat import shutdown_grace

        grace = shutdown_grace(plan.config) if plan else None
        late = plan.logs.stragglers(sig.sigval.name, grace) if plan is not None else ""
        print(f"unison launch: stopped by {sig.sigval.name}; workers were shut down{late}", file=sys.stderr)
        return 128 + int(sig.sigval)
    except KeyboardInterrupt:  # before torch's agent installed its handlers
        return 130
    except Exception as exc:  # rendezvous timeouts, unreachable master, ...: one line, not a trace
        torn = unreadable_error_files(log_dir) if isinstance(exc, json.JSONDecodeError) else []
        if torn:  # torch's agent stopped on it: name the rank rather than the parser's complaint
            rank, path = torn[0]
            print(
                f"unison launch: rank {rank} failed and left an empty or torn error file ({path}); torch's "
                f"agent stopped on it without restarting; its output: {path.parent}/rank{rank}.stderr.log",
                file=sys.stderr,
                flush=True,
            )
            return 1
        name = type(exc).__name__
        text = str(exc).strip() or _silent_error_text(name, opts)
        hint = ""
        if any(word in name for word in ("Store", "Rendezvous", "Network")):
            where = opts.rdzv_endpoint or f"{opts.master_addr}:{opts.master_port}"
            why = "is every node started, with its own --node-rank?"
            if opts.rdzv_endpoint:  # `ran`: lost while the workers ran
                why = rdzv_failure_hint(opts.rdzv_endpoint, ran=bool(plan and plan.logs.attempts))
            hint = f" (rendezvous at {where}: {why})"
        print(f"unison launch: {name}: {text}{hint}", file=sys.stderr, flush=True)
        return 1
    finally:
        if zygote is not None:
            zygote.stop()
        if plan is not None:
            plan.logs.store_port.release()  # the last attempt's store port, as unison.spawn lets its go
            if plan.config.rdzv_configs.get("store_type") == "file":
                with contextlib.suppress(OSError):
                    os.remove(plan.config.rdzv_endpoint)  # the one-machine rendezvous file
        sys.stdout.flush()
        if not keep_logs and not (plan and plan.logs.console_lost):  # else the logs hold the output
            shutil.rmtree(log_dir, ignore_errors=True)


def _silent_error_text(name: str, opts: LaunchOptions) -> str:
    """What torch's rendezvous errors that carry no message mean (a lost node gave an empty line)."""
    if name == "RendezvousTimeoutError":
        wait = f"{opts.timeout:g} s, --timeout" if opts.timeout is not None else "600 s, torch's default"
        return (
            f"the nodes did not all join the rendezvous within its timeout ({wait}): a node was lost "
            "or never started"
        )
    if name == "RendezvousClosedError":
        return "the job's rendezvous was closed: another node ended the job (see its output)"
    return "(torch gave no message)"


def _bar_relay(logs: RankLogsSpecs) -> BarRelay | None:
    """Rank 0's bars drawn on the launcher's terminal, when its stderr is one and shows rank 0's."""
    from torch.distributed.elastic.multiprocessing.api import Std

    relay = BarRelay.for_terminal(sys.stderr) if logs.on_console(0, Std.ERR) else None
    if relay is not None:
        logs.on_attempt = relay.clear  # a restarted rank 0's old bars are stale
    return relay


def _start_zygote() -> Zygote:
    """The warm start's zygote (`launch.zygote`), forked right after this process imports torch, when
    it can be (`can_fork`): before anything here changes torch's state (its loggers) or starts a
    thread, and before torch's agent modules load, which a worker need not carry. torch reads
    THP_MEM_ALLOC_ENABLE once, so it is set before torch loads (the workers get it anyway)."""
    from unison.distributed.env import huge_pages_env

    fork = can_fork()
    os.environ.update(huge_pages_env())
    import torch  # noqa: F401  (the zygote shares this import with the launcher)

    return Zygote.start(fork=fork)


def quiet_torch_logs(verbose: bool) -> None:
    """torch's agent logs every step at WARNING/ERROR; the summary says what matters."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.INFO if verbose else logging.CRITICAL)
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
        if verbose:
            logger.setLevel(logging.INFO)


def _heartbeats(opts: LaunchOptions) -> contextlib.AbstractContextManager[dict[str, str]]:
    """One machine: the launcher hosts the workers' heartbeat store (a frozen rank 0 cannot take it down)."""
    from unison.distributed.heartbeat_store import heartbeat_store  # (loads torch: after the options)

    return heartbeat_store() if opts.max_nodes == 1 else contextlib.nullcontext({})


def main(argv: Sequence[str] | None = None) -> int:
    """`unison launch ...` / `python -m unison.launch ...`: parse, check, launch; return the exit status."""
    try:
        opts = parse_options(sys.argv[1:] if argv is None else argv)
    except LaunchError as exc:
        print(f"unison launch: error: {exc}", file=sys.stderr)
        return 2
    return launch(opts)
