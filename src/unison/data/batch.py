"""Batch structure: tensors nested in tuples, lists, dicts, namedtuples, dataclasses and `ModelOutput`s.

Every transform here keeps each container's class (a `transformers` `ModelOutput`
stays one), so a model's output or a Hugging Face batch survives device moves,
row slicing and concatenation as the type its code expects. `DataLoaders` pairs a
training and a validation loader.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader


def _rebuild_mapping(x: Mapping, items: dict[str, Any]) -> Any:
    """A mapping of `x`'s class holding `items` (`ModelOutput` and other dataclasses by keyword)."""
    if dataclasses.is_dataclass(x):
        return type(x)(**items)
    cls: Any = type(x)  # a Mapping subclass; its constructor's signature is the class's own
    try:
        return cls(items)
    except TypeError:  # a Mapping class without a dict constructor: a plain dict still reads the same
        return dict(items)


def _map_leaves(fn: Callable[[tuple, Any], Any], x: Any, path: tuple = ()) -> Any:
    """`x` with every leaf (a tensor or anything that is not a container) replaced by
    `fn(path, leaf)`, `path` the keys and indices that lead to it, each container rebuilt as its
    own class."""
    if isinstance(x, Mapping):
        return _rebuild_mapping(x, {k: _map_leaves(fn, v, (*path, k)) for k, v in x.items()})
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*(_map_leaves(fn, v, (*path, i)) for i, v in enumerate(x)))
    if isinstance(x, (list, tuple)):
        return type(x)(_map_leaves(fn, v, (*path, i)) for i, v in enumerate(x))
    if _is_dataclass_instance(x):  # a batch class a collate_fn returns: its fields hold the leaves
        fields = {f.name: _map_leaves(fn, getattr(x, f.name), (*path, f.name)) for f in _init_fields(x)}
        return dataclasses.replace(x, **fields)
    return fn(path, x)


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _init_fields(x: Any) -> list[dataclasses.Field]:
    """The fields of dataclass `x` its constructor takes (the others it derives, in `__post_init__`)."""
    return [f for f in dataclasses.fields(x) if f.init]


def map_tensors(fn: Callable[[Tensor], Any], x: Any) -> Any:
    """`x` with `fn` applied to every tensor, each container rebuilt as its own class.

    >>> map_tensors(lambda t: t * 2, {"a": (torch.ones(1),)})
    {'a': (tensor([2.]),)}
    """
    return _map_leaves(lambda _, leaf: fn(leaf) if isinstance(leaf, Tensor) else leaf, x)


def to_device(batch: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """`batch` with every tensor moved to `device` (any nesting; container classes kept).

    >>> to_device((torch.zeros(1), {"y": torch.ones(1)}), "cpu")[1]["y"]
    tensor([1.])
    """
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), batch)


