"""DistributedDataParallel on CPU across machines, one process per machine started by hand, with unison.

One process per machine, started by hand on each, CPU only, gloo. The script makes the
process group itself from its arguments (`init_method="tcp://host:port"`); unison's
`learn.to_distributed()` uses that group as it is.

    # on machine 0 (address 10.0.0.1) and on machine 1, at about the same time:
    python examples/cpu_multinode.py --world-size 2 --rank 0 --host 10.0.0.1
    python examples/cpu_multinode.py --world-size 2 --rank 1 --host 10.0.0.1

The launcher does the same with one command per machine (then the arguments come from it):

    unison launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        examples/cpu_multinode.py

gloo must talk over the interface that reaches the other machine: the script exports
GLOO_SOCKET_IFNAME as the one routing to `--host` (unless set), which is what `unison launch`
does for every job. Each rank ends by printing `rank R weights_sum S sha256 H`, the same on
every rank.
"""

import argparse
import datetime
import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import DataLoaders, Learner, accuracy, set_seed
from unison.launch.launcher import gloo_interface

parser = argparse.ArgumentParser(description="CPU data-parallel across machines, by hand.")
parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
parser.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
parser.add_argument("--host", default=os.environ.get("MASTER_ADDR", "127.0.0.1"), help="rank 0's address")
parser.add_argument("--port", type=int, default=29500, help="a free port on rank 0's machine")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the other ranks")
args = parser.parse_args()

iface = gloo_interface(args.host)  # the interface that routes to rank 0 (no packet is sent)
if iface and "GLOO_SOCKET_IFNAME" not in os.environ:
    os.environ["GLOO_SOCKET_IFNAME"] = iface
wait = datetime.timedelta(seconds=args.timeout)
if "TORCHELASTIC_RUN_ID" in os.environ:  # under a launcher: it already described the group
    dist.init_process_group("gloo", init_method="env://", timeout=wait)
else:
    init = f"tcp://{args.host}:{args.port}"
    dist.init_process_group(
        "gloo", init_method=init, rank=args.rank, world_size=args.world_size, timeout=wait
    )

set_seed(4)  # the same data and the same initial weights on every machine
x = torch.randn(320, 12)
y = (x[:, :6].pow(2).sum(1) > x[:, 6:].pow(2).sum(1)).long()
dls = DataLoaders(
    DataLoader(TensorDataset(x[:256], y[:256]), batch_size=16, shuffle=True),
    DataLoader(TensorDataset(x[256:], y[256:]), batch_size=32),
)
model = nn.Sequential(nn.Flatten(), nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 2))
learn = Learner(dls, model, nn.CrossEntropyLoss(), metrics=[accuracy])
learn.to_distributed()  # the group above, used as it is; every rank trains on its share
learn.fit(args.epochs, lr=2e-2)
valid_loss, valid_acc = learn.validate()
learn.detach_distributed()

flat = torch.cat([p.detach().double().flatten() for p in learn.model.parameters()])
digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
rank = dist.get_rank()
print(f"rank {rank} weights_sum {flat.sum().item():.10f} sha256 {digest} valid_acc {valid_acc:.4f}")
dist.destroy_process_group()
