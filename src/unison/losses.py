"""Losses that stay exact over any number of processes: a sum and a count, not a mean.

A loss function may return `SummedLoss(total, count)` instead of a mean: the sum of a
per-token (or per-anything) loss over the batch and how many terms it holds. The
learner then divides the gradient by the *global* count, over every rank and every
gradient-accumulation micro-step, so W processes train exactly like one on the whole
global batch, and validation reports `sum / count` over the whole set. A plain mean
loss is read as `SummedLoss(mean * batch_size, batch_size)`.

    loss_func = TokenCrossEntropy(shift=True)   # a causal LM's next-token loss
    Learner(dls, gpt2, loss_func)

With `loss_func=None` the loss is the model's own (`out.loss` or `out["loss"]`); for a
dict batch with Hugging Face `labels` it is made exact the same way, the count read from
what the model computed (`own_loss_count`): never from its class name, so a wrapped,
subclassed, compiled or sharded causal LM is counted as it scored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE_INDEX = -100  # PyTorch's and Hugging Face's "not a target"


class SummedLoss(NamedTuple):
    """A batch's loss as `(total, count)`: what a loss function returns to be exact across ranks.

    >>> def token_loss(logits, labels):
    ...     total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    ...     return SummedLoss(total, (labels != -100).sum())
    """

    total: Tensor
    # A NamedTuple field may shadow tuple's own `count` method, which mypy refuses (python/mypy#4507).
    count: Tensor | int | float  # type: ignore[assignment]


class TokenCrossEntropy:
    """Cross-entropy summed over the tokens whose label is not `ignore_index`, as a `SummedLoss`.

    `shift=True` scores position t against the label at t + 1 (a causal LM's labels are its inputs).

    >>> TokenCrossEntropy()(torch.zeros(1, 3, 5), torch.tensor([[1, 2, -100]])).count
    tensor(2)
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX, shift: bool = False):
        self.ignore_index, self.shift = ignore_index, shift

    def __call__(self, pred: Any, labels: Tensor) -> SummedLoss:
        logits = output_logits(pred)
        if self.shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        total = _token_cross_entropy(logits, labels, self.ignore_index, reduction="sum")
        return SummedLoss(total, (labels != self.ignore_index).sum())


def output_logits(out: Any) -> Any:
    """What a metric scores from a model's output, by one rule: a tensor is itself; a dict or
    `ModelOutput` gives its `logits`; a tuple (`return_dict=False`) gives its second element when
    the first is a 0-dim loss (`(loss, logits, ...)`), else its first. Any other structure is
    refused naming it.

    >>> output_logits((torch.tensor(0.7), torch.zeros(2, 3))).shape
    torch.Size([2, 3])
    """
    if isinstance(out, Tensor):
        return out
    if isinstance(out, Mapping) or hasattr(out, "logits"):
        logits = out.get("logits") if isinstance(out, Mapping) else out.logits
        if logits is not None:
            return logits
    elif isinstance(out, (tuple, list)) and out and all(isinstance(t, Tensor) for t in out[:2]):
        return out[1] if out[0].dim() == 0 and len(out) > 1 else out[0]
    raise ValueError(
        f"cannot tell which part of the model's output ({describe_output(out)}) holds its logits: "
        "return a tensor, a dict or ModelOutput with 'logits', or a tuple (loss, logits, ...)"
    )


def describe_output(out: Any) -> str:
    """`dict with keys ['a', 'b']`, `tuple of 3`, or the class name: a structure named in errors."""
    if isinstance(out, Mapping):
        return f"{type(out).__name__} with keys {sorted(map(str, out))}"
    if isinstance(out, (tuple, list)):
        return f"{type(out).__name__} of {len(out)}"
    return type(out).__name__


