"""Per-step fault tolerance on torchft: `distrib_ctx(fault_tolerant=True)`.

A replica group is one `unison launch --nproc G` job (G = 1: plain python too) that trains the
*global* plan: global step `k` is the same fixed set of items in every group (the loader's batch
`k`, as on one process). torchft's `Manager` (one per rank, group rank 0 serving the group's) asks
the lighthouse which groups take part at the first step, after a failed step, and then every
`quorum_interval` seconds (the replicas agree when, see below); with `P` participants, rank `r` of participant
`p` takes rows `p*G + r :: P*G` of step `k`, backpropagates their summed loss over the step's global
row count, and the gradient is summed inside the group (its own gloo group), then across the
participants (torchft's reconfigurable gloo group, per group rank): every rank ends with the
gradient of the whole global batch, whatever `P` is. A group lost mid-step (any of its processes:
its peers' collectives fail, and it stops) costs that step's redo, not its items: the others'
commit vote fails, they take a new quorum and redo step `k` over the same items, saying which
replica left. A restarted or new group heals each rank from the same rank of a live group (weights,
optimizer state, data position; no disk read) and trains on. The run ends on the weights of an
uninterrupted one-process run, up to float noise (another summation order).

A loss counted over tokens (or anything but rows) is exact too: the shares' summed gradients and
counts are summed together (`unison.distributed.ft_reduce`). The engine drives it in both loops:
`step_share` before each training step, `commit` after its backward and `retake_step` after a
failed vote (`unison.engine.take_share`, `commit_step`); the own loop (`Run(fault_tolerant=True)`)
redoes a step by running its body again.

Why not a quorum every step (torchft's own loop): a quorum is a barrier of all replicas at the
lighthouse, a few round trips that take about as long as a small model's whole step (one every
step: 1.24x DDP's step, one every 0.5 s: 0.96x, benchmarks/RESULTS.md). Between
quorums the membership can only change by a failure, and a failure fails that step's all-reduce
(a lost peer's sockets close, a stalled one times out): the commit vote fails, and the step is
redone under a new quorum, as before. A replica that starts joins at the next quorum (at most
`quorum_interval` later; keep it well under the lighthouse's join timeout, 2 s by default, or a
newcomer may form a quorum of its own). Each replica says in the gradient all-reduce whether its
interval is up, so every participant reads the same sum and takes the next quorum at the same step.

Each process loads only its rows of a step from a map-style loader (`unison.distributed.ft_rows`;
a stream or a custom collate_fn: the whole batch, said in one line). Costs (benchmarks/RESULTS.md):
each step pays a commit vote (inside the group), every `quorum_interval` a quorum round-trip.
Refused in one line: BatchNorm, `shard=True`, gradient accumulation.

    with learn.distrib_ctx(fault_tolerant=True):   # TORCHFT_LIGHTHOUSE=http://host:29510
        learn.fit(3)
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from unison.data.batch import batch_size_of
from unison.distributed.collective import Collective
from unison.distributed.env import group_active
from unison.distributed.ft_logs import quiet_torchft, start_line
from unison.distributed.ft_quorum import QuorumWitness, membership_change
from unison.distributed.ft_reduce import ReplicaGroupLostError, StepVector, group_sum
from unison.distributed.ft_rows import RowLoads, Share, Split, rows_of
from unison.distributed.group import leave_group, setup_distrib
from unison.distributed.lighthouse import start_lighthouse
from unison.env_names import LIGHTHOUSE_ENV, REPLICA_ENV
from unison.events import Callback
from unison.loop_state import StartPoint, TrainingParts

__all__ = ["LIGHTHOUSE_ENV", "REPLICA_ENV", "FaultTolerantTrainer", "QuorumWitness", "ReplicaBehindError"]
__all__ += ["ReplicaGroupLostError", "start_lighthouse"]


class ReplicaBehindError(RuntimeError):
    """This replica was healed to another step than the one it is at: it must restart to rejoin."""


class FaultTolerantTrainer(Callback):
    """Train on torchft replicas that survive a lost peer; `distrib_ctx(fault_tolerant=True)` attaches it.

    `lighthouse`: the lighthouse's address (default `TORCHFT_LIGHTHOUSE`); `replica_id`: this
    replica's name (default `UNISON_REPLICA_ID`, else the host and process id); `min_replicas`:
    fewer participants than this and no step commits; `start_replicas`: the first step waits
    (up to `quorum_timeout`) until this many replicas take part; `quorum_interval`: seconds between
    quorums while nothing fails (0: one every step, torchft's way); `timeout`: seconds any all-reduce, commit
    vote or state transfer may take before the step is given up and redone; `verbose`: torchft's
    INFO lines and tracebacks too (default `UNISON_FT_VERBOSE`; see `distributed.ft_logs`);
    `fetch_rows`: load only this process's rows of each step (None: where exact, see `ft_rows`;
    True: also through a custom collate_fn, which you vouch collates row by row; False: never).

        with learn.distrib_ctx(fault_tolerant={"min_replicas": 2}):
            learn.fit(3)
    """

    # First: the step's share is cut before any other callback sees the batch, and the gradient is
    # reduced before anything (non-finite check, clipping, unscaling) reads it.
    order = -30
    kind = "torchft"
    checkpoint_format = "file"  # whole replicas: rank 0 writes one file

    def __init__(
        self,
        lighthouse: str | None = None,
        replica_id: str | None = None,
        min_replicas: int = 1,
        timeout: float = 30.0,
        quorum_timeout: float = 60.0,
        start_replicas: int = 1,
        quorum_interval: float = 0.5,
        verbose: bool | None = None,
        fetch_rows: bool | None = None,
        advertised_host: Callable[[str | None], str] | None = None,
    ) -> None:
        self.lighthouse = lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        self.replica_id = replica_id or os.environ.get(REPLICA_ENV) or f"{socket.gethostname()}-{os.getpid()}"
        self.min_replicas, self.timeout, self.quorum_timeout = min_replicas, timeout, quorum_timeout
        self.start_replicas = start_replicas
        if not quorum_interval >= 0:
            raise ValueError(
                "distrib_ctx(fault_tolerant=...): quorum_interval must be 0 or more seconds, "
                f"not {quorum_interval!r}"
            )
        self.quorum_interval = float(quorum_interval)
        self._last_quorum = 0.0  # time.monotonic() of this replica's latest quorum
        self._quorum_due = True  # the participants agreed (last all-reduce) that the next step takes one
        self.verbose = verbose  # torchft's INFO lines and tracebacks (default: UNISON_FT_VERBOSE)
        self.fetch_rows = fetch_rows
        self._loads: RowLoads | None = None  # this training pass's loader cuts each step to our rows
        self._split: Split = (0, 1)  # the rows this process takes of a step, as of the latest quorum
        self._said_whole = False  # the line saying each step is loaded whole was said
        # How this replica names its host to the others (the engine gives the launcher's helpers).
        self._advertised_host = advertised_host or (lambda lighthouse: socket.gethostname())
        self.active = False
        self.manager: Any = None
        self._store: Any = None
        self._witness = QuorumWitness(None)
        self.created_group = False
        self._members: list[str] = []  # the replicas of the last quorum this replica saw
        self.group_rank, self.group_size = 0, 1  # this process's place in its replica group
        self._quorum_ready = False  # a quorum was made for the step about to run (before_fit's)
        self._position = (0, 0)  # (epoch, step) this replica is at: what a healing peer receives
        self._healed_to: tuple[int, int] | None = None
        self._healed_seed: int | None = None
        self._full: tuple[Any, Any] | None = None  # the whole global batch of the step in flight
        self._carried: dict[str, Any] = {}  # what a heal carries besides model and optimizer (`carry`)
        #: What happened, for logs and tests: steps redone, and the position this replica healed at.
        self.events: dict[str, Any] = {"redone": 0, "healed_at": None, "participants": [], "quorums": 0}

    # ---- entering and leaving --------------------------------------------------------
    def setup(self, parts: TrainingParts) -> TrainingParts:
        # Named as the user wrote it: the own loop's `Run(...)` or the Learner's `distrib_ctx(...)`.
        api, plain = f"{self.learn.parallel_api}(fault_tolerant=True)", f"{self.learn.parallel_api}()"
        norms = [name for name, m in self.learn.raw_model.named_modules() if isinstance(m, _BatchNorm)]
        if norms:
            raise ValueError(
                f"{api}: the model's BatchNorm ({norms[0]}) would normalise over each replica's share "
                f"of a step, not exact; use GroupNorm/LayerNorm, or {plain} (exact BatchNorm, restarts "
                "on a fault)"
            )
        if not self.lighthouse:
            raise ValueError(
                f"{api} needs a torchft lighthouse: set TORCHFT_LIGHTHOUSE="
                "http://host:port (start one with `unison lighthouse --min-replicas 2`, or "
                "`unison launch --start-lighthouse`)"
            )
        self._before = parts
        try:
            seed = self._join(parts.data_seed)
        except BaseException:
            self.restore()  # a refused setup leaves no group, store or manager behind
            self.leave()
            raise
        # Each rank computes all; group rank 0 speaks.
        return replace(parts, collective=Collective(speaks=self.group_rank == 0), data_seed=seed)

    def _join(self, data_seed: int) -> int:
        """The replica group's own gloo group (under `unison launch --nproc G`), one store that group
        rank 0 hosts, and a torchft `Manager` on every rank (group rank, G), all under one replica id.
        Returns group rank 0's `data_seed` (one order for the replica group)."""
        from torch.distributed import TCPStore

        quiet_torchft(self.verbose)  # before torchft's Rust logger starts
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing import HTTPTransport

        self.created_group = setup_distrib(timeout=self.timeout, backend="gloo")
        if group_active():
            self.group_rank, self.group_size = dist.get_rank(), dist.get_world_size()
        host = self._advertised_host(self.lighthouse)  # the host name on one machine
        if self.group_rank == 0:
            self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        # Group rank 0's store, name and data seed for every rank of the group (one replica id, one order).
        shared: list[Any] = [host, self._store.port if self._store else 0, self.replica_id, data_seed]
        if self.group_size > 1:
            dist.broadcast_object_list(shared, src=0)
        host, port, self.replica_id, seed = shared
        limit = timedelta(seconds=self.timeout)
        transport: Any = HTTPTransport(timeout=limit, num_chunks=0)
        if host != socket.gethostname():  # torchft 0.2.0 names its checkpoint server by host name only
            served = transport._server.socket.getsockname()[1]
            transport.address = lambda: f"http://{host}:{served}/checkpoint/"
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=limit),
            load_state_dict=self._load_state,
            state_dict=self._state,
            min_replica_size=self.min_replicas,
            use_async_quorum=False,  # heal before the forward pass: the step runs on the peer's weights
            timeout=limit,
            quorum_timeout=timedelta(seconds=self.quorum_timeout),
            connect_timeout=limit,
            rank=self.group_rank,
            world_size=self.group_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=self.lighthouse,
            replica_id=self.replica_id,
            hostname=host,
            checkpoint_transport=transport,
        )
        self._witness = QuorumWitness(self.manager._client)
        self.manager._client = self._witness  # (torchft keeps each quorum's members to itself)
        self.active = True
        return int(seed)

    def diagnose(self) -> None:  # a lost replica is survived (its step redone), not a stalled rank
        return None

    def peers_gone(self) -> None:  # replicas come and go: a lost one says nothing about this one
        return None

    def leave(self) -> None:
        """Leave the process group where `setup` made it (`unison.distributed.group.leave_group`)."""
        self.created_group = leave_group(self.created_group)

    def restore(self) -> TrainingParts:
        self.active = False
        self.after_train()
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        self._store = None
        return replace(self._before, opt=self.learn.opt, data_seed=self.learn.data_seed)

    # ---- what a healing peer receives -----------------------------------------------
    def carry(self, components: dict[str, Any]) -> None:
        """Heal `components` too (name -> object with `state_dict` / `load_state_dict`: a scheduler)."""
        self._carried = components

    def _state(self) -> dict[str, Any]:
        learn, (epoch, step) = self.learn, self._position
        assert learn.opt is not None
        model, opt = learn.raw_model.state_dict(), learn.opt.state_dict()
        carried = {name: obj.state_dict() for name, obj in self._carried.items()}
        return dict(model=model, opt=opt, carried=carried, epoch=epoch, step=step, data_seed=learn.data_seed)

    def _load_state(self, state: dict[str, Any]) -> None:
        learn = self.learn
        assert learn.opt is not None
        learn.raw_model.load_state_dict(state["model"])
        learn.opt.load_state_dict(state["opt"])
        for name, obj in self._carried.items():  # (every replica runs the script: the same names)
            obj.load_state_dict(state["carried"][name])
        self._healed_to = (int(state["epoch"]), int(state["step"]))
        self._healed_seed = int(state["data_seed"])  # (a peer's: the same order for every replica)

    # ---- the loop ---------------------------------------------------------------------
    def start_point(self, point: StartPoint) -> StartPoint:
        """The first quorum: a replacement heals here and starts at its peers' step, in their data order."""
        # (GradientAccumulation says so by this attribute: this package does not import the callbacks.)
        if any(getattr(cb, "accumulates_gradients", False) for cb in self.learn.cbs):
            raise ValueError(
                "distrib_ctx(fault_tolerant=True) does not support GradientAccumulation yet: "
                "give the loader the whole global batch instead"
            )
        self._position = (point.epoch, point.step)
        self._quorum()
        self._wait_for_start_replicas()
        healed, witness = self._healed_to, self._witness
        self._say(start_line(self._position, healed, witness.replica_ids, witness.healed_from))
        if healed is not None:
            point = replace(point, epoch=healed[0], step=healed[1], data_seed=self._healed_seed)
            self.events["healed_at"] = healed
            self._position = healed
            self._healed_to = None
        self._quorum_ready = True
        self._members = self._witness.starts
        return point

    def _wait_for_start_replicas(self) -> None:
        """The first step waits until `start_replicas` replicas take part (replicas started together
        then all begin at step 0, instead of the first one training alone and the others healing)."""
        deadline = time.monotonic() + self.quorum_timeout
        while self.manager.num_participants() < self.start_replicas:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"replica {self.replica_id}: {self.manager.num_participants()} of the "
                    f"{self.start_replicas} replicas to start with took part within "
                    f"{self.quorum_timeout:.0f} s (lighthouse {self.lighthouse}): are they all started?"
                )
            time.sleep(0.2)
            self._quorum()

    def _say(self, message: str) -> None:
        """One line in this replica group's log, from its rank 0 (torchft logs the lighthouse's view)."""
        if self.group_rank == 0:
            print(f"unison: replica {self.replica_id}: {message}", file=sys.stderr, flush=True)

    def _quorum(self) -> None:
        """This step's quorum (and a heal, if this replica is behind). A failure inside it (a peer
        lost while reconfiguring) is recorded by torchft: the step's commit then fails and it is redone."""
        self._quorum_due = False
        self._last_quorum = time.monotonic()
        self.events["quorums"] += 1
        try:
            self.manager.start_quorum(timeout=timedelta(seconds=self.quorum_timeout))
        except TimeoutError as exc:
            raise TimeoutError(
                f"replica {self.replica_id}: no quorum within {self.quorum_timeout:.0f} s from the "
                f"lighthouse at {self.lighthouse}: are at least its --min-replicas replicas running?"
            ) from exc

    def before_train(self) -> None:
        # The loader, planned for this pass, cuts each step to this process's rows before loading it.
        self._split = self._split_now()
        self._loads, problem = RowLoads.attach(self.learn.dl, self.fetch_rows, split=lambda: self._split)
        if problem and not self._said_whole:
            self._say(f"each step's whole batch is loaded to keep this replica's rows: {problem}")
            self._said_whole = True

    def after_train(self) -> None:
        if self._loads is not None:
            self._loads.detach()
            self._loads = None

    def step_share(self, epoch: int, step: int, xb: Any, yb: Any) -> Share:
        """Training step `step` of `epoch` is about to run on the global batch `(xb, yb)` (or this
        process's rows of it, where the loader cut them): its quorum, when one is due, and this
        process's rows of the step among the replicas taking part."""
        self._position = (epoch, step)
        if not self._quorum_ready and self._quorum_due:
            self._quorum()
            self._check_not_moved()
            self._say_membership()
        self._quorum_ready = False
        cut = self._loads is not None and self._loads.took(step, xb, yb)
        self._full = None if cut else (xb, yb)  # (cut: `_loads` has this process's rows)
        return self._take_share()

    def _say_membership(self, redo: bool = False) -> str:
        """Say which replicas joined the quorum since the last one (and which left, between steps);
        return which left ("" if none), for a redo's line."""
        was, now = self._members, self._witness.starts
        self._members = now
        joined, lost = membership_change(was, now)
        if joined and was:
            self._say(f"replica(s) {', '.join(joined)} joined the quorum ({len(now)} replicas now)")
        if lost and not redo:
            self._say(f"{lost} between steps ({len(now)} replicas now)")
        return lost

    def _check_not_moved(self) -> None:
        """A heal mid-fit must land on this very step (torchft heals a replica that fell behind)."""
        healed, self._healed_to = self._healed_to, None
        if healed is not None and healed != self._position:
            raise ReplicaBehindError(
                f"replica {self.replica_id} is at epoch {self._position[0]} step {self._position[1]} "
                f"but its peers are at epoch {healed[0]} step {healed[1]}: restart it and it heals "
                "from them at its first quorum"
            )

    def _split_now(self) -> Split:
        part, parts = self.manager.participating_rank(), self.manager.num_participants()
        if part is None or parts < 1:  # a spare (not used here): torchft zeroes what it all-reduces
            part, parts = 0, 1
        # Rank r of participant p takes rows p*G + r :: P*G: the P groups' G ranks deal the step out.
        return part * self.group_size + self.group_rank, parts * self.group_size

    def _take_share(self) -> Share:
        self.events["participants"].append(self.manager.num_participants())
        self._split = first, stride = self._split_now()
        if self._full is None:  # this process's rows were loaded alone (or are loaded now)
            assert self._loads is not None
            return self._loads.share(self.learn, self._split)
        xb, yb = self._full
        xb, yb = rows_of(xb, first, stride), rows_of(yb, first, stride)
        return xb, yb, batch_size_of(xb) == 0

    def commit(self) -> tuple[bool, Tensor | None, float]:
        """After the step's backward: sum its gradient over the replica group (its own gloo group),
        then over the participants (torchft's all-reduce, per group rank), and vote on it.
        `(committed, the global batch's loss, its count)` (None when no loss rode along)."""
        from torch.distributed import ReduceOp

        step = StepVector.pack(self.learn)  # the gradients, the share's loss and count riding along
        # And whether this replica's quorum interval is up (1 or 0): every participant reads the same sum.
        up = float(time.monotonic() - self._last_quorum >= self.quorum_interval)
        vector = torch.cat([step.flat, step.flat.new_full((1,), up)])
        if self.group_size > 1:
            group_sum(vector, self.replica_id)
        self.manager.allreduce(vector, reduce_op=ReduceOp.SUM).wait()
        step.flat, self._quorum_due = vector[:-1], bool(vector[-1] > 0)
        loss, count = step.unpack()  # the global batch's gradient and loss
        return bool(self.manager.should_commit()), loss, count

    def retake_step(self) -> Share:
        """The step failed somewhere (a lost peer): a new quorum, the same items, and this process's
        new share of them (the gradient zeroed)."""
        opt = self.learn.opt
        assert opt is not None
        self.events["redone"] += 1
        opt.zero_grad(set_to_none=True)
        was = self.events["participants"][-1]
        self._quorum()
        self._check_not_moved()
        lost = self._say_membership(redo=True) or "the same replicas take part (a collective failed)"
        share = self._take_share()
        epoch, step = self._position
        now = self.events["participants"][-1]
        self.events.setdefault("lost", []).append(lost)
        failed = f"epoch {epoch} step {step} failed with {was} replicas"
        self._say(f"{failed}; redone with {now} over the same items; {lost}")
        return share
