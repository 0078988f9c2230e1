"""Naming the rank that stopped taking part, instead of hanging or blaming a bystander.

When one rank stalls (stuck in user code, stopped, dead without its socket closing),
the others fail in their next collective after the group's timeout with an error
that does not say who is missing. The `Watchdog` makes that failure useful:

- each rank publishes its progress (epoch, batch, time) to the job's rendezvous store
  from a background thread, so the training loop pays only a tuple assignment a batch;
- a failed collective is diagnosed from those heartbeats: the rank whose progress lags
  the others (or whose heartbeat went silent) is named;
- the same thread dumps this rank's Python stacks (`faulthandler`) to its stderr (its
  log) when its progress has not moved for a whole timeout, so the user sees *where*
  it is stuck. (Re-arming `faulthandler.dump_traceback_later` every batch would cost
  ~50 us a batch; this costs nothing on the training path.)
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
import weakref
from datetime import timedelta

import torch.distributed as dist

from unison.distributed.deadline import within
from unison.distributed.env import DistribEnv
from unison.distributed.group import created_by_unison, group_generation, group_key_prefix
from unison.env_names import HEARTBEAT_ENV  # ("HOST:PORT" of the store `unison launch` hosts)

#: Seconds a diagnosis may spend reading heartbeats: a store that does not answer is itself a finding.
READ_LIMIT_S = 5.0

# Watchdogs still beating: stopped before the interpreter shuts down, so no heartbeat is
# caught inside a store call while C++ objects are torn down (an abort at exit otherwise).
_live: weakref.WeakSet[Watchdog] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for dog in list(_live):
        dog.stop()


#: Words of torch's own messages for a collective that failed because a peer did not take part
#: (gloo's and NCCL's transport errors and timeouts; c10d's store raises a `DistError`).
_PEER_FAILURE_WORDS = (
    "gloo",
    "NCCL",
    "Application timeout",
    "Connection closed",
    "Connection reset",
    "Broken pipe",
)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed because of another rank, not this rank's own
    error (DDP's unused-parameter check, a file it could not read): only the former is a stall."""
    return isinstance(exc, dist.DistError) or any(word in str(exc) for word in _PEER_FAILURE_WORDS)


class RankStalledError(RuntimeError):
    """A collective failed because another rank stopped taking part; the message names it."""

    def __init__(self, message: str, rank: int | None):
        super().__init__(message)
        self.rank = rank


