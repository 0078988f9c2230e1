"""Shared workloads for the side-by-side peer benchmark (CPU, gloo, torchrun-launched).

Every peer script trains the same model on the same data with the same global
batch and optimizer, and reports steady-state training throughput (epochs after
the first), the whole fit's wall time, and the final validation accuracy
computed over the whole validation set.
"""

import json
import os
import resource
import time

import torch
from torch import nn

WORKLOAD = os.environ.get("WL", "mlp")  # mlp | conv
EPOCHS = int(os.environ.get("EPOCHS", "6"))
BS = int(os.environ.get("BS", "32"))  # per-process batch size
LR = 0.05
torch.set_num_threads(int(os.environ.get("THREADS", "1")))


def data():
    g = torch.Generator().manual_seed(0)
    if WORKLOAD == "mlp":
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32) / 16.0
        y = torch.tensor(d.target, dtype=torch.long)
        perm = torch.randperm(len(x), generator=g)
        x, y = x[perm], y[perm]
        n = 1437
        # tile the training set 16x so the timed epochs are long enough to agree between rounds
        # (at 4x, with 0.5 s epochs, rounds ranged 0.83 to 1.41)
        return (x[:n].repeat(16, 1), y[:n].repeat(16)), (x[n:], y[n:])
    n_tr, n_va = 2048, 512
    # a learnable synthetic task: each class plants its own faint template in noise
    templates = torch.randn(10, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n_tr + n_va,), generator=g)
    x = torch.randn(n_tr + n_va, 3, 32, 32, generator=g) + 0.3 * templates[y]
    return (x[:n_tr], y[:n_tr]), (x[n_tr:], y[n_tr:])


def model():
    torch.manual_seed(0)
    if WORKLOAD == "mlp":
        return nn.Sequential(
            nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 10),
    )


def process_age_s():
    """Seconds since this process started (from /proc: includes interpreter start and imports)."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


class Timer:
    """Times each epoch; reports samples/s over epochs after the first.

    Each rank prints one RESULT line: its peak RSS and its time from process start to
    the end of its first optimizer step; rank 0's line also carries the throughput.
    """

    def __init__(self):
        self.t = []
        self.n = []
        self.first_step_s = None
        self.comm_frac = None

    def start(self):
        self.t0 = time.perf_counter()

    def stepped(self):
        if self.first_step_s is None:
            self.first_step_s = process_age_s()

    def stop(self, n):
        self.t.append(time.perf_counter() - self.t0)
        self.n.append(n)

    def report(self, name, acc, world):
        steady = sum(self.n[1:]) / sum(self.t[1:]) if len(self.t) > 1 else float("nan")
        out = dict(
            peer=name,
            workload=WORKLOAD,
            world=world,
            rank=int(os.environ.get("RANK", "0")),
            samples_per_s=round(steady, 1),
            fit_s=round(sum(self.t), 3),
            valid_acc=round(float(acc), 4),
            peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            first_step_s=round(self.first_step_s or float("nan"), 3),
        )
        if self.comm_frac is not None:
            out["comm_frac"] = round(self.comm_frac, 3)
        print("RESULT " + json.dumps(out), flush=True)
