"""The `unison` console script: `unison launch ...`, `unison check-exact ...`, `unison env` and
`unison lighthouse` (torchft's, for `distrib_ctx(fault_tolerant=True)`).

unison launch --nproc 2 train.py                 # see `unison launch --help`
unison check-exact --nproc 2 --float64 train.py  # 1 vs 2 processes on your own script
unison env                                       # what this machine and environment offer a launch
unison lighthouse --min-replicas 2               # fault-tolerant replicas find each other through it
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from unison.distributed.lighthouse import start_lighthouse
from unison.env_names import LIGHTHOUSE_ENV, LIGHTHOUSE_PARENT_ENV
from unison.launch.lighthouse import DEFAULT_PORT, TIMINGS, check_served, timing_flag
from unison.launch.options import LaunchError

_USAGE = """\
usage: unison {launch,check-exact,env,lighthouse} ...

  launch       run a training script on several processes, GPUs or machines (unison launch --help)
  check-exact  run a script a few steps on 1 and on N processes and compare weights, losses and
               metrics: float noise or a real divergence (unison check-exact --help)
  env          show versions, backends, GPUs, rank variables, the gloo interface and threads
  lighthouse   start torchft's lighthouse for distrib_ctx(fault_tolerant=True) replicas
               (unison lighthouse --help)
"""

_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def env_report(environ: dict[str, str] | None = None) -> str:
    """The text `unison env` prints: everything a launch depends on, one fact per line.

    >>> print(env_report({"MASTER_ADDR": "127.0.0.1"}))   # doctest: +ELLIPSIS
    unison ... torch ...
    """
    import torch
    import torch.distributed as dist

    import unison
    from unison.distributed.env import threads_per_worker, usable_cores
    from unison.distributed.network import default_route_interface, interface_for

    env = dict(os.environ if environ is None else environ)
    lines = [f"unison {unison.__version__}, torch {torch.__version__}, python {sys.version.split()[0]}"]
    backends = []
    for name in ("gloo", "nccl", "mpi"):
        check = getattr(dist, f"is_{name}_available", None)
        backends.append(f"{name} {'yes' if dist.is_available() and check and check() else 'no'}")
    lines.append(f"backends: {', '.join(backends)}")
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        gpus = ", ".join(f"{i}: {n}" for i, n in enumerate(names))
        lines.append(f"CUDA {torch.version.cuda}: {len(names)} GPU(s): {gpus}")
    else:
        built = torch.version.cuda or "none (a CPU build)"
        lines.append(f"CUDA: no GPU available (torch's CUDA: {built})")
    seen = [k for k in _RANK_VARS if k in env]
    seen += sorted(
        k
        for k in env
        if k.startswith(("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_", "PET_", "TORCHX_", "TORCHFT_"))
    )
    if seen:
        lines.append("rank variables: " + " ".join(f"{k}={env[k]}" for k in seen))
    else:
        lines.append("rank variables: none (not inside a launch)")
    master = env.get("MASTER_ADDR")
    route = interface_for(master) if master else default_route_interface()
    towards = f"towards MASTER_ADDR={master}" if master else "of the default route"
    chosen = f"{route[0]} ({route[1]})" if route else "unknown"
    lines.append(f"gloo interface {towards}: {chosen}")
    if env.get("GLOO_SOCKET_IFNAME"):
        lines.append(f"  GLOO_SOCKET_IFNAME={env['GLOO_SOCKET_IFNAME']} is set and wins")
    local = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    omp = env.get("OMP_NUM_THREADS", "unset")
    lines.append(
        f"threads: torch uses {torch.get_num_threads()}; OMP_NUM_THREADS={omp}; {usable_cores()} usable "
        f"cores -> {threads_per_worker(local)} per worker with {local} local worker(s)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `unison` console script; returns the exit status.

    For example:

        main(["env"])
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "launch":
        from unison.launch.launcher import main as launch_main

        return launch_main(rest)
    if command == "check-exact":
        from unison.check.runs import main as check_main

        return check_main(rest)
    if command == "env":
        if rest:
            print(f"unison env: takes no arguments, got {' '.join(rest)}", file=sys.stderr)
            return 2
        print(env_report())
        return 0
    if command == "lighthouse":
        return lighthouse_main(rest)
    print(
        f"unison: unknown command {command!r} (use launch, check-exact, env or lighthouse; unison --help)",
        file=sys.stderr,
    )
    return 2


def lighthouse_main(argv: Sequence[str]) -> int:
    """`unison lighthouse`: start torchft's lighthouse, print `TORCHFT_LIGHTHOUSE=<address>` for the
    replicas, and serve until SIGTERM or Ctrl-C. Returns the exit status. For example
    (`unison lighthouse --min-replicas 2 --port 29510` on the command line):

        lighthouse_main(["--min-replicas", "2", "--port", "29510"])
    """
    what = (
        "Start torchft's lighthouse, print TORCHFT_LIGHTHOUSE=<address> for the replicas "
        "(distrib_ctx(fault_tolerant=True)), and serve until SIGTERM or Ctrl-C."
    )
    parser = argparse.ArgumentParser(prog="unison lighthouse", description=what)
    parser.add_argument("--min-replicas", type=int, default=2, help="no quorum with fewer (default 2)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0: any free port (default 29510)")
    for field, default, text in TIMINGS:
        parser.add_argument(
            timing_flag(field, "--"), type=int, default=default, help=f"{text} (default {default})"
        )
    args = parser.parse_args(list(argv))
    try:
        check_served(args.min_replicas, args.port, {f: getattr(args, f) for f, _, _ in TIMINGS}, "--")
    except LaunchError as exc:
        print(f"unison lighthouse: {exc}", file=sys.stderr)
        return 2
    try:
        server = start_lighthouse(
            args.min_replicas, args.port, args.join_timeout_ms, args.quorum_tick_ms, args.heartbeat_timeout_ms
        )
    except Exception as exc:  # (a port in use, torchft missing): one line, no traceback
        print(f"unison lighthouse: could not start on port {args.port}: {exc}", file=sys.stderr)
        return 1
    print(f"{LIGHTHOUSE_ENV}={server.address()}", flush=True)
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    parent = int(os.environ.get(LIGHTHOUSE_PARENT_ENV, "0"))  # `unison launch --start-lighthouse`'s launcher
    while signal.sigtimedwait(stop, 0.5) is None:
        if parent and os.getppid() != parent:  # the launcher is gone (even SIGKILLed): so is this
            break
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
