"""A torchft replica loads only its rows of each step (`FaultTolerantTrainer`'s data side).

Every replica plays the global plan: step `k` is the loader's batch `k`, of which a process keeps
rows `first, first + stride, ...` (its split, set by the latest quorum). Rather than loading the
whole batch and slicing it, the replica's loader (a `DistributedDL`: a map-style dataset) cuts
batch `k`'s index list to those rows before the fetch, so `dataset[i]` and the collate run for
its rows only. The split changes only at a quorum where a replica joined or left, or at the redo
of a failed step: then the new share's rows are sliced from the rows loaded when they hold them
(a replica joined: fewer rows each), else loaded anew here (one left: the rows this one lacked).
The rows, their order and the collate are those of the whole batch's slice, so training is
unchanged, and so is the data order a checkpoint or a healing peer resumes (the step alone).

With workers (`num_workers > 0`), they load the shares, each cut by the split current when it
was queued (up to `prefetch_factor * num_workers` steps ahead); a step whose split changed since
is fixed up as above, in the main process.

Where the rows cannot be loaded alone, the whole batch is loaded and sliced, as before
(`load_problem` says why, and the trainer says so in one line): a stream (IterableDataset), a
loader unison does not plan, or a `collate_fn` other than torch's default, which may join rows
(pad each to the batch's longest); `fetch_rows=True` vouches that it collates row by row.

    loads = RowLoads(sharded_dl, split=lambda: (1, 2))   # rows 1, 3, 5, ... of each step
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import default_collate

from unison.data.batch import map_tensors, to_device
from unison.data.loader import DistributedDL

__all__ = ["RowLoads", "Split", "load_problem", "rows_of"]

#: `(first, stride)`: rows `first, first + stride, ...` of a step.
Split = tuple[int, int]
#: This process's rows of a step: (inputs, targets, whether it has none).
Share = tuple[Any, Any, bool]


def rows_of(x: Any, first: int, stride: int) -> Any:
    """Rows `first, first + stride, ...` of a (nested) batch; scalars and non-tensors kept.

    >>> import torch
    >>> rows_of((torch.arange(5),), 1, 2)
    (tensor([1, 3]),)
    """
    return map_tensors(lambda t: t[first::stride] if t.dim() else t, x)


def _no_rows(x: Any) -> Any:
    return map_tensors(lambda t: t[:0] if t.dim() else t, x)


def load_problem(dl: Any, fetch_rows: bool | None) -> str | None:
    """Why a replica must load the whole batch of each step from `dl` (None: it loads its rows).
    `fetch_rows`: None decides, True vouches for a custom `collate_fn`, False always loads whole.

    >>> from torch.utils.data import DataLoader
    >>> print(load_problem(DistributedDL(DataLoader(range(8), batch_size=4), 0, 2), None))
    None
    >>> print(load_problem(DistributedDL(DataLoader(range(8), batch_size=4, collate_fn=list), 0, 2), None))
    its collate_fn (list) may join rows (pad to the batch's longest); ...
    """
    if fetch_rows is False:
        return "fetch_rows=False"
    if not isinstance(dl, DistributedDL):
        if type(dl).__name__ == "StreamDL":
            return "the loader streams (an IterableDataset): its items cannot be fetched by index"
        return f"the loader ({type(dl).__name__}) is not a map-style DataLoader unison plans"
    collate = dl.dl.collate_fn  # (the user's: a TensorDataset's batched fetch stands for torch's default)
    if collate is not default_collate and not fetch_rows:
        name = getattr(collate, "__qualname__", type(collate).__name__)
        return (
            f"its collate_fn ({name}) may join rows (pad to the batch's longest); "
            'fault_tolerant={"fetch_rows": True} if it collates row by row'
        )
    return None


class RowLoads:
    """Cuts each batch `dl` loads to this process's rows under `split()` (read as each batch is
    queued), and gives any split's rows of the step in flight (`share`). `detach()` undoes it."""

    def __init__(self, dl: DistributedDL, split: Callable[[], Split]) -> None:
        self.dl, self.split = dl, split
        self._cut_for: dict[int, Split] = {}  # the split each queued batch was cut by
        self._loaded: tuple[int, Split, Any, Any] | None = None  # step, split, xb, yb
        dl.cut_rows = self._cut

    @classmethod
    def attach(
        cls, dl: Any, fetch_rows: bool | None, split: Callable[[], Split]
    ) -> tuple[RowLoads | None, str | None]:
        """`(RowLoads on dl, None)`, or `(None, why the whole batch is loaded)` (`load_problem`; None
        again when `fetch_rows=False` chose it: nothing to say)."""
        problem = load_problem(dl, fetch_rows)
        if problem is None:
            return cls(dl, split), None
        return None, None if fetch_rows is False else problem

    def detach(self) -> None:
        self.dl.cut_rows = None
        self._cut_for.clear()
        self._loaded = None

    def _cut(self, k: int, indices: Any) -> Any:
        first, stride = self._cut_for[k] = self.split()
        share = indices[first::stride]
        # An empty share still loads one item (its fields' shapes and types); `share` drops it.
        return share if len(share) else indices[:1]

    def took(self, k: int, xb: Any, yb: Any) -> bool:
        """Step `k` arrived as `xb`/`yb`: whether it was cut (then `share` gives its rows)."""
        split = self._cut_for.pop(k, None)
        if split is None and self._cut_for:  # cut batches queued, but none numbered k: never slice one twice
            raise RuntimeError(f"unison: step {k} arrived, but the loader cut steps {sorted(self._cut_for)}")
        self._loaded = None if split is None else (k, split, xb, yb)
        return split is not None

    def share(self, host: Any, split: Split) -> Share:
        """`(xb, yb, empty)`: rows `split` of the step `took` last, sliced from the rows loaded when
        they hold them, else loaded now (a redo, or a quorum where a replica left)."""
        assert self._loaded is not None
        k, (have_first, have_stride), xb, yb = self._loaded
        first, stride = split
        rows = self.dl.real_rows(k)  # the whole step's (the replica's loader is one process's)
        if first >= rows:  # no rows here: the loaded ones' fields, none of their rows
            return _no_rows(xb), _no_rows(yb), True
        if (have_first, have_stride) == split:
            return xb, yb, False
        inside = have_first < rows and stride % have_stride == 0 and first >= have_first
        if inside and (first - have_first) % have_stride == 0:
            at, every = (first - have_first) // have_stride, stride // have_stride
            return rows_of(xb, at, every), rows_of(yb, at, every), False
        # Each item under its own seed: a random augmentation draws as when the whole step is loaded.
        indices, seeds = self.dl.batch_indices(k), self.dl.item_seeds(k)
        loaded = self.dl.load(indices[first::stride], seeds[first::stride])
        xb, yb = host.split_batch(to_device(loaded, host.device, non_blocking=True))  # as the loop splits it
        self._loaded = (k, split, xb, yb)
        return xb, yb, False
