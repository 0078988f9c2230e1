"""torchft used directly, as its README trains: one replica of `benchmarks/fault_tolerant.py`'s
comparison (the same data, model, AdamW and global batch of 12 as tests/fault_scripts/ft_replica.py).

TORCHFT_LIGHTHOUSE=http://host:port python benchmarks/torchft_direct.py --out r0.pt --replica r0

torchft's `Manager.allreduce` on each gradient (averaged over the participants), its `Optimizer`
wrapper and async quorum, and a fixed
3-way split of each global batch (replica r takes rows r, r+3, ...; a lost replica's rows are
not trained, as torchft's own DistributedSampler does). Writes each committed step's wall time.

`--lean`: torchft at its cheapest per step, the floor it sets: a quorum only at the first step
and after a failed commit (as its LocalSGD syncs: between quorums torchft keeps the process
group), one flat `Manager.allreduce` of all gradients, and the commit vote (`should_commit`)
that every torchft step needs before the optimizer steps.

Not torchft's `DistributedDataParallel` wrapper: in torchft 0.2.0 its comm hook fails with
`AssertionError` (torchft/ddp.py:76, `assert fut._fut`) when a peer dies mid-all-reduce, which ends
the survivor (seen with this script's first version; benchmarks/RESULTS.md says so).
"""

import argparse
import os
import signal
import socket
import time
from datetime import timedelta

import torch
import torchft
from torch import nn
from torch.distributed import TCPStore

imported = time.time()  # a replacement's start-up ends here

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--replica", required=True)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--min-replicas", type=int, default=2)
parser.add_argument("--die-at", type=int, default=-1)
parser.add_argument("--timeout", type=float, default=20.0)
parser.add_argument("--lean", action="store_true", help="quorum only when needed, one flat all-reduce")
args = parser.parse_args()

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(240, 8, generator=g)
y = (x[:, 0] + x[:, 1] > 0).long()
x, y = x[:192], y[:192]
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
host = socket.gethostname()
store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
limit = timedelta(seconds=args.timeout)
manager = torchft.Manager(
    pg=torchft.ProcessGroupGloo(timeout=limit),
    load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["opt"])),
    state_dict=lambda: {"model": model.state_dict(), "opt": inner.state_dict()},
    min_replica_size=args.min_replicas,
    use_async_quorum=not args.lean,  # (the rare quorum heals at once: an async one heals at the commit)
    timeout=limit,
    connect_timeout=limit,
    rank=0,
    world_size=1,
    store_addr=host,
    store_port=store.port,
    replica_id=args.replica,
)
opt = torchft.Optimizer(manager, inner)
steps_per_epoch, bs = len(x) // 12, 12
total = args.epochs * steps_per_epoch
part = int(args.replica.lstrip("r") or 0) % 3
times, started = [], time.time()
need_quorum = True
while args.lean and manager.current_step() < total:
    step = manager.current_step()
    epoch, k = divmod(step, steps_per_epoch)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
    rows = order[k * bs : (k + 1) * bs][part::3]
    if need_quorum:
        manager.start_quorum()
        while step == 0 and manager.num_participants() < 3:  # all three from step 0, as the others
            time.sleep(0.2)
            manager.start_quorum()
        need_quorum = False
    inner.zero_grad()
    loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
    loss.backward()
    params = list(model.parameters())
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    manager.allreduce(flat).wait()  # averaged over the participants
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    if manager.should_commit():
        inner.step()
        times.append(time.time())
    else:
        need_quorum = True
while manager.current_step() < total:
    step = manager.current_step()
    epoch, k = divmod(step, steps_per_epoch)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
    rows = order[k * bs : (k + 1) * bs][part::3]
    opt.zero_grad()  # starts the quorum (async), heals if needed
    loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
    if step == args.die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    for work in [manager.allreduce(p.grad) for p in model.parameters()]:
        work.wait()  # an error is recorded by the manager, and the commit below fails
    opt.step()  # steps only if every participant committed
    if manager.current_step() > step:
        times.append(time.time())
manager.shutdown(wait=False)
torch.save({"times": times, "started": started, "imported": imported, "steps": len(times)}, args.out + ".tmp")
os.replace(args.out + ".tmp", args.out)