def tensors_in(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a (nested) batch."""
    return (leaf for _, leaf in _leaves(batch) if isinstance(leaf, Tensor))


def batch_size_of(batch: Any) -> int:
    """Number of samples in a (nested) batch: dim 0 of its first tensor that has one.

    >>> batch_size_of({"input_ids": torch.zeros(3, 7)})
    3
    """
    for t in tensors_in(batch):
        if t.dim():
            return int(t.shape[0])
    return 0


def take_rows(x: Any, n: int) -> Any:
    """The first `n` samples of a (nested) batch; scalars and non-tensors are kept as they are.

    >>> take_rows({"ids": torch.arange(6).view(3, 2)}, 1)
    {'ids': tensor([[0, 1]])}
    """
    return map_tensors(lambda t: t[:n] if t.dim() else t, x)


def cat_padded(parts: Sequence[Tensor], pad_value: float = -100) -> Tensor:
    """Concatenate along dim 0, padding later dims to the largest with `pad_value`.

    Variable-length outputs (tokens) line up without inventing values: a padded
    integer target reads -100, the index PyTorch's losses and unison's metrics ignore.

    >>> cat_padded([torch.tensor([[1, 2]]), torch.tensor([[3]])]).tolist()
    [[1, 2], [3, -100]]
    """
    if not parts:
        return torch.zeros(0)
    if all(p.shape[1:] == parts[0].shape[1:] for p in parts):
        return torch.cat(list(parts))
    if any(p.dim() != parts[0].dim() for p in parts):
        raise ValueError(f"cat_padded: parts have different numbers of dims: {[p.dim() for p in parts]}")
    trailing = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    out = parts[0].new_full([sum(p.shape[0] for p in parts), *trailing], pad_value)
    row = 0
    for p in parts:
        index = (slice(row, row + len(p)), *(slice(0, n) for n in p.shape[1:]))
        out[index] = p
        row += len(p)
    return out


def _leaves(x: Any, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    if isinstance(x, Mapping):
        for k, v in x.items():
            yield from _leaves(v, (*prefix, k))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _leaves(v, (*prefix, i))
    elif _is_dataclass_instance(x):
        for f in _init_fields(x):
            yield from _leaves(getattr(x, f.name), (*prefix, f.name))
    else:
        yield prefix, x


def cat_structured(batches: Sequence[Any], pad_value: float = -100, combine: Callable | None = None) -> Any:
    """Batches of one structure concatenated leaf by leaf, in that structure (classes kept).

    Per-sample tensors (dim >= 1) are joined with `cat_padded`; scalars such as a batch's
    `loss` and anything that is not a tensor become None. `combine(tensor)` then runs on
    each joined tensor (an ordered gather across ranks, say).

    >>> cat_structured([{"x": torch.ones(1, 2)}, {"x": torch.zeros(2, 2)}])["x"].shape
    torch.Size([3, 2])
    """
    if not batches:
        return None
    by_path = [dict(_leaves(b)) for b in batches]  # each batch's leaves, keyed by where they sit

    def joined(path: tuple, leaf: Any) -> Any:
        parts: list[Any] = [leaves.get(path) for leaves in by_path]
        if isinstance(leaf, Tensor) and leaf.dim() and all(isinstance(p, Tensor) for p in parts):
            t = cat_padded(parts, pad_value)
            return combine(t) if combine is not None else t
        return None

    return _map_leaves(joined, batches[0])


def split_batch(batch: Any, n_inp: int = 1) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """`(inputs, targets)` of a batch as the learner sees them.

    A tuple, list or namedtuple: its first `n_inp` items are inputs, the rest targets. A dict (a
    Hugging Face batch): the whole dict is the input, and its `labels` (or `label`) also
    the target that metrics read. Anything else: an input without targets.

    >>> split_batch({"input_ids": torch.tensor([[5, 7]]), "labels": torch.tensor([1])})
    (({'input_ids': tensor([[5, 7]]), 'labels': tensor([1])},), (tensor([1]),))
    """
    if isinstance(batch, Mapping):
        for key in ("labels", "label"):
            if key in batch:
                return (batch,), (batch[key],)
        return (batch,), ()
    if isinstance(batch, (list, tuple)):  # namedtuples too: their fields in order
        return tuple(batch[:n_inp]), tuple(batch[n_inp:])
    return (batch,), ()


def call_model(model: nn.Module, xb: tuple[Any, ...]) -> Any:
    """The learner's forward call: a single dict input goes in as keyword arguments
    (`model(**batch)`, as Hugging Face models expect; keys the model's `forward` does not
    name, such as `labels` for a model that does not score itself, are left out),
    anything else positionally.

    For another calling convention, give the learner your own: `Learner(..., call_model=fn)`.

        call_model(model, ({"input_ids": ids, "attention_mask": mask},))
    """
    if len(xb) == 1 and isinstance(xb[0], Mapping):
        accepted = _keyword_names(model)
        kwargs = xb[0] if accepted is None else {k: v for k, v in xb[0].items() if k in accepted}
        return model(**kwargs)
    return model(*xb)


def _keyword_names(model: nn.Module) -> frozenset[str] | None:
    """The keywords the user's model's `forward` takes, None when it takes any (`**kwargs`):
    a dict batch's `labels` is not passed to a model that has no such argument."""
    inner = model
    while hasattr(inner, "module") and isinstance(inner.module, nn.Module):  # DDP / DataParallel
        inner = inner.module
    unwrapped: nn.Module = getattr(inner, "_orig_mod", inner)  # torch.compile
    # The cache key is the class; mypy reads a plain `type` as Hashable, a `type[nn.Module]` not.
    cls: type = type(unwrapped)
    return _forward_keywords(cls)


@functools.lru_cache(maxsize=64)
def _forward_keywords(cls: type) -> frozenset[str] | None:
    try:
        params = inspect.signature(cast("type[nn.Module]", cls).forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL)


class DataLoaders:
    """A training and a validation `DataLoader`, as a `Learner` expects them.

    >>> from torch.utils.data import TensorDataset
    >>> train_ds, valid_ds = TensorDataset(torch.zeros(256, 3)), TensorDataset(torch.zeros(64, 3))
    >>> dls = DataLoaders(DataLoader(train_ds, batch_size=64, shuffle=True),
    ...                   DataLoader(valid_ds, batch_size=128))
    >>> len(dls.train), len(dls.valid), len(dls.loaders)   # train batches, valid batches, loaders
    (4, 1, 2)
    """

    def __init__(self, train: DataLoader, valid: DataLoader | None = None):
        for name, dl in (("train", train), ("valid", valid)):
            if dl is not None and not isinstance(dl, DataLoader):
                raise TypeError(f"DataLoaders: {name} must be a torch DataLoader, got {type(dl).__name__}")
        if train is None:
            raise TypeError("DataLoaders: a train DataLoader is required")
        self.train = train
        self.valid = valid

    @property
    def loaders(self) -> Sequence[DataLoader]:
        return [dl for dl in (self.train, self.valid) if dl is not None]

    def __iter__(self) -> Iterator[DataLoader]:
        return iter(self.loaders)

    def __getitem__(self, i: int) -> DataLoader:
        return self.loaders[i]

    def __len__(self) -> int:
        return len(self.loaders)

    def __repr__(self) -> str:
        sizes = ", ".join(
            f"{n}={len(dl.dataset)} items"
            for n, dl in (("train", self.train), ("valid", self.valid))
            if dl is not None and hasattr(dl.dataset, "__len__")
        )
        return f"DataLoaders({sizes})"
