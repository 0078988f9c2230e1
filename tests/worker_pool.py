"""A pool of real worker processes for multi-rank tests.

Each pool starts `world_size` processes once (forkserver, torch preloaded) and,
when `init_group=True`, joins them in one gloo process group on loopback, so many
checks share the cost of forming a group. `pool.run(fn, *args)` calls `fn(*args)`
on every rank and returns the per-rank results; an exception on any rank is
re-raised here with that rank's traceback; every wait is bounded, and a pool that
times out is killed so that a bug fails the test instead of hanging CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

GROUP_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def _worker_main(rank: int, world_size: int, port: int, init_group: bool, tasks, results) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if init_group:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
        )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, env = task
        os.environ.update(env)
        try:
            results.put((rank, True, fn(*args)))
        except BaseException as exc:  # report everything, the test decides
            results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    if init_group and dist.is_initialized():
        from unison.distributed.group import destroy_group

        destroy_group()  # gloo's destructor can deadlock without the settle pause it takes


class RankFailed(AssertionError):
    """A function raised on at least one rank."""


class WorkerPool:
    """`world_size` live processes that run test functions together.

    >>> with WorkerPool(2) as pool:
    ...     ranks = pool.run(get_rank)     # [0, 1]
    """

    def __init__(self, world_size: int, init_group: bool = True, timeout: float = 90.0):
        ctx = _context()
        self.world_size = world_size
        self.timeout = timeout
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(r, world_size, port, init_group, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call `fn(*args)` on every rank (after exporting `env`); return results by rank."""
        for q in self._tasks:
            q.put((fn, args, dict(env or {})))
        results: dict[int, Any] = {}
        failures: list[str] = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=timeout or self.timeout)
            except queue.Empty:
                self.kill()
                raise TimeoutError(
                    f"{fn.__name__} did not finish on ranks "
                    f"{sorted(set(range(self.world_size)) - set(results))} within {timeout or self.timeout}s"
                ) from None
            results[rank] = value
            if not ok:
                failures.append(f"rank {rank}: {value}")
        if failures:
            raise RankFailed("\n".join(failures))
        return [results[r] for r in range(self.world_size)]

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)

    def close(self) -> None:
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
        self.kill()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
