"""Where this process stands in a distributed job.

The answer comes from the live process group when one exists (whoever made it),
else from the variables a launcher exported: torchrun / `unison launch`
(`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, ...), a task srun started (`SLURM_PROCID`, ...; see
`unison.distributed.slurm`: a batch script or an `salloc` shell is not one) or Open MPI
(`OMPI_COMM_WORLD_RANK`, ...). Outside any launch: rank 0 of 1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from unison.distributed.slurm import is_srun_task, srun_layout
from unison.env_names import HUGE_PAGES_ENV, LAUNCHER_THREADS_ENV

# Each field lists the variables that carry it, first found wins.
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_WORLD_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
_LOCAL_WORLD_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def _first_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                # SLURM_NTASKS_PER_NODE may read "2(x3)": the leading count is ours.
                return int(value.split("(")[0])
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return default


@dataclass(frozen=True)
class DistribEnv:
    """The job layout a launcher described in the environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None

    @property
    def launched(self) -> bool:
        """True when the environment describes a multi-process job."""
        return self.world_size > 1

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> DistribEnv:
        """Read the layout from `env` (default `os.environ`); check it is consistent.

        >>> DistribEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2"}).rank
        1
        """
        env = os.environ if env is None else env
        if is_srun_task(env):  # srun started this process itself: SLURM's variables say it all
            layout = cls(*srun_layout(env))
        else:
            world = _first_int(env, _WORLD_VARS, 1)
            port = env.get("MASTER_PORT")
            layout = cls(
                rank=_first_int(env, _RANK_VARS, 0),
                world_size=world,
                local_rank=_first_int(env, _LOCAL_RANK_VARS, 0),
                local_world_size=_first_int(env, _LOCAL_WORLD_VARS, world),
                master_addr=env.get("MASTER_ADDR") or None,
                master_port=int(port) if port else None,
            )
        rank, world = layout.rank, layout.world_size
        if world < 1:
            raise ValueError(f"world size must be at least 1, the environment says {world}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside the world of {world} processes (ranks 0..{world - 1})")
        return layout


def group_active() -> bool:
    """True when this process belongs to an initialised default process group."""
    import torch.distributed as dist  # here, not above: `unison launch` reads this module before torch loads

    return dist.is_available() and dist.is_initialized()


def rank_distrib() -> int:
    """This process's global rank: from the process group if any, else the launcher's environment.

    >>> rank_distrib()  # outside a launch
    0
    """
    if group_active():
        import torch.distributed as dist

        return dist.get_rank()
    return DistribEnv.from_environ().rank


def num_distrib() -> int:
    """The number of processes in the job (1 outside a launch).

    >>> num_distrib()
    1
    """
    if group_active():
        import torch.distributed as dist

        return dist.get_world_size()
    return DistribEnv.from_environ().world_size


def local_rank() -> int:
    """This process's rank on its machine (the GPU it would use), from the launcher's environment.

    >>> local_rank()
    0
    """
    return DistribEnv.from_environ().local_rank


def is_main_process() -> bool:
    """True on rank 0, the process that prints, plots and writes files."""
    return rank_distrib() == 0


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's or SLURM's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_worker(local_world_size: int, cores: int | None = None) -> int:
    """Intra-op threads each of `local_world_size` workers on one machine should use.

    The machine's usable cores are shared evenly (at least one each), so N workers
    neither oversubscribe the CPU (torch's default: every process takes every core)
    nor idle it (torchrun's blanket `OMP_NUM_THREADS=1`).

    >>> threads_per_worker(2, cores=16)
    8
    """
    cores = usable_cores() if cores is None else cores
    return max(1, cores // max(1, local_world_size))


def threads_for_spawned(nprocs: int) -> int:
    """Intra-op threads for each of `nprocs` processes that this process starts on its machine.

    The user's `OMP_NUM_THREADS` is kept as given (a count per process). A count that `unison
    launch` chose for this worker (`LAUNCHER_THREADS_ENV` says so) is this worker's share of the
    cores: its `nprocs` processes divide it (`--nproc 1` on 2 cores, 2 spawned: 1 each, not 2).
    Else the machine's cores are shared evenly (`threads_per_worker`).

        threads_for_spawned(2)   # under `unison launch --nproc 1` on 16 cores
    """
    raw = os.environ.get("OMP_NUM_THREADS", "")
    if not (raw.isdigit() and int(raw) > 0):
        return threads_per_worker(nprocs)
    if os.environ.get(LAUNCHER_THREADS_ENV) == raw:  # the launcher's share for this worker
        return max(1, int(raw) // max(1, nprocs))
    return int(raw)


#: torch's switch for backing CPU buffers of 2 MB and more with transparent huge pages.


def huge_pages_env() -> dict[str, str]:
    """What a launcher exports so its workers' large CPU tensors use transparent huge pages.

    torch reads `THP_MEM_ALLOC_ENABLE` once, at its first allocation, so only a launcher can set
    it. With the kernel's THP mode `madvise` (common), each 2 MB buffer then costs one page fault
    instead of 512: sharded training on CPU frees and re-gathers every block's weights each step,
    and ran 1.56x faster with less peak memory (benchmarks/RESULTS.md). Empty when the user set
    the variable (their choice) or off Linux.

    >>> huge_pages_env() in ({}, {"THP_MEM_ALLOC_ENABLE": "1"})
    True
    """
    if HUGE_PAGES_ENV in os.environ or not sys.platform.startswith("linux"):
        return {}
    return {HUGE_PAGES_ENV: "1"}
