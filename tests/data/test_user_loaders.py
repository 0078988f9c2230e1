"""What users bring from their own DataLoaders (their samplers, collates, workers), sharded over W
ranks and compared with one process's plain DataLoader at the global batch."""

import dataclasses

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

from unison.data.batch import batch_size_of, cat_structured, take_rows, to_device
from unison.data.loader import DistributedDL
from unison.data.stream import StreamDL


class _MisCountingSampler(Sampler):
    """Yields `n` indices in order but announces `claimed` as its length (a sampler whose length is
    estimated, or stale after its data changed)."""

    def __init__(self, n: int, claimed: int) -> None:
        self.n, self.claimed = n, claimed

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.claimed


def _global_batches(dl: DataLoader, world: int, pad: bool) -> list[list[int]]:
    """Each step's real items over the ranks of `world`, rank r's rows at positions r, r + W, ..."""
    shares = []
    for rank in range(world):
        ddl = DistributedDL(dl, rank, world, seed=0, pad=pad)
        ddl.set_epoch(0)
        shares.append([batch[: ddl.real_rows(k)].tolist() for k, batch in enumerate(ddl)])
    assert len({len(share) for share in shares}) == 1, "every rank takes the same number of steps"
    steps = []
    for parts in zip(*shares, strict=True):
        step = [None] * sum(map(len, parts))
        for rank, part in enumerate(parts):
            step[rank::world] = part
        steps.append(step)
    return steps


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("n, claimed", [(20, 10), (10, 20)])
def test_a_sampler_whose_len_differs_from_what_it_yields_is_sharded_as_it_yields(n, claimed, world, pad):
    data = list(range(100, 100 + n))
    dl = DataLoader(data, batch_size=2, sampler=_MisCountingSampler(n, claimed))
    one_process = DataLoader(data, batch_size=2 * world, sampler=_MisCountingSampler(n, claimed))
    expected = [batch.tolist() for batch in one_process]
    got = _global_batches(dl, world, pad)
    if pad:  # evaluation pads the last step by wrapping: compare the real items it holds
        assert [x for step in got for x in step][:n] == [x for step in expected for x in step]
    else:
        assert got == expected


class _OpenedPerWorker(Dataset):
    """Items read through a handle each DataLoader worker opens in its `worker_init_fn` (an LMDB or
    HDF5 file, say), optionally jittered by a generator that function gives it."""

    def __init__(self) -> None:
        self.handle: dict[int, float] | None = None
        self.rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> float:
        assert self.handle is not None, "the worker_init_fn did not open the handle"
        return self.handle[i] + (self.rng.random() if self.rng is not None else 0.0)


def _open_handle(worker_id: int) -> None:
    get_worker_info().dataset.handle = {i: 10.0 * i for i in range(8)}


def _open_handle_and_seed_a_generator(worker_id: int) -> None:
    _open_handle(worker_id)
    info = get_worker_info()
    info.dataset.rng = np.random.default_rng(info.seed % 2**32)


@pytest.mark.parametrize("world", [1, 2])
def test_a_worker_init_fn_sets_up_the_users_dataset_as_in_a_plain_dataloader(world):
    dl = DataLoader(_OpenedPerWorker(), batch_size=2, num_workers=2, worker_init_fn=_open_handle)
    one_process = DataLoader(
        _OpenedPerWorker(), batch_size=2 * world, num_workers=2, worker_init_fn=_open_handle
    )
    assert _global_batches(dl, world, pad=False) == [batch.tolist() for batch in one_process]


def test_a_generator_a_worker_init_fn_gives_the_dataset_is_refused():
    dl = DataLoader(
        _OpenedPerWorker(), batch_size=2, num_workers=2, worker_init_fn=_open_handle_and_seed_a_generator
    )
    with pytest.raises(ValueError, match=r"dataset\.rng, a numpy Generator the dataset holds, drew"):
        list(DistributedDL(dl, 0, 2, seed=0))


@dataclasses.dataclass
class _Batch:
    """A batch class a user's collate_fn returns (not a Mapping, not a tuple)."""

    x: torch.Tensor
    y: torch.Tensor
    note: str = "kept"


def _collate_to_dataclass(items: list[tuple[torch.Tensor, torch.Tensor]]) -> _Batch:
    return _Batch(torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))


def test_a_dataclass_batch_has_its_padding_rows_trimmed_as_a_tuple_batch_does():
    data = [(torch.tensor([float(i)]), torch.tensor(float(i))) for i in range(5)]
    dl = DataLoader(data, batch_size=2, collate_fn=_collate_to_dataclass)
    rank1 = DistributedDL(dl, 1, 2, seed=0, pad=False)  # global step 1 holds item 4 only: rank 1 pads
    batches = list(rank1)
    assert [batch_size_of(b) for b in batches] == [2, 1] and rank1.real_rows(1) == 0
    trimmed = take_rows(to_device(batches[1], "cpu"), rank1.real_rows(1))
    assert isinstance(trimmed, _Batch) and trimmed.note == "kept"
    assert batch_size_of(trimmed) == 0 and trimmed.y.shape == (0,)
    joined = cat_structured([take_rows(b, rank1.real_rows(k)) for k, b in enumerate(batches)])
    assert joined.x.flatten().tolist() == [1.0, 3.0] and joined.note is None


class _Range(IterableDataset):
    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self):
        return iter(range(self.start, self.end))


def _split_among_workers(worker_id: int) -> None:
    """torch's documented `worker_init_fn` for an IterableDataset: each worker keeps a slice."""
    info = get_worker_info()
    dataset = info.dataset
    per_worker = -(-(dataset.end - dataset.start) // info.num_workers)
    dataset.start += info.id * per_worker
    dataset.end = min(dataset.start + per_worker, dataset.end)


def test_a_stream_a_worker_init_fn_splits_among_workers_is_refused_naming_the_workers():
    dl = DataLoader(_Range(0, 12), batch_size=2, num_workers=2, worker_init_fn=_split_among_workers)
    with pytest.raises(ValueError, match="the stream _Range differs across DataLoader workers"):
        list(StreamDL(dl, 0, 1))


class _StreamThroughHandle(IterableDataset):
    """A stream read through a handle each worker opens, split among workers in `__iter__`."""

    def __init__(self) -> None:
        self.handle: list[int] | None = None

    def __iter__(self):
        assert self.handle is not None, "the worker_init_fn did not open the handle"
        info = get_worker_info()
        for i, item in enumerate(self.handle):
            if info is None or i % info.num_workers == info.id:
                yield item


def _open_stream_handle(worker_id: int) -> None:
    get_worker_info().dataset.handle = list(range(100, 112))


def test_a_stream_a_worker_init_fn_opens_is_read_whole_and_in_order():
    dl = DataLoader(_StreamThroughHandle(), batch_size=2, num_workers=2, worker_init_fn=_open_stream_handle)
    assert torch.cat(list(StreamDL(dl, 0, 1))).tolist() == list(range(100, 112))