def _token_cross_entropy(
    logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX, reduction: str = "mean"
) -> Tensor:
    """Cross-entropy of each token's logits (the last dim) against its label, in float32."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
    )


def _token_means(logits: Any, labels: Tensor) -> dict[str, Tensor]:
    """The token-mean losses a model can have computed from its logits and integer labels: over
    every label ("plain") or each position against the next label ("shifted")."""
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.shape[:-1] != labels.shape:
        return {}
    logits = logits.detach()
    rules = {"plain": _token_cross_entropy(logits, labels)}
    if labels.dim() >= 2 and bool((labels[..., 1:] != IGNORE_INDEX).any()):
        rules["shifted"] = _token_cross_entropy(logits[..., :-1, :], labels[..., 1:])
    return rules


def own_loss_rule(logits: Any, labels: Tensor, loss: Tensor) -> str | None:
    """Which terms a model's own mean loss averaged, read from what it computed: "elements" for
    float labels (regression, multi-label: a mean over every element); otherwise the loss is
    recomputed from the logits and labels as a token mean over every label ("plain") and over the
    labels shifted by one ("shifted", a causal LM), and the one equal to the model's loss is the
    rule, whatever the model's class, wrapper or sharding. None when nothing tells (every label
    ignored, a non-finite loss). A loss matching neither is refused in one line.

    >>> logits, labels = torch.randn(1, 4, 5), torch.tensor([[1, 2, 3, -100]])
    >>> own_loss_rule(logits, labels, F.cross_entropy(logits[0, :-1], labels[0, 1:]))
    'shifted'
    """
    if labels.is_floating_point():
        return "elements"
    value = loss.detach().float()
    if not bool((labels != IGNORE_INDEX).any()) or not bool(torch.isfinite(value)):
        return None
    rules = _token_means(logits, labels)
    if not rules:
        raise ValueError(
            f"cannot make the model's own loss exact: its output has no logits shaped like its labels "
            f"{tuple(labels.shape)} to count the terms it averaged; return logits with the loss, or pass "
            "loss_func=TokenCrossEntropy(shift=...) or a loss_func returning SummedLoss"
        )
    for name, mean in rules.items():
        if torch.allclose(mean, value, rtol=1e-4, atol=1e-6):
            return name
    computed = ", ".join(f"{name} token mean {float(mean):.6g}" for name, mean in rules.items())
    raise ValueError(
        f"cannot make the model's own loss exact: it ({float(value):.6g}) does not match a token mean "
        f"of its logits and labels ({computed}), so the number of terms it averaged is unknown; pass "
        "loss_func=TokenCrossEntropy(shift=...) or a loss_func returning SummedLoss"
    )


def count_by_rule(rule: str | None, labels: Tensor) -> int:
    """The terms `rule` (from `own_loss_rule`) averages over `labels`; None counts the plain labels."""
    if rule == "elements":
        return labels.numel()
    if rule == "shifted":
        labels = labels[..., 1:]
    return int((labels != IGNORE_INDEX).sum())


def own_loss_count(logits: Any, labels: Tensor, loss: Tensor) -> int:
    """How many terms a model's own mean `loss` averaged (see `own_loss_rule`).

    For example:

        own_loss_count(torch.randn(3, 2), torch.tensor([1, 0, -100]), torch.tensor(0.9))
    """
    return count_by_rule(own_loss_rule(logits, labels, loss), labels)


#: Autograd nodes a per-item loss passes through unchanged item for item: shapes, copies, and the
#: sum and scaling `cross_entropy(..., label_smoothing=s)` adds.
_ITEMWISE = {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "SqueezeBackward0",
             "SqueezeBackward1", "UnsqueezeBackward0", "CloneBackward0", "ToCopyBackward0",
             "AddBackward0", "MulBackward0", "MulBackward1", "SelectBackward0"}  # fmt: skip


def _nll_node(loss: Tensor, reduction: int) -> Any:
    """torch's `nll_loss` node (`cross_entropy` ends in one) of `reduction` (0: none, 1: mean) behind
    `loss`, through the item-wise ops of `_ITEMWISE`; None without one (or without a graph: torch
    records none in evaluation)."""
    nodes: list[Any] = [loss.grad_fn]  # (autograd nodes: their saved fields are typed per node class)
    seen = 0
    while nodes and seen < 16:
        node, seen = nodes.pop(), seen + 1
        name = type(node).__name__
        if name == "NllLossBackward0" and node._saved_reduction == reduction:
            return node
        if name in _ITEMWISE:
            nodes += [next_node for next_node, _ in node.next_functions if next_node is not None]
    return None


def _ignored(node: Any) -> tuple[int, int]:
    """`(how many targets, ignore_index)` an `nll_loss` node left out."""
    ignore = int(node._saved_ignore_index)
    ignore = ignore - 2**64 if ignore >= 2**63 else ignore  # (saved as an unsigned int64)
    return int((node._saved_target == ignore).sum()), ignore


def one_step_from(loss: Any, source: Tensor | None) -> bool:
    """Whether `loss` was computed from `source` by one operation (scaled, divided).

    >>> x = torch.ones((), requires_grad=True) * 2
    >>> one_step_from(x / 4, x), one_step_from(x, x)
    (True, False)
    """
    node = getattr(loss, "grad_fn", None)
    if node is None or source is None:
        return False
    return any(step is source.grad_fn for step, _ in node.next_functions)


def uncounted_items(per_item: Tensor) -> tuple[str, str] | None:
    """Why per-item losses (`cross_entropy(..., reduction="none")`) are not one term each, and the
    count to pass instead: targets left out (`ignore_index`: a 0 each) or class weights (each item
    weighs its target's weight). Read from the autograd graph (training only).

    >>> logits = torch.zeros(3, 2, requires_grad=True)
    >>> uncounted_items(F.cross_entropy(logits, torch.tensor([0, -100, 1]), reduction="none"))
    ('leave out 1 ignored target(s) (ignore_index=-100)', '(labels != -100).sum()')
    """
    node = _nll_node(per_item, reduction=0)
    if node is None:
        return None
    ignored, index = _ignored(node)
    scored = f"labels[labels != {index}]" if ignored else "labels"
    if node._saved_weight is not None:
        return "are weighted by their targets' class weights", f"weight[{scored}].sum()"
    if ignored:
        return f"leave out {ignored} ignored target(s) (ignore_index={index})", f"(labels != {index}).sum()"
    return None


def sums_over_rows(func: Any, out: Tensor) -> bool:
    """Whether a loss function sums its batch's terms instead of averaging them: a torch loss module
    with `reduction="sum"` (or the one fastai's losses wrap), else a torch loss node that sums
    (`F.mse_loss(..., reduction="sum")`) at the root of the autograd graph, through the additions
    and scalings of a compound loss (a VAE's reconstruction sum plus its KL term).

    >>> pred = torch.zeros(2, requires_grad=True)
    >>> sums_over_rows(None, 2 * F.mse_loss(pred, torch.ones(2), reduction="sum"))
    True
    >>> sums_over_rows(None, pred.mean()), sums_over_rows(nn.L1Loss(reduction="sum"), None)
    (False, True)
    """
    module = func if isinstance(func, nn.modules.loss._Loss) else getattr(func, "func", None)
    if isinstance(module, nn.modules.loss._Loss):
        return module.reduction == "sum"
    nodes: list[Any] = [out.grad_fn]
    for _ in range(16):
        if not nodes:
            break
        node = nodes.pop()
        if getattr(node, "_saved_reduction", None) == 2:  # (torch's Reduction: 0 none, 1 mean, 2 sum)
            return True
        if type(node).__name__ in ("AddBackward0", "SubBackward0", "MulBackward0", "MulBackward1"):
            nodes += [next_node for next_node, _ in node.next_functions if next_node is not None]
    return False


def own_count(out: Tensor, rows: int) -> str | None:
    """Why a mean loss divides by a count of its own, not by its batch's rows nor by every term it
    sums: a masked mean, `(losses * mask).sum() / mask.sum()` or `losses[mask].mean()`. Read from
    the autograd graph; None for a mean over the rows or the terms.

    >>> losses, mask = torch.ones(4, requires_grad=True), torch.tensor([1, 1, 0, 1])
    >>> own_count((losses * mask).sum() / mask.sum(), rows=4), own_count(losses.sum() / 4, rows=4)
    ("divides its sum of 4 terms by 3, not by the batch's 4 rows", None)
    """
    node: Any = out.grad_fn  # (autograd nodes: their saved fields are typed per node class)
    first: Any = node.next_functions[0][0] if node is not None and node.next_functions else None
    name = type(node).__name__
    if name == "MeanBackward0" and type(first).__name__ in ("IndexBackward0", "MaskedSelectBackward0"):
        return "averages over the items a mask selects"
    divisor = getattr(node, "_saved_other", None) if name == "DivBackward0" else None
    if not isinstance(divisor, Tensor) or divisor.numel() != 1 or type(first).__name__ != "SumBackward0":
        return None
    terms, count = math.prod(first._saved_self_sym_sizes), float(divisor)
    if count in (rows, terms):
        return None
    return f"divides its sum of {terms} terms by {count:g}, not by the batch's {rows} rows"


def nll_module(func: Any) -> nn.CrossEntropyLoss | nn.NLLLoss | None:
    """torch's cross-entropy or NLL module behind a loss function that averages (`reduction="mean"`):
    the function itself, or the one fastai's losses wrap (`CrossEntropyLossFlat().func`)."""
    module = func if isinstance(func, (nn.CrossEntropyLoss, nn.NLLLoss)) else getattr(func, "func", None)
    if isinstance(module, (nn.CrossEntropyLoss, nn.NLLLoss)) and module.reduction == "mean":
        return module
    return None


def weighted_count(module: nn.CrossEntropyLoss | nn.NLLLoss, targets: Tensor) -> Tensor:
    """What a class-weighted `module` divides its sum by: the weights of the targets it scored.

    >>> weighted_count(nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0])), torch.tensor([0, 1, -100]))
    tensor(4.)
    """
    assert module.weight is not None
    targets = targets.reshape(-1)
    return module.weight[targets[targets != module.ignore_index]].sum()


def uncounted_mean(func: Any, out: Tensor, targets: Any) -> str | None:
    """Why a mean loss is not over its batch's rows (class weights, ignored targets), so that rows
    cannot weigh it across ranks: read from torch's cross-entropy module, else from the autograd
    graph torch recorded for it (in evaluation, `ExactLoss` computes it once more to record one).
    None when it is a mean over the rows."""
    module = nll_module(func)
    if module is not None:  # (a class-weighted module is counted by its weights, not refused)
        if isinstance(targets, Tensor) and not targets.is_floating_point():
            ignored = int((targets == module.ignore_index).sum())
            if ignored:
                return f"leaves out {ignored} target(s) equal to ignore_index={module.ignore_index}"
        return None
    node = _nll_node(out, reduction=1)
    if node is None:
        return None
    if node._saved_weight is not None:
        return "averages over class weights"
    ignored, index = _ignored(node)
    return f"leaves out {ignored} target(s) equal to ignore_index={index}" if ignored else None


def model_loss(out: Any) -> Tensor:
    """A model's own loss: `out.loss`, `out["loss"]`, or the 0-dim first element of a tuple
    (`return_dict=False`)."""
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor) and out[0].dim() == 0:
        return out[0]
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None:
        raise ValueError(
            f"the model's output ({type(out).__name__}) has no 'loss': with loss_func=None the model "
            "must return its own loss (out.loss or out['loss']); otherwise pass a loss_func"
        )
    return loss


def zero_loss(pred: Any) -> Tensor:
    """0, connected to every float output that needs a gradient: a backward pass that adds
    nothing but still runs every gradient hook (a rank whose share of a batch is empty)."""
    from unison.data.batch import tensors_in

    parts = [t.float().sum() for t in tensors_in(pred) if t.requires_grad and t.dim()]
    return (cast(Tensor, sum(parts)) * 0.0) if parts else torch.zeros(())