class Watchdog:
    """Heartbeats and stack dumps for one rank of a job.

    For example:

        dog = Watchdog(timeout=60.0); dog.start()
        dog.progress(epoch, 0, batch, 0)  # a few times a batch: a tuple assignment
        dog.diagnose()                   # after a collective failed: who stopped?
    """

    def __init__(self, timeout: float, interval: float = 1.0, exit_on_stall: bool = False):
        self.timeout, self.interval = timeout, interval
        # NCCL: a timed-out collective never raises in Python (torch's NCCL watchdog aborts the
        # process), so this thread names the missing rank itself and ends the process first.
        self.exit_on_stall = exit_on_stall
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # (epoch, phase: 0 train / 1 valid, batch, stage: 0 started / 1 in backward / 2 stepped /
        # 3 an own loop's body for the batch ended)
        self._progress: tuple[int, int, int, int] = (0, 0, -1, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = self._connect()
        # Scoped to this group: a later group (or an elastic restart) on the same store starts clean.
        # The launcher's store (one machine, one agent) outlives the attempts, whose restart count it
        # agrees on; across machines the count is not agreed (group_key_prefix), but the store is new.
        hosted = bool(os.environ.get(HEARTBEAT_ENV))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if hosted else "-"
        job = os.environ.get("TORCHELASTIC_RUN_ID", "")  # a job nested in another shares no keys with it
        self._prefix = f"unison/heartbeat/{job}/{attempt}/{group_key_prefix(group_generation())}/"

    @staticmethod
    def _connect() -> dist.Store | None:
        """A store every rank can reach: the launcher's heartbeat store under `unison launch` on one
        machine (it lives outside every worker, so a frozen rank cannot take it down), else a
        client of our own when unison made the group (a store is known to listen at
        MASTER_ADDR:MASTER_PORT), else the live group's own store."""
        try:
            hosted = os.environ.get(HEARTBEAT_ENV, "")
            if hosted:
                host, _, port = hosted.rpartition(":")
            elif created_by_unison():
                env = DistribEnv.from_environ()
                host, port = str(env.master_addr), str(env.master_port)
            else:  # a group the user made (tcp://, file://, env://): torch keeps its store
                return dist.distributed_c10d._get_default_store()
            return dist.TCPStore(
                host, int(port), is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False
            )
        except Exception:  # a diagnostic aid must never break training
            return None

    def start(self) -> None:
        # The thread also watches for a stall when there is no store to publish to.
        self._thread = threading.Thread(target=self._beat, name="unison-heartbeat", daemon=True)
        _live.add(self)
        self._thread.start()

    def progress(self, epoch: int, phase: int, batch: int, stage: int) -> None:
        """Record where this rank is: a tuple assignment, the heartbeat thread does the rest."""
        self._progress = (epoch, phase, batch, stage)

    def stop(self) -> None:
        _live.discard(self)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval)
        beating = self._thread is not None and self._thread.is_alive()
        # A rank that leaves early is told apart from a stuck one by a last "left" beat. Not when
        # the heartbeat thread is still caught in a store call (the store's host is frozen or cut
        # off), and never unbounded: a store client call has no deadline of its own.
        if not beating:
            with contextlib.suppress(TimeoutError):
                within(READ_LIMIT_S, lambda: self._publish("left"))
        # Let go of the store: held here it would outlive the group and be torn down only
        # while the interpreter exits, where a store client's destructor can abort the process.
        self._store = None

    def _beat(self) -> None:
        last, since, dumped = self._progress, time.monotonic(), False
        while not self._stop.is_set():
            if not dist.is_initialized():
                self._store = None  # the group is gone (destroyed without detaching): so is the job
                return
            now = time.monotonic()
            if self._progress != last:
                last, since, dumped = self._progress, now, False
            elif not dumped and now - since > self.timeout:
                # Stuck for a whole timeout: show where, in this rank's own log.
                self._dump_stacks(now - since)
                dumped = True
                if self.exit_on_stall:
                    self._exit_if_another_stalled()
            self._publish("running")
            self._stop.wait(self.interval)

    def _publish(self, state: str) -> None:
        """This rank's heartbeat: where it is, and whether it is still `running` or has `left`."""
        if self._store is None:
            return
        beat = json.dumps({"t": time.time(), "at": list(self._progress), "pid": os.getpid(), "state": state})
        try:
            self._store.set(f"{self._prefix}{self.rank}", beat)
        except Exception:
            self._store = None  # the store is gone: the job is ending

    def _lag(self) -> str:
        """A stored position is the rank's last heartbeat: a rank that died may have gone further."""
        return (
            f" (as last reported: heartbeats come every {self.interval:g} s, fast batches run ahead of them)"
        )

    def _exit_if_another_stalled(self) -> None:
        """Name the rank that stopped and end this process (exit code 1), before NCCL's watchdog
        aborts it without a word; the stalled rank itself waits to be stopped by the launcher."""
        found = self.diagnose()
        if found is None or found.rank == self.rank:
            return
        with contextlib.suppress(Exception):
            print(f"[unison] rank {self.rank}: RankStalledError: {found}", file=sys.__stderr__, flush=True)
        os._exit(1)

    def _dump_stacks(self, stuck_s: float) -> None:
        try:
            where = _where(self._progress)
            print(
                f"[unison] rank {self.rank} made no progress for {stuck_s:.0f} s at {where}; Python stacks:",
                file=sys.__stderr__,
                flush=True,
            )
            if sys.__stderr__ is not None:
                faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        except (ValueError, AttributeError, OSError):  # no real stderr (embedded): nothing to show
            pass

    def _read_beats(self, store: dist.Store) -> dict[int, dict]:
        """Everyone's last heartbeat, read within `READ_LIMIT_S` (a store client call has no bound
        of its own against a server that accepts but never answers: a frozen host)."""
        beats: dict[int, dict] = {}

        def read() -> None:
            for rank in range(self.world_size):
                if store.check([f"{self._prefix}{rank}"]):
                    beats[rank] = json.loads(store.get(f"{self._prefix}{rank}"))

        within(READ_LIMIT_S, read)
        return beats

    def peers_gone(self) -> list[int] | None:
        """The other ranks that have left the job or gone silent (dead or frozen): a stop in
        progress is then a failure, not a preemption every rank takes part in. A store that does
        not answer counts as every other rank gone (its host is the job); None: no store to ask.

            dog.peers_gone()   # every rank beating
        """
        if self._store is None:
            return None
        try:
            beats = self._read_beats(self._store)
        except Exception:
            return [r for r in range(self.world_size) if r != self.rank]
        now = time.time()
        return [
            r
            for r in range(self.world_size)
            if r != self.rank
            and r in beats
            and (beats[r].get("state") == "left" or self._silent(beats[r], now))
        ]

    def _silent(self, beat: dict, now: float) -> bool:
        """Whether a heartbeat is too old for a rank still running (a few missed intervals)."""
        return now - beat["t"] > 3 * self.interval + 2

    def diagnose(self) -> RankStalledError | None:
        """The rank that stopped taking part, from everyone's heartbeats (None if it cannot tell)."""
        if self._store is None:
            return None
        now = time.time()
        try:
            beats = self._read_beats(self._store)
        except TimeoutError:
            if os.environ.get(HEARTBEAT_ENV) or self.rank == 0:
                return None
            # The store lives in rank 0's process (no launcher hosts one): its silence names rank 0.
            return RankStalledError(
                "rank 0 stopped taking part: the store it hosts did not answer within "
                f"{READ_LIMIT_S:.0f} s (process frozen or its machine unreachable)",
                0,
            )
        except Exception:
            return None
        never = [r for r in range(self.world_size) if r not in beats]
        if never:
            return RankStalledError(
                f"rank {never[0]} never reported progress: it did not start training "
                "or died before its first batch",
                never[0],
            )
        # A rank that left publishes no more beats: its silence is no stall. (Another rank that
        # failed on the same stall leaves too, at the others' position: the lagging one is named.)
        left = {r for r, b in beats.items() if b.get("state") == "left" and r != self.rank}
        silent = [r for r, b in beats.items() if r not in left and self._silent(b, now)]
        if silent:
            r = silent[0]
            return RankStalledError(
                f"rank {r} stopped taking part: no heartbeat for {now - beats[r]['t']:.0f} s "
                f"({_silent_because()}), last reported at {_where(beats[r]['at'])}{self._lag()}",
                r,
            )
        positions = {r: tuple(b["at"]) for r, b in beats.items()}
        positions[self.rank] = tuple(self._progress)  # live: its stored beat may be a second old
        lagging = min(positions, key=lambda r: (positions[r], r not in left))
        ahead = max(positions.values())
        if lagging in left or (left and positions[lagging] == ahead):
            r = lagging if lagging in left else min(left)
            return RankStalledError(
                f"rank {r} left the training early at {_where(positions[r])} (its script returned or "
                "exited, or left distrib_ctx) while the others went on",
                r,
            )
        if positions[lagging] < ahead:
            return RankStalledError(
                f"rank {lagging} stopped taking part: stuck at {_where(positions[lagging])} while others "
                f"reached {_where(ahead)}, or its process ended there{self._lag()} (if stuck, its Python "
                f"stacks go to its stderr after {self.timeout:.0f} s without progress)",
                lagging,
            )
        return None


def _silent_because() -> str:
    """Why a rank's heartbeat stops: on several machines, a network cut does it too."""
    several = os.environ.get("WORLD_SIZE", "1") != os.environ.get(
        "LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")
    )
    return "process dead or frozen, or its machine unreachable" if several else "process dead or frozen"


def _where(at: list[int] | tuple[int, ...]) -> str:
    epoch, phase, batch, stage = at
    return (
        f"epoch {epoch} {'training' if phase == 0 else 'validation'} batch {batch} "
        f"({('before backward', 'in backward', 'after step', 'its loop body done')[stage]})"
    )
