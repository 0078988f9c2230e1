"""A torchft replica's loader loads only its rows of each step (`unison.distributed.ft_rows`): the
same rows, order and collate as slicing the whole batch, and the rows it lacks when its split changes.
(The replicas themselves, with a real lighthouse: tests/distributed/test_fault_tolerant.py.)"""

from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from unison.data.batch import split_batch
from unison.data.loader import DistributedDL
from unison.distributed.ft_rows import RowLoads, load_problem, rows_of


class Counted(Dataset):
    """Items (x, y) of a fixed tensor; every index fetched, in this process, is written down."""

    def __init__(self, n=30):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 3, generator=g), torch.arange(n)
        self.fetched = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.fetched.append(int(i))
        return self.x[i], self.y[i]


def host():
    # What RowLoads reads of a Learner: its device and how it splits a batch into inputs and targets.
    return SimpleNamespace(device=torch.device("cpu"), split_batch=lambda batch: split_batch(batch, 1))


def whole_batches(n=30, bs=8, shuffle=True):
    """The batches one process's loader yields (the reference), in the order DistributedDL plans."""
    ddl = DistributedDL(DataLoader(Counted(n), batch_size=bs, shuffle=shuffle), 0, 1, seed=3, pad=False)
    return [split_batch(b, 1) for b in ddl]


def test_each_step_loads_only_its_rows_in_the_order_the_whole_batch_has_them():
    want = whole_batches()
    data = Counted()
    ddl = DistributedDL(DataLoader(data, batch_size=8, shuffle=True), 0, 1, seed=3, pad=False)
    loads = RowLoads(ddl, split=lambda: (1, 3))
    for k, batch in enumerate(ddl):
        xb, yb = split_batch(batch, 1)
        assert loads.took(k, xb, yb)
        share_x, share_y, empty = loads.share(host(), (1, 3))
        assert not empty
        assert torch.equal(share_x[0], rows_of(want[k][0], 1, 3)[0])  # bit for bit
        assert torch.equal(share_y[0], rows_of(want[k][1], 1, 3)[0])
    # 4 steps of 8, 8, 8, 6: rows 1 and 4 and 7 of each (2 of the last): 11 of the 30 items, once each.
    assert len(data.fetched) == 3 + 3 + 3 + 2 == len(set(data.fetched))
    assert sorted(data.fetched) == sorted(torch.cat([w[1][0][1::3] for w in want]).tolist())


def test_a_changed_split_is_sliced_from_the_loaded_rows_or_loads_the_rows_it_lacks():
    want = whole_batches()
    data = Counted()
    ddl = DistributedDL(DataLoader(data, batch_size=8, shuffle=True), 0, 1, seed=3, pad=False)
    split = [(0, 1)]
    loads = RowLoads(ddl, split=lambda: split[0])
    it = iter(ddl)
    xb, yb = split_batch(next(it), 1)  # step 0 loaded whole: one replica
    assert loads.took(0, xb, yb) and len(data.fetched) == 8
    # A replica joined at this step's quorum: its rows 1::2 are sliced, nothing loaded again.
    share_x, share_y, _ = loads.share(host(), (1, 2))
    assert torch.equal(share_y[0], want[0][1][0][1::2]) and len(data.fetched) == 8
    split[0] = (1, 2)
    xb, yb = split_batch(next(it), 1)  # step 1 cut to rows 1::2 as it was loaded
    assert loads.took(1, xb, yb) and data.fetched[8:] == want[1][1][0][1::2].tolist()
    # The other replica was lost and step 1 is redone alone: its new share (all rows) is loaded.
    share_x, share_y, empty = loads.share(host(), (0, 1))
    assert not empty and data.fetched[12:] == want[1][1][0].tolist()
    assert torch.equal(share_x[0], want[1][0][0]) and torch.equal(share_y[0], want[1][1][0])
    # Redone again with a third replica's rows 2::3: sliced from those, nothing loaded.
    share_x, share_y, empty = loads.share(host(), (2, 3))
    assert torch.equal(share_x[0], want[1][0][0][2::3]) and len(data.fetched) == 20


def test_a_share_with_no_rows_has_the_fields_of_the_batch_and_no_row():
    want = whole_batches(n=25)  # the last step holds one item: rows 1::2 of it are none
    ddl = DistributedDL(DataLoader(Counted(25), batch_size=8, shuffle=True), 0, 1, seed=3, pad=False)
    loads = RowLoads(ddl, split=lambda: (1, 2))
    batches = list(ddl)
    assert loads.took(3, *split_batch(batches[3], 1))
    share_x, share_y, empty = loads.share(host(), (1, 2))
    assert empty and share_x[0].shape == (0, 3) and share_y[0].shape == (0,)
    assert share_x[0].dtype == want[3][0][0].dtype
    # The same step redone alone: its one row, loaded.
    share_x, _, empty = loads.share(host(), (0, 1))
    assert not empty and torch.equal(share_x[0], want[3][0][0])


def test_a_tensor_dataset_and_workers_load_the_same_rows_and_a_stale_cut_is_fixed():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 3, generator=g), torch.arange(40)
    loader = DataLoader(TensorDataset(x, y), batch_size=10, shuffle=True)
    plain = DistributedDL(loader, 0, 1, seed=5, pad=False)
    want = [split_batch(b, 1) for b in plain]
    dl = DataLoader(TensorDataset(x, y), batch_size=10, shuffle=True, num_workers=2)
    ddl = DistributedDL(dl, 0, 1, seed=5, pad=False)
    split = [(0, 2)]
    loads = RowLoads(ddl, split=lambda: split[0])
    for k, batch in enumerate(ddl):
        xb, yb = split_batch(batch, 1)
        assert loads.took(k, xb, yb)
        if k == 1:
            split[0] = (1, 3)  # changed while later steps were already queued by the workers
        share_x, share_y, _ = loads.share(host(), split[0])
        first, stride = split[0]
        assert torch.equal(share_x[0], want[k][0][0][first::stride]), k
        assert torch.equal(share_y[0], want[k][1][0][first::stride]), k


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_where_rows_cannot_be_loaded_alone_the_reason_is_one_line():
    assert load_problem(DistributedDL(DataLoader(Counted(), batch_size=4), 0, 1), None) is None
    padded = DataLoader(Counted(), batch_size=4, collate_fn=lambda items: items)
    ddl = DistributedDL(padded, 0, 1)
    problem = load_problem(ddl, None)
    assert "may join rows" in problem and '"fetch_rows": True' in problem and "\n" not in problem
    assert load_problem(ddl, True) is None  # vouched for
    assert load_problem(DistributedDL(DataLoader(Counted(), batch_size=4), 0, 1), False) == "fetch_rows=False"
    from unison.data.stream import StreamDL

    stream = StreamDL(DataLoader(Stream(), batch_size=2), 0, 1)
    assert "streams (an IterableDataset)" in load_problem(stream, None)


def test_detached_the_loader_loads_whole_batches_again():
    data = Counted(16)
    ddl = DistributedDL(DataLoader(data, batch_size=8), 0, 1, pad=False)
    RowLoads(ddl, split=lambda: (0, 2)).detach()
    assert [len(b[1]) for b in ddl] == [8, 8] and len(data.fetched) == 16
