"""The engine under both training loops: the parallel strategy a host trains with, and the steps
of one batch. The `Learner` (fit's named events) and the own-loop `Run` are its two clients;
each is a host (`unison.learner_view.LearnerView`): the state the engine, the strategies and the
callbacks read and set. Neither loop re-implements what is here.

- Strategies: `attach_strategy(host, config)` builds the strategy `ParallelConfig` chooses (DDP,
  FSDP2, torchft), makes it one of the host's callbacks (it takes part in the loop's events) and
  sets it up; `detach_strategy` undoes it; `name_stalled_rank` turns a failed collective into
  the error naming the rank that stopped. `to_parallel` is single-process `DataParallel`.
- One batch: `prepare_batch` (to the device, inputs and targets, padding trimmed), `score`
  (the loss as a sum and a count, what to backpropagate), `backward` (then the gradient of the
  global batch) and `optimizer_step` (the scaler's when there is one).

    attach_strategy(learn, ParallelConfig(shard=True))   # learn.to_distributed(shard=True)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from unison.data.batch import batch_size_of, take_rows, to_device
from unison.data.ranked import is_rank_sharded
from unison.data.stream import loader_length
from unison.distributed.joining import check_loaders_agree, trainable_set
from unison.distributed.strategy import ParallelConfig, Strategy, VotedSteps, make_strategy
from unison.distributed.watchdog import is_peer_failure
from unison.loop_state import BatchState, StartPoint, TrainingParts

if TYPE_CHECKING:
    from unison.learner_view import EngineHost

__all__ = [
    "ParallelConfig",
    "at_batch",
    "attach_strategy",
    "backward",
    "begin_pass",
    "check_loader_agrees",
    "commit_step",
    "detach_parallel",
    "detach_strategy",
    "follow_trainable",
    "name_stalled_rank",
    "optimizer_step",
    "prepare_batch",
    "score",
    "shard_loader",
    "start_at",
    "start_fit",
    "take_share",
    "to_parallel",
    "training_parts",
    "unwrap_model",
    "use_parts",
]


# ---- the strategy ------------------------------------------------------------------------------
def _advertised_host(lighthouse: str | None) -> str:
    """How a torchft replica names its host to the others (its address on the route to the lighthouse)."""
    # Imported here: only a fault-tolerant run needs the launcher's network helpers.
    from unison.distributed.network import advertised_host

    return advertised_host(lighthouse)


def training_parts(host: EngineHost) -> TrainingParts:
    """What `host` trains with now: model, optimizer, collective and data seed."""
    return TrainingParts(host.model, host.opt, host.collective, host.data_seed)


def use_parts(host: EngineHost, parts: TrainingParts) -> None:
    """Make `host` train with `parts` (what a strategy's `setup` or `restore` returned)."""
    host.model, host.opt, host.data_seed = parts.model, parts.opt, parts.data_seed
    host.set_collective(parts.collective)


def attach_strategy(host: EngineHost, config: ParallelConfig) -> Strategy:
    """Join (or make) the process group and train with the strategy `config` chooses: it becomes one
    of the host's callbacks and `host.strategy`, and the host trains with the parts its `setup`
    returns. A refused setup leaves the host as it was."""
    strategy = make_strategy(config, advertised_host=_advertised_host)
    host.add_cb(strategy)
    try:
        parts = strategy.setup(training_parts(host))
    except BaseException:
        host.remove_cb(strategy)
        raise
    use_parts(host, parts)
    host.strategy = strategy
    return strategy


def detach_strategy(host: EngineHost) -> None:
    """Model, BatchNorm, loaders and logging as they were before `attach_strategy`."""
    for strategy in [c for c in host.cbs if isinstance(c, Strategy)]:
        use_parts(host, strategy.restore())  # the host's reference to the wrapper goes first,
        strategy.leave()  # then the group (DDP's teardown hang, pytorch/pytorch#56297)
        host.remove_cb(strategy)
    host.strategy = None


def name_stalled_rank(host: EngineHost, exc: BaseException) -> None:
    """A collective that failed because another rank stopped: raise the error naming that rank.
    (Only a RuntimeError can be one: this rank's own ValueError or TypeError is its own cause.)"""
    strategy = host.strategy
    if not isinstance(exc, RuntimeError) or not is_peer_failure(exc) or strategy is None:
        return
    stalled = strategy.diagnose()
    if stalled is not None:
        raise stalled from exc


def to_parallel(host: EngineHost, device_ids: Sequence[int] | None = None) -> None:
    """Single-process `DataParallel` over `device_ids` (all GPUs by default)."""
    # Imported here: a plain script never loads torch's parallel wrappers.
    from unison.distributed.trainer import ParallelTrainer

    trainer = ParallelTrainer(device_ids)
    host.add_cb(trainer)
    use_parts(host, trainer.setup(training_parts(host)))


def detach_parallel(host: EngineHost) -> None:
    from unison.distributed.trainer import ParallelTrainer  # (as in to_parallel)

    for cb in [c for c in host.cbs if isinstance(c, ParallelTrainer)]:
        use_parts(host, cb.restore())
        host.remove_cb(cb)


# ---- where a fit starts ------------------------------------------------------------------------
def start_at(host: EngineHost, point: StartPoint) -> None:
    """Make the host's next pass over its training loader start at `point`, with what it carries
    (the data order's seed, a stateful stream's state, the grad scaler's state)."""
    host.start_epoch, host.start_iter = point.epoch, point.step
    host.stream_resume_state = point.stream_state
    if point.data_seed is not None:
        host.data_seed = point.data_seed
    if point.scaler_state is not None:
        if host.scaler is None:
            host.scaler = torch.amp.GradScaler("cuda")
        host.scaler.load_state_dict(point.scaler_state)


def start_fit(host: EngineHost, n_epoch: int, resumed: StartPoint | None = None) -> None:
    """Where a fit of `n_epoch` epochs starts, before its first event: epoch 0 step 0, or `resumed`
    (what the newest checkpoint held, `unison.checkpoint.learner_files.resume`); then, under
    torchft, the step this replica's peers are at once it healed from them (its first quorum)."""
    host.n_epoch = n_epoch
    point = resumed if resumed is not None else StartPoint()
    if host.strategy is not None:
        point = host.strategy.start_point(point)
    start_at(host, point)


# ---- one batch ---------------------------------------------------------------------------------
def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside `DataParallel` / `DistributedDataParallel` / `torch.compile` wrappers,
    so its `state_dict` keys never carry a wrapper's prefix (`module.`, `_orig_mod.`).

    >>> unwrap_model(nn.parallel.DataParallel(nn.Linear(2, 2))).__class__.__name__
    'Linear'
    """
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(
            getattr(model, "_orig_mod", None), nn.Module
        ):
            model = cast(nn.Module, model._orig_mod)
        else:
            return model


def shard_loader(
    host: EngineHost, dl: Any, pad: bool, steps_per_epoch: int | None = None, split: str = "exact"
) -> Any:
    """This rank's share of `dl` this epoch (`unison.data.sharding`), in the host's data order;
    `pad=False` in training (exactly the set's items, none twice), True in evaluation."""
    shards, c = host._shards, host.collective
    return shards.get(dl, pad, c, host.epoch, host.data_seed, steps_per_epoch, split)


def follow_trainable(host: EngineHost) -> None:
    """A model frozen or unfrozen since its strategy wrapped it (fine-tuning) is wrapped again: DDP
    synchronises the gradients of the parameters that required one when it wrapped them, and no
    others, so a layer unfrozen later would train on each rank's own gradient. A strategy that
    cannot wrap again (FSDP2), or a `Run`, whose loop calls the wrapper `run.setup` returned, refuses
    the change in one line."""
    strategy = host.strategy
    built = getattr(strategy, "trainable", None)
    if built is None or trainable_set(host.raw_model) == built:
        return
    rewrap = getattr(strategy, "rewrap", None)
    api = host.parallel_api
    if rewrap is None or api == "Run":  # (a Run's loop holds the model run.setup returned)
        where, fix = (f"inside {api}", "before entering it")
        if api == "Run":
            where, fix = "after run.setup", "before it"
        raise ValueError(
            f"the parameters that require a gradient changed since {strategy.kind} wrapped the model "
            f"(a layer frozen or unfrozen {where}): set requires_grad {fix}"
        )
    use_parts(host, rewrap(training_parts(host)))


def begin_pass(
    host: EngineHost, dl: Any, training: bool, steps_per_epoch: int | None = None, split: str = "exact"
) -> int:
    """Start a pass over `dl`: `host.dl` becomes this rank's share of it (training: exactly the set's
    items; evaluation: padded, the padding trimmed later), `host.n_iter` its length (0: a stream of
    unknown length), and a training pass resumed mid-epoch starts at the checkpoint's step, which
    is returned (the batches before it are skipped without being loaded)."""
    host.dl = shard_loader(host, dl, pad=not training, steps_per_epoch=steps_per_epoch, split=split)
    host.training = training
    host.n_iter = loader_length(host.dl) or 0
    if not training:
        return 0
    follow_trainable(host)
    host.exact_loss.start_epoch(getattr(host.dl, "batch_size", None))
    start = host.start_iter if host.epoch == host.start_epoch else 0
    host.start_iter = 0
    if start and is_rank_sharded(host.dl):
        host.dl.set_start(start)
        host.dl.load_state_dict(host.stream_resume_state)  # a stateful stream continues itself
    return start


def check_loader_agrees(host: EngineHost, dl: Any, name: str, check_data: bool = True) -> None:
    """Across the ranks of a job, `dl` must be shardable and hold the same items, and its sampler
    must draw the same order on every rank (one seeded by torch does; one drawing from Python's
    `random` or NumPy does not, and would deal some items twice and others never): else a one-line
    error naming the fix. Nothing on one process."""
    collective = host.collective
    if collective.world_size == 1:
        return
    check_loaders_agree(host, collective, check_data, loaders=((name, dl),))
    sharded = shard_loader(host, dl, pad=False)
    order = getattr(sharded, "global_order", None)
    if order is None:
        return  # a stream: its per-step fingerprints are compared as it is read
    digest = hashlib.blake2b(repr(order(0)).encode(), digest_size=8).hexdigest()
    digests = collective.gather_objects(digest)
    if len(set(digests)) > 1:
        others = [r for r, d in enumerate(digests) if d != digests[0]]
        raise ValueError(
            f"the {name} loader's sampler draws another order on rank(s) {others} than on rank 0: it uses "
            "a random generator unison cannot seed (Python's random, NumPy); give it a torch.Generator "
            "(or shuffle=True) so that every rank deals the same global order"
        )


def real_rows(host: EngineHost, index: int) -> int | None:
    """How many leading rows of the current loader's batch `index` are real items (None: all)."""
    return host.dl.real_rows(index) if is_rank_sharded(host.dl) else None


def at_batch(host: EngineHost, index: int) -> None:
    """The loop is at batch `index` of its pass; in training, also where it is in the whole fit."""
    host.iter = index
    if host.training:
        host.train_iter = host.epoch * host.n_iter + index
        host.pct_train = host.train_iter / max(1, host.n_epoch * host.n_iter)


def prepare_batch(host: EngineHost, batch: Any, index: int, device: torch.device) -> None:
    """`batch` on the host's device, split into `host.xb` / `host.yb` as the loop splits it
    (`host.split_batch`: the Learner's inputs and targets, the own loop's batch whole), with the rows
    a rank-sharded loader added to even out ranks dropped from the *inputs*: whatever computes the
    loss (the model itself included), padding is never scored. `host._empty_share`: no real rows here."""
    xb, yb = host.split_batch(to_device(batch, device, non_blocking=True))
    real = real_rows(host, index)
    padded = xb
    if real is not None and real < batch_size_of(xb):
        xb, yb = take_rows(xb, real), take_rows(yb, real)
    host.batch = BatchState(xb, yb, padded, real == 0)  # (a skipped batch reports no loss of the last one)


def score(host: EngineHost, total: Tensor, count: float, mean: Tensor | None) -> None:
    """Set the batch's loss (`host.loss`, its mean), count and, in training, what to backpropagate
    (`host.loss_grad`: the sum over a constant, so the step's gradient can be made exact)."""
    host.loss_count = count
    if mean is None:
        mean = total / count if count > 0 else total * 0
    host.loss = mean.detach()
    host.loss_grad = host.exact_loss.to_backward(host, total, count, mean) if host.training else host.loss


def backward(host: EngineHost) -> None:
    """Backpropagate `host.loss_grad` (scaled under fp16); at the last micro-batch of an optimizer
    step, divide the gradient by the global count of that step's loss terms."""
    assert host.loss_grad is not None
    if host.scaler is not None:
        host.scaler.scale(host.loss_grad).backward()
    else:
        host.loss_grad.backward()
    if host.grad_sync:  # this batch ends an optimizer step: divide by its global count
        host.exact_loss.normalise_grads(host)


def _voting(host: EngineHost) -> VotedSteps | None:
    """The strategy in a training pass, where it votes on each step (torchft). By its `kind`: a
    runtime protocol check costs about 11 us, twice a step, on every loop."""
    strategy = host.strategy
    voting = host.training and getattr(strategy, "kind", None) == "torchft"
    return cast(VotedSteps, strategy) if voting else None


def take_share(host: EngineHost) -> None:
    """Under torchft, before a training batch's events: this step's quorum, when one is due, and
    this process's rows of it among the replicas taking part."""
    strategy = _voting(host)
    if strategy is not None:
        host.xb, host.yb, host._empty_share = strategy.step_share(host.epoch, host.iter, host.xb, host.yb)


def commit_step(host: EngineHost) -> bool:
    """After a training batch's backward, under torchft: the step's gradient summed over the
    replicas, then their vote. True: the step goes on. False: the vote failed, and the step is
    retaken on the same items among the replicas left: `host.xb` / `host.yb` are this process's new
    share and `host.redo_step` is set, and the loop runs the batch's body again from its forward
    pass (the Learner at once; the own loop's loader yields the share to its body)."""
    strategy = _voting(host)
    if strategy is None:
        return True
    committed, loss, count = strategy.commit()
    if loss is not None:
        host.loss, host.loss_count = loss, count
    if committed:
        return True
    xb, yb, empty = strategy.retake_step()
    host.batch = BatchState(xb, yb, host._padded_xb, empty)
    host.redo_step = True  # (no optimizer step for this pass)
    return False


def optimizer_step(host: EngineHost) -> None:
    """Step the optimizer (through the grad scaler, which skips a step whose gradients overflowed)."""
    assert host.opt is not None
    if host.scaler is not None:
        host.scaler.step(host.opt)
        host.scaler.update()
    else:
        host.opt.step()
