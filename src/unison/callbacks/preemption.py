"""`Preemption`: a scheduler's signal stops every rank at one step boundary, checkpointed, "resume me".

Schedulers warn before they stop a job: Kubernetes and SLURM (at the end of the time limit) send
SIGTERM, and `sbatch --signal=USR1@90` sends SIGUSR1 ninety seconds ahead. The `Learner` adds this
callback (`Learner(on_preempt="stop" | "requeue" | None)`). While `fit` runs:

1. the signal's handler only sets a flag (a handler the script had is still called after it);
2. at optimizer steps' ends (after `Checkpoint` had its turn) and at each epoch's end, every
   rank learns whether any rank got the signal: on W > 1 processes one all-reduce of two numbers
   about every `CHECK_EVERY_S` (0.5 s) of training, at every step when steps are longer (the
   ranks compute the same next step to check from the reduced step time); on one process, at
   every step, without a collective. A signal may reach one rank only, or ranks at different
   steps: all stop at the same boundary, the first checked one after any rank saw it;
3. then the `Checkpoint` callback, if the fit has one, writes the checkpoint at once whatever its
   `every` (atomically, as always; not twice when it had just written this step's), or one line
   says that nothing was saved;
4. with `"requeue"` (or `UNISON_REQUEUE=1`) under SLURM, rank 0 runs `scontrol requeue <job>`
   once the checkpoint is written (`unison.distributed.slurm.requeue`);
5. every rank raises `Preempted`, a `SystemExit` with status 75 (`PREEMPTED_EXIT`, sysexits'
   EX_TEMPFAIL: "try again"). `unison launch` passes it on as the job's status and never restarts
   into it; the job resubmitted with `fit(..., resume=True)` ends on the uninterrupted weights (the
   message names the resume as the loop is written: `resume_as`, e.g. `run.epochs(n, resume=True)`).

torch's agent stops the survivors of a failed rank with SIGTERM too. A rank that completes no batch
for `STALL_S` after the signal (or 3x its slowest batch), has not agreed to stop, is not writing a
checkpoint, and sees another rank gone (left the job, or its heartbeat silent: the strategy's
`peers_gone`) is stuck in a failing job: the signal is sent to it again and left to its default
action, so it ends at once. While every rank is there, a slow rank is waited for (the job is being
stopped whole; the launcher's grace bounds the wait): a long step, a compile or a slow disk after
the signal must not cost the preemption checkpoint.

Which signals: `Preemption(signals=...)`, else `UNISON_PREEMPT_SIGNALS`, else the launcher's
`TORCHELASTIC_SIGNALS_TO_HANDLE` (torchrun's and `unison launch`'s `--signals-to-handle`, which
its workers inherit) without SIGINT (Ctrl-C stays an interrupt), else SIGTERM and SIGUSR1. The
handlers are the process's only while `fit` runs (`handling`), in the main thread.

    learn = Learner(dls, model, loss_func, cbs=[Checkpoint(every=500)])   # on_preempt="stop"
    with learn.distrib_ctx():
        learn.fit(10, resume=True)    # SIGTERM: checkpoint now, exit 75; resubmitted: goes on
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal

import torch

from unison.env_names import REQUEUE_ENV
from unison.events import Callback
from unison.signals import PREEMPTED_EXIT, parse_signals, preempt_signals

if TYPE_CHECKING:
    from unison.checkpoint.callback import Checkpoint

OnPreempt = Literal["stop", "requeue"]
#: On several processes the ranks agree about this often (seconds of training), and at every step
#: when steps are longer: one tiny all-reduce every step cost a small model 10% (docs/faults.md).
CHECK_EVERY_S = 0.5
MAX_STEPS_BETWEEN = 1000
#: After a signal, a rank that completes no batch for this long (or 3x its slowest batch, if
#: longer) while another rank is gone is stuck: it ends as the signal's default action would.
#: torch's agent stops the survivors of a failed rank with SIGTERM too, and a hung one must not
#: hold the job for the launcher's whole shutdown grace.
STALL_S = 3.0
#: Seconds between two looks at the other ranks' heartbeats while a signalled rank is quiet.
PEERS_EVERY_S = 0.5

__all__ = ["PREEMPTED_EXIT", "Preempted", "Preemption", "handling"]


#: How a resubmitted job resumes, as the `Learner` says it (`Run`: `run.epochs(n, resume=True)`).
RESUME_AS = "fit(..., resume=True)"


class Preempted(SystemExit):
    """Every rank stopped on a preemption signal: the process exits with `PREEMPTED_EXIT` (75).

    A `SystemExit`, so a script's `except Exception` does not swallow it and nothing after `fit`
    runs as if training had finished. `saved` is the checkpoint written (None when none was).

    >>> str(Preempted("SIGTERM", epoch=1, step=4, saved=None)).split(";")[0]
    'preempted by SIGTERM: every rank stopped in epoch 1, after step 4'
    """

    def __init__(
        self,
        signame: str,
        epoch: int,
        step: int | None,
        saved: str | None,
        requeued: str = "",
        resume_as: str = RESUME_AS,
    ):
        self.signame, self.epoch, self.step, self.saved, self.requeued = signame, epoch, step, saved, requeued
        self.resume_as = resume_as
        super().__init__(PREEMPTED_EXIT)

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.signame, self.epoch, self.step, self.saved, self.requeued, self.resume_as)
        return (type(self), args)

    def __str__(self) -> str:
        where = (
            f"at the end of epoch {self.epoch}"
            if self.step is None
            else f"in epoch {self.epoch}, after step {self.step}"
        )
        if self.saved is None:
            what = "no Checkpoint callback, so nothing was saved"
        else:
            what = f"checkpoint written to {self.saved}: resubmit with {self.resume_as}"
        tail = f"; {self.requeued}" if self.requeued else ""
        return f"preempted by {self.signame}: every rank stopped {where}; {what}{tail}"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


class Preemption(Callback):
    """Stop every rank at one step boundary on a preemption signal, checkpointed; see the module.

    `signals`: names or numbers (default: from the environment, see `preempt_signals`);
    `requeue`: under SLURM, rank 0 requeues the job once the checkpoint is written (default:
    `UNISON_REQUEUE=1`). `received` is the signal this process got, if any.

        learn = Learner(dls, model, loss_func, on_preempt=None, cbs=[Preemption("SIGUSR2", requeue=True)])
    """

    # after Checkpoint (90): its save of this step, if any, is done when the ranks agree to stop
    order = 95

    def __init__(
        self,
        signals: str | Sequence[str | int | signal.Signals] | None = None,
        requeue: bool | None = None,
    ):
        self.signals = preempt_signals() if signals is None else parse_signals(signals)
        #: The call that resumes, named in the message as the user wrote the loop.
        self.resume_as = RESUME_AS
        self.requeue = _truthy(os.environ.get(REQUEUE_ENV)) if requeue is None else bool(requeue)
        self.received: signal.Signals | None = None
        self._saves_before = 0
        self._ckpt: Checkpoint | None = None
        self._steps = self._next_check = self._since = 0
        self._checked_at = 0.0
        self.progress_at = self.slowest = 0.0  # when the last batch ended; the longest between two
        self.decided = False  # the ranks agreed to stop: no stall escalation from here on

    def before_fit(self) -> None:
        from unison.checkpoint.callback import Checkpoint

        self._ckpt = self.learn.get_cb(Checkpoint)
        self._steps, self._next_check = 0, 1  # optimizer steps of this fit; the first is checked
        self._checked_at, self._since = time.perf_counter(), 0

    def writing_checkpoint(self) -> bool:
        """Whether this rank is writing a checkpoint now (a save that outlasts the stall limit is
        not a hang: a collective inside it is bounded by the group's timeout)."""
        return self._ckpt is not None and self._ckpt.writing

    def stall_limit(self) -> float:
        """Seconds without a batch after which a signalled rank counts as stuck (`STALL_S`), when
        another rank is gone."""
        return max(STALL_S, 3 * self.slowest)

    def peers_gone(self) -> list[int] | None:
        """The other ranks that left the job or went silent (None: no strategy can tell, as on one
        process): the strategy's heartbeats."""
        strategy = getattr(self.learn, "strategy", None)
        return None if strategy is None else strategy.peers_gone()

    def before_batch(self) -> None:
        if self.learn.training and self._ckpt is not None:
            self._saves_before = self._ckpt.saves

    def after_batch(self) -> None:
        learn = self.learn
        now = time.monotonic()  # progress, training or validation: a signalled rank is not stuck
        if self.progress_at:
            self.slowest = max(self.slowest, now - self.progress_at)
        self.progress_at = now
        if not (learn.training and learn.grad_sync):  # only where a real optimizer step has ended
            return
        self._steps += 1
        if self._steps < self._next_check:
            return
        saved_now = self._ckpt is not None and self._ckpt.saves != self._saves_before  # its `every` fell here
        self._stop_if_agreed((learn.epoch, learn.iter + 1), learn.iter + 1, saved_now)

    def after_epoch(self) -> None:
        # Checkpoint.after_epoch (order 90) has just written the epoch's end, if the fit has one.
        learn = self.learn
        self._stop_if_agreed((learn.epoch + 1, 0), None, saved_now=True)

    # ---- the decision and what follows it -----------------------------------------------------
    def agreed(self) -> bool:
        """Whether any rank got a preemption signal: the same answer on every rank.

        On W > 1 processes one all-reduce carries the flag and each rank's mean step time since
        the last check, from which every rank computes the same next step to check: about every
        `CHECK_EVERY_S` of training, and every step when steps are longer. One process reads its
        flag at every step."""
        collective = self.learn.collective
        flag = 0.0 if self.received is None else 1.0
        if collective.world_size == 1:
            return flag > 0
        now, steps = time.perf_counter(), max(1, self._steps - self._since)
        mine = torch.tensor([flag, (now - self._checked_at) / steps], dtype=torch.float64)
        total = collective.sum(mine)
        step_s = float(total[1]) / collective.world_size
        self._checked_at, self._since = now, self._steps
        self._next_check = self._steps + max(
            1, min(MAX_STEPS_BETWEEN, int(CHECK_EVERY_S / max(step_s, 1e-9)))
        )
        return bool(total[0] > 0)

    def _stop_if_agreed(self, position: tuple[int, int], step: int | None, saved_now: bool) -> None:
        """`position`: (epoch, batches done) a checkpoint written now records; `step`: the steps of
        this epoch done (None at its end), for the message."""
        if not self.agreed():
            return
        self.decided = True
        learn = self.learn
        collective = learn.collective
        names = collective.gather_objects(self.received.name if self.received is not None else None)
        signame = next((n for n in names if n), "a preemption signal")
        ckpt = self._ckpt
        saved: str | None = None
        if ckpt is not None:
            if not saved_now:
                ckpt.save(*position)
            from unison.checkpoint.sharded import sharded_path  # (DCP loads only where it is used)

            saved = str(sharded_path(ckpt.file) if learn.checkpoint_format == "dcp" else ckpt.file)
        requeued = ""
        if self.requeue and collective.is_main:
            from unison.distributed.slurm import requeue

            requeued = requeue(os.environ)
        # No rank leaves before rank 0 has written and requeued: a launcher stops the others when one ends.
        collective.barrier()
        stop = Preempted(signame, learn.epoch, step, saved, requeued, self.resume_as)
        _record_for_launcher(stop)
        if collective.is_main:
            print(f"unison: {stop}", file=sys.stderr, flush=True)
        raise stop


def _record_for_launcher(stop: Preempted) -> None:
    """Under torch's agent, write the rank's error file (torch's own handler, as `@record` does), so
    `unison launch` tells a preempted rank from a failed one, and never restarts into it."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    with contextlib.suppress(OSError):
        get_error_handler().record_exception(stop)


@contextlib.contextmanager
def handling(learn: Any) -> Iterator[None]:
    """While the block runs, the learner's `Preemption` callback (if any) handles its signals; the
    previous handlers come back after it. Outside the main thread nothing is installed (Python
    allows handlers there only), and one line says so.

    >>> with handling(learn):            # what Learner.fit does
    ...     learn._do_fit()              # doctest: +SKIP
    """
    from unison.callbacks.schedule import LRFinder

    cb = learn.get_cb(Preemption)
    # lr_find's sweep is undone when it ends: no checkpoint may hold it, so a signal acts as usual.
    if cb is None or not cb.signals or learn.get_cb(LRFinder) is not None:
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        if learn.collective.is_main:
            note = "unison: fit runs outside the main thread: preemption signals are not handled"
            print(note, file=sys.stderr)
        yield
        return
    cb.received, cb.decided, cb.progress_at = None, False, time.monotonic()
    previous: dict[signal.Signals, Any] = {}
    escalate = threading.Event()
    done = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if escalate.is_set():  # stuck since the signal: end as its default action would
            signal.signal(sig, previous.get(sig) or signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if cb.received is None:  # the first signal: noted (the one the message names), its stall watched
            cb.received = sig
            threading.Thread(target=_watch_stall, args=(cb, sig, escalate, done), daemon=True).start()
        chained = previous.get(sig)
        if callable(chained) and chained is not signal.default_int_handler:
            chained(signum, frame)  # the script's own handler, after the flag is set

    for sig in cb.signals:
        previous[sig] = signal.signal(sig, on_signal)
    try:
        yield
    finally:
        done.set()
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _watch_stall(
    cb: Preemption, sig: signal.Signals, escalate: threading.Event, done: threading.Event
) -> None:
    """After a signal: if this rank completes no batch within `cb.stall_limit()`, the ranks have
    not agreed to stop, and another rank is gone, send the signal again, which the handler then
    leaves to its default action (a hung rank, which torch's agent stops with SIGTERM when another
    rank failed, ends at once). While every rank is there it is slow, not stuck: it is waited for."""
    quiet_since = next_look = time.monotonic()
    while not done.wait(0.1):
        if cb.decided:
            return
        now = time.monotonic()
        if cb.writing_checkpoint():  # a long write is progress: the stall clock starts at its end
            quiet_since = now
            continue
        if now - max(quiet_since, cb.progress_at) > cb.stall_limit() and now >= next_look:
            next_look = now + PEERS_EVERY_S
            if not cb.peers_gone():  # every rank there (or none to ask): a stop in progress
                continue
            escalate.set()
            # to the main thread: its blocking call (a sleep, a wait) is interrupted and the handler runs
            signal.pthread_kill(threading.main_thread().ident or 0, sig)
            return
