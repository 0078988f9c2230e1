"""Per-step fault tolerance on torchft: `distrib_ctx(fault_tolerant=True)`.

Each replica is one process (a replica group of one) that trains the *global* plan: global step
`k` is the same fixed set of items on every replica (the loader's batch `k`, as on one process).
At each step torchft's `Manager` asks the lighthouse which replicas take part (the quorum); the
`P` participants split step `k`'s rows (participant `p` takes rows `p, p+P, ...`), each
backpropagates the sum of its rows' losses divided by the step's global row count, and one
all-reduce (a sum over torchft's reconfigurable gloo group) gives every participant the gradient
of the whole global batch, whatever `P` is. So a replica lost mid-step costs that step's redo, not
its items: the survivors see the all-reduce fail (`should_commit` is False), ask for a new quorum
and redo step `k` over the same items. A replacement started later joins a quorum, receives from
a live peer its weights, optimizer state and data position (epoch, step, data seed) through
torchft's state-dict transport (no disk read), and trains from that step on. The run ends on the
weights of an uninterrupted one-process run with the loader's batch, up to float noise (another
summation order).

Costs (measured in benchmarks/RESULTS.md): every replica loads the whole global batch and keeps
1/P of it; every step pays a quorum round-trip to the lighthouse and a commit vote.

Not built (refused in one line): replica groups of more than one process, gradient accumulation,
losses counted by anything but rows (a `SummedLoss`/token loss).

>>> with learn.distrib_ctx(fault_tolerant=True):   # TORCHFT_LIGHTHOUSE=http://host:29510  # doctest: +SKIP
...     learn.fit(3)
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from unison.callbacks.core import Callback
from unison.data.batch import batch_size_of, map_tensors

#: torchft's own variable for the lighthouse's address (`http://host:port`).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
#: This replica's name: a replacement takes the name of the replica it replaces.
REPLICA_ENV = "UNISON_REPLICA_ID"


class ReplicaBehindError(RuntimeError):
    """This replica was healed to another step than the one it is at: it must restart to rejoin."""


def start_lighthouse(
    min_replicas: int = 1,
    port: int = 0,
    join_timeout_ms: int = 2000,
    quorum_tick_ms: int = 100,
    heartbeat_timeout_ms: int = 5000,
) -> Any:
    """Start torchft's lighthouse in this process (the `torchft_lighthouse` binary does the same);
    its `address()` is what replicas need in `TORCHFT_LIGHTHOUSE`. Call `shutdown()` when done.

    >>> lighthouse = start_lighthouse(min_replicas=2)                     # doctest: +SKIP
    >>> os.environ["TORCHFT_LIGHTHOUSE"] = lighthouse.address()           # doctest: +SKIP
    """
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


def lighthouse_main(argv: Sequence[str]) -> int:
    """`unison lighthouse`: start torchft's lighthouse, print `TORCHFT_LIGHTHOUSE=<address>` for the
    replicas, and serve until SIGTERM or Ctrl-C. Returns the exit status.

    >>> lighthouse_main(["--min-replicas", "2", "--port", "29510"])   # doctest: +SKIP
    """
    parser = argparse.ArgumentParser(prog="unison lighthouse", description=lighthouse_main.__doc__)
    parser.add_argument("--min-replicas", type=int, default=2, help="no quorum with fewer (default 2)")
    parser.add_argument("--port", type=int, default=29510, help="0: any free port (default 29510)")
    parser.add_argument("--join-timeout-ms", type=int, default=2000, help="wait for late replicas")
    parser.add_argument("--quorum-tick-ms", type=int, default=100)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    args = parser.parse_args(list(argv))
    if args.min_replicas < 1:
        print(
            f"unison lighthouse: --min-replicas must be at least 1, got {args.min_replicas}", file=sys.stderr
        )
        return 2
    if not 0 <= args.port < 65536:
        print(f"unison lighthouse: --port must be 0-65535, got {args.port}", file=sys.stderr)
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
    signal.sigwait(stop)
    server.shutdown()
    return 0


def _rows(x: Any, part: int, parts: int) -> Any:
    """Rows `part, part + parts, ...` of a (nested) batch; scalars and non-tensors kept."""
    return map_tensors(lambda t: t[part::parts] if t.dim() else t, x)


class FaultTolerantTrainer(Callback):
    """Train on torchft replicas that survive a lost peer; `distrib_ctx(fault_tolerant=True)` attaches it.

    `lighthouse`: the lighthouse's address (default `TORCHFT_LIGHTHOUSE`); `replica_id`: this
    replica's name (default `UNISON_REPLICA_ID`, else the host and process id); `min_replicas`:
    fewer participants than this and no step commits; `timeout`: seconds any all-reduce, commit
    vote or state transfer may take before the step is given up and redone.

    >>> with learn.distrib_ctx(fault_tolerant={"min_replicas": 2}):       # doctest: +SKIP
    ...     learn.fit(3)
    """

    # First: the step's share is cut before any other callback sees the batch, and the gradient is
    # reduced before anything (non-finite check, clipping, unscaling) reads it.
    order = -30

    def __init__(
        self,
        lighthouse: str | None = None,
        replica_id: str | None = None,
        min_replicas: int = 1,
        timeout: float = 30.0,
        quorum_timeout: float = 60.0,
    ) -> None:
        self.lighthouse = lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        self.replica_id = replica_id or os.environ.get(REPLICA_ENV) or f"{socket.gethostname()}-{os.getpid()}"
        self.min_replicas, self.timeout, self.quorum_timeout = min_replicas, timeout, quorum_timeout
        self.manager: Any = None
        self._store: Any = None
        self._quorum_ready = False  # a quorum was made for the step about to run (before_fit's)
        self._position = (0, 0)  # (epoch, step) this replica is at: what a healing peer receives
        self._healed_to: tuple[int, int] | None = None
        self._full: tuple[Any, Any] | None = None  # the whole global batch of the step in flight
        #: What happened, for logs and tests: steps redone, and the position this replica healed at.
        self.events: dict[str, Any] = {"redone": 0, "healed_at": None, "participants": []}

    # ---- entering and leaving --------------------------------------------------------
    def setup(self) -> None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            raise ValueError(
                f"distrib_ctx(fault_tolerant=True) runs replica groups of one process each, but this "
                f"launch has {world} processes: start each replica as its own one-process job "
                "(unison launch --nproc 1, or plain python), all pointing at one lighthouse"
            )
        norms = [name for name, m in self.learn.raw_model.named_modules() if isinstance(m, _BatchNorm)]
        if norms:
            raise ValueError(
                f"distrib_ctx(fault_tolerant=True): the model's BatchNorm ({norms[0]}) would normalise over "
                "each replica's share of a step, not exact; use GroupNorm/LayerNorm, or distrib_ctx() "
                "(exact BatchNorm, restarts on a fault)"
            )
        if not self.lighthouse:
            raise ValueError(
                "distrib_ctx(fault_tolerant=True) needs a torchft lighthouse: set TORCHFT_LIGHTHOUSE="
                "http://host:port (start one with `unison lighthouse --min-replicas 2`)"
            )
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        host = socket.gethostname()
        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        limit = timedelta(seconds=self.timeout)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=limit),
            load_state_dict=self._load_state,
            state_dict=self._state,
            min_replica_size=self.min_replicas,
            use_async_quorum=False,  # heal before the forward pass: the step runs on the peer's weights
            timeout=limit,
            quorum_timeout=timedelta(seconds=self.quorum_timeout),
            connect_timeout=limit,
            rank=0,
            world_size=1,
            store_addr=host,
            store_port=self._store.port,
            lighthouse_addr=self.lighthouse,
            replica_id=self.replica_id,
        )

    def restore(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        self._store = None

    # ---- what a healing peer receives -----------------------------------------------
    def _state(self) -> dict[str, Any]:
        learn = self.learn
        assert learn.opt is not None
        epoch, step = self._position
        return {
            "model": learn.raw_model.state_dict(),
            "opt": learn.opt.state_dict(),
            "epoch": epoch,
            "step": step,
            "data_seed": learn.data_seed,
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        learn = self.learn
        assert learn.opt is not None
        learn.raw_model.load_state_dict(state["model"])
        learn.opt.load_state_dict(state["opt"])
        if state["data_seed"] != learn.data_seed:
            learn.data_seed = state["data_seed"]
        self._healed_to = (int(state["epoch"]), int(state["step"]))

    # ---- the loop ---------------------------------------------------------------------
    def before_fit(self) -> None:
        learn = self.learn
        from unison.callbacks.training import GradientAccumulation

        if any(isinstance(cb, GradientAccumulation) for cb in learn.cbs):
            raise ValueError(
                "distrib_ctx(fault_tolerant=True) does not support GradientAccumulation yet: "
                "give the loader the whole global batch instead"
            )
        # The first quorum: a replacement heals here and starts at its peers' step.
        self._position = (learn.start_epoch, learn.start_iter)
        self._quorum()
        if self._healed_to is not None:
            epoch, step = self._healed_to
            self._say(f"healed from a live peer: joins at epoch {epoch} step {step}")
            learn.start_epoch, learn.start_iter = self._healed_to
            self.events["healed_at"] = self._healed_to
            self._position = self._healed_to
            self._healed_to = None
        self._quorum_ready = True

    def _say(self, message: str) -> None:
        """One line in this replica's log (torchft's own logs name the lighthouse's view)."""
        print(f"unison: replica {self.replica_id}: {message}", file=sys.stderr, flush=True)

    def _quorum(self) -> None:
        """This step's quorum (and a heal, if this replica is behind). A failure inside it (a peer
        lost while reconfiguring) is recorded by torchft: the step's commit then fails and it is redone."""
        try:
            self.manager.start_quorum(timeout=timedelta(seconds=self.quorum_timeout))
        except TimeoutError as exc:
            raise TimeoutError(
                f"replica {self.replica_id}: no quorum within {self.quorum_timeout:.0f} s from the "
                f"lighthouse at {self.lighthouse}: are at least its --min-replicas replicas running?"
            ) from exc

    def before_batch(self) -> None:
        learn = self.learn
        if not learn.training:
            return
        self._position = (learn.epoch, learn.iter)
        if not self._quorum_ready:
            self._quorum()
            self._check_not_moved()
        self._quorum_ready = False
        self._full = (learn.xb, learn.yb)
        self._take_share()

    def _check_not_moved(self) -> None:
        """A heal mid-fit must land on this very step (torchft heals a replica that fell behind)."""
        healed, self._healed_to = self._healed_to, None
        if healed is not None and healed != self._position:
            raise ReplicaBehindError(
                f"replica {self.replica_id} is at epoch {self._position[0]} step {self._position[1]} "
                f"but its peers are at epoch {healed[0]} step {healed[1]}: restart it and it heals "
                "from them at its first quorum"
            )

    def _take_share(self) -> None:
        learn = self.learn
        assert self._full is not None
        part, parts = self.manager.participating_rank(), self.manager.num_participants()
        self.events["participants"].append(parts)
        xb, yb = self._full
        if part is None or parts < 1:  # a spare (not used here): torchft zeroes what it all-reduces
            part, parts = 0, 1
        learn.xb, learn.yb = _rows(xb, part, parts), _rows(yb, part, parts)
        learn._empty_share = batch_size_of(learn.xb) == 0

    def after_loss(self) -> None:
        if self.learn.training and self.learn.exact_loss.count_is_rows is False:
            raise ValueError(
                "distrib_ctx(fault_tolerant=True) splits each step by rows: a loss counted over tokens "
                "(SummedLoss, TokenCrossEntropy) is not supported yet; use a mean loss over samples"
            )

    def after_backward(self) -> None:
        if not self.learn.training:
            return
        while not self._reduce_and_commit():
            self._redo()

    def _reduce_and_commit(self) -> bool:
        """Sum every participant's gradient (one flat all-reduce); True when the step may be taken."""
        from torch.distributed import ReduceOp

        params = [p for p in self.learn.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).clone()
            offset += n
        return bool(self.manager.should_commit())

    def _redo(self) -> None:
        """The step failed somewhere (a lost peer): new quorum, same items, recomputed share."""
        learn = self.learn
        assert learn.opt is not None
        self.events["redone"] += 1
        learn.opt.zero_grad(set_to_none=True)
        was = self.events["participants"][-1]
        self._quorum()
        self._check_not_moved()
        self._take_share()
        epoch, step = self._position
        now = self.events["participants"][-1]
        self._say(
            f"epoch {epoch} step {step} failed with {was} replicas; redone with {now} over the same items"
        )
        learn.pred = learn.call_model(learn.model, learn.xb)
        total, count, mean = learn.exact_loss.terms(learn)
        learn.loss_count = count
        if mean is None:
            mean = total / count if count > 0 else total * 0
        learn.loss = mean.detach()
        learn.loss_grad = learn.exact_loss.to_backward(learn, total, count, mean)
        learn.loss_grad.backward()
        learn.exact_loss.normalise_grads(learn)
