"""Hand-written DDP loop: the floor every framework adds overhead to (the project's copy)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402
from workload import BS, EPOCHS, LR, Timer, data, model  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
(xt, yt), (xv, yv) = data()
tr, va = TensorDataset(xt, yt), TensorDataset(xv, yv)
str_ = DistributedSampler(tr, shuffle=True, seed=0)
sva = DistributedSampler(va, shuffle=False)
dl = DataLoader(tr, batch_size=BS, sampler=str_)
dlv = DataLoader(va, batch_size=BS, sampler=sva)
m = nn.parallel.DistributedDataParallel(model())
opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9)
lossf = nn.CrossEntropyLoss()
timer = Timer()
for ep in range(EPOCHS):
    str_.set_epoch(ep)
    m.train()
    timer.start()
    n = 0
    for x, y in dl:
        opt.zero_grad(set_to_none=True)
        loss = lossf(m(x), y)
        loss.backward()
        opt.step()
        timer.stepped()
        n += len(x) * world
    timer.stop(n)
if os.environ.get("COMM_PROBE") == "1" and world > 1:
    # The share of a step spent communicating: the same steps timed with DDP's gradient all-reduce
    # (and buffer broadcast) and without it (`no_sync`), alternating, 8 steps each, 6 times.
    import contextlib
    import time

    xb, yb = next(iter(dl))
    timed = {"sync": 0.0, "local": 0.0}
    for _ in range(6):
        for mode in timed:
            dist.barrier()
            start = time.perf_counter()
            with m.no_sync() if mode == "local" else contextlib.nullcontext():
                for _ in range(8):
                    opt.zero_grad(set_to_none=True)
                    lossf(m(xb), yb).backward()
            timed[mode] += time.perf_counter() - start
    timer.comm_frac = max(0.0, 1 - timed["local"] / timed["sync"])
m.eval()
correct = torch.zeros(2)
with torch.no_grad():
    for x, y in dlv:
        correct += torch.tensor([(m(x).argmax(1) == y).sum().item(), len(y)])
dist.all_reduce(correct)
timer.report("raw_ddp", correct[0] / correct[1], world)
dist.destroy_process_group()
