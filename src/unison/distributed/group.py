"""Joining and leaving the process group, and `rank0_first`.

unison forms a group only when a launcher described one in the environment and
none exists yet; a group the user's script made (any init method) is used as it
is and never torn down by unison. Every group unison makes has a timeout well
below torch's 30 minutes, so a rank that stops answering fails the job instead
of hanging it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from unison.distributed.devices import check_local_rank, resolve_backend
from unison.distributed.env import DistribEnv, group_active, threads_per_worker, usable_cores
from unison.distributed.network import store_listener
from unison.distributed.slurm import is_srun_task, task_threads
from unison.env_names import TIMEOUT_ENV

T = TypeVar("T")

#: Seconds a collective may wait for the other ranks before failing (torch's default is 1800).
DEFAULT_TIMEOUT_S = 600.0
#: Seconds the main thread gives gloo's threads, without the GIL, before a group is destroyed.
GLOO_SETTLE_S = 0.02
#: Extra seconds an NCCL group waits beyond the timeout, for unison's stall diagnosis to come first.
NCCL_MARGIN_S = 30.0

_created_here = False
_generation = 0
# One store per master address, kept for the life of the process: a group made again
# (two distrib_ctx blocks in one script) rendezvous under a fresh key prefix on the same store.
_stores: dict[tuple[str, int], dist.Store] = {}


def resolve_timeout(timeout: float | None) -> float:
    """`timeout` if given, else `$UNISON_TIMEOUT` (set by `unison launch --timeout`), else the default."""
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        timeout = float(raw) if raw else DEFAULT_TIMEOUT_S
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def _store(env: DistribEnv, timeout: datetime.timedelta) -> dist.Store:
    assert env.master_addr is not None and env.master_port is not None
    key = (env.master_addr, env.master_port)
    if key not in _stores:
        # Under torchrun the agent already hosts the store: every worker is a client.
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        hosting = env.rank == 0 and not agent_hosts
        _stores[key] = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=hosting,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=_loopback_listener(env) if hosting else None,
        )
    return _stores[key]


def _loopback_listener(env: DistribEnv) -> int | None:
    """A socket bound to the loopback MASTER_ADDR for the store to serve on, or None.

    A TCPStore binds every interface by default; a job on one machine must not open a port
    to the network, so when the master address is a loopback one the store gets a socket
    bound to it alone. (Multi-machine jobs need the store reachable: torch's default.)
    """
    assert env.master_addr is not None and env.master_port is not None
    host = "127.0.0.1" if env.master_addr == "localhost" else env.master_addr
    try:
        if not ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a host name other than localhost: the network
        return None
    return store_listener(host, env.master_port).detach()  # the store owns the descriptor from here on


def setup_distrib(gpu: int | None = None, timeout: float | None = None, backend: str | None = None) -> bool:
    """Join the process group the environment describes; return True if this call created it.

    gloo without CUDA, NCCL with it (binding `gpu`, default the local rank); `backend="gloo"` or
    `$UNISON_BACKEND=gloo` trains on the CPU of a GPU machine. False when the
    process was not launched, or when a group already exists (whoever made it): then a
    `timeout` given here or by `unison launch --timeout` is applied to that group.

        setup_distrib()       # under `unison launch --nproc 2 script.py`
    """
    global _created_here, _generation
    if group_active():
        _bound_live_group(timeout)
        if gpu is not None and dist.get_backend() == "nccl":
            torch.cuda.set_device(gpu)
        return False
    backend = resolve_backend(backend)  # `backend="gloo"` / `$UNISON_BACKEND`: the CPU on a GPU machine
    cuda = backend == "nccl"
    if gpu is not None and cuda:
        torch.cuda.set_device(gpu)
    env = DistribEnv.from_environ()
    if env.world_size == 1 and env.master_port is None:
        return False  # not launched: one plain process
    if env.master_addr is None or env.master_port is None:
        raise RuntimeError(
            f"this process is rank {env.rank} of {env.world_size} but MASTER_ADDR/MASTER_PORT "
            "are not set: export them (e.g. the first host of the job) or use unison launch"
        )
    if cuda and gpu is None:
        torch.cuda.set_device(check_local_rank(env.local_rank, torch.cuda.device_count()))
    if is_srun_task(os.environ):  # srun started us, not a launcher that would have set the threads
        threads = task_threads(os.environ, threads_per_worker(env.local_world_size), usable_cores())
        if threads is not None:
            torch.set_num_threads(threads)
    wait = datetime.timedelta(seconds=resolve_timeout(timeout))
    if cuda:
        # NCCL times out in its own watchdog thread, which aborts the process: give unison's
        # heartbeat watchdog (it fires after `timeout` without progress) the time to name the
        # missing rank first; and tear the process down rather than hang if it cannot.
        wait += datetime.timedelta(seconds=max(NCCL_MARGIN_S, 0.25 * wait.total_seconds()))
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    _generation += 1
    store = dist.PrefixStore(group_key_prefix(_generation), _store(env, wait))
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=wait)
    _created_here = True
    return True


def group_key_prefix(generation: int, environ: dict[str, str] | None = None) -> str:
    """The store keys of the `generation`-th group this process makes: the same on every rank.

    Every rank of an attempt must build the same prefix, and TORCHELASTIC_RESTART_COUNT is not
    agreed across machines: torch's agent counts a restart on the node whose worker failed, not
    on a node that restarts its workers because that one re-joined (the ranks then waited on
    different keys until the timeout). A store the workers host (rank 0, as `unison launch`
    arranges) is new with every rendezvous round, so the group's number in this process is
    enough. torch's agent store (TORCHELASTIC_USE_AGENT_STORE=True, torchrun's default since
    2.4) outlives the rounds and gives the workers nothing else per round, so there the restart
    count stays, as torch's own `env://` has it: agreed on one machine; across machines use
    `unison launch`, or export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun.

    >>> group_key_prefix(1, {})
    'unison/1'
    >>> group_key_prefix(2, {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "1"})
    'unison/agent-store/1/2'
    """
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return f"unison/agent-store/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{generation}"
    return f"unison/{generation}"


def _bound_live_group(timeout: float | None) -> None:
    """Apply a timeout that was asked for (argument or `unison launch --timeout`) to the live group.

    A group the script made (`init_process_group`, as in examples/local_rank.py) keeps torch's 30
    minutes otherwise; a group unison made earlier (`rank0_first`) keeps the timeout it was made
    with. Left as is when no timeout was asked for.
    """
    if timeout is None and not os.environ.get(TIMEOUT_ENV):
        return
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=resolve_timeout(timeout)))


def teardown_distrib() -> None:
    """Leave the default process group, if this process is in one.

    >>> teardown_distrib()
    """
    global _created_here
    if group_active():
        destroy_group()
    _created_here = False


def leave_group(created: bool) -> bool:
    """A strategy's `leave()`: leave the default group where it made it (`created`), once the host
    let go of the wrapped model (a DDP wrapper freed after its group hangs in teardown,
    pytorch/pytorch#56297). Returns False: the strategy no longer holds a group it made.

    >>> leave_group(False)
    False
    """
    if created:
        teardown_distrib()
    return False


def destroy_group(group: dist.ProcessGroup | None = None) -> None:
    """`dist.destroy_process_group(group)`, after a pause that lets gloo's threads settle.

    torch's gloo group destructor runs holding the GIL and waits for its threads, while a
    thread freeing a just-finished collective (tensors Python has dropped) needs the GIL: the
    two deadlock (pytorch/pytorch#56297). A short sleep, which releases the GIL and the CPU,
    lets those threads finish first; every collective unison waited on has completed by now.

        destroy_group()  # the default group
    """
    if dist.get_backend(group) == "gloo":
        time.sleep(GLOO_SETTLE_S)
    dist.destroy_process_group(group)


def group_generation() -> int:
    """How many groups `setup_distrib` made in this process (0: the live group is the user's)."""
    return _generation if _created_here else 0


def created_by_unison() -> bool:
    """True while the live group is one `setup_distrib` made."""
    return _created_here and group_active()


def rank0_first(func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run `func(*args, **kwargs)` on rank 0 first, then on the other ranks together.

    For work that must happen once before the others read it (downloads, caches).
    If rank 0's call raises, the other ranks raise a clear error too instead of
    waiting. One process outside a launch just calls `func`.

        path = rank0_first(download_dataset, "digits")
    """
    setup_distrib()  # rank0_first may run before distrib_ctx; the group stays for it to use
    if not group_active() or dist.get_world_size() == 1:
        return func(*args, **kwargs)
    name = getattr(func, "__qualname__", repr(func))
    rank = dist.get_rank()
    status: list[Any] = [None]
    if rank == 0:
        try:
            return func(*args, **kwargs)
        except BaseException as exc:
            status[0] = f"{type(exc).__name__}: {exc}"
            raise
        finally:  # the others learn whether it ran (or why not) before they go on
            dist.broadcast_object_list(status, src=0, device=_object_device())
    dist.broadcast_object_list(status, src=0, device=_object_device())
    if status[0] is not None:
        raise RuntimeError(f"rank0_first: {name} failed on rank 0 ({status[0]}); rank {rank} did not run it")
    return func(*args, **kwargs)


def _object_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
