"""GPU self-check: the CUDA paths CI cannot run, end to end on 1 and 2 GPUs, in one command.

    make gpu-check                # or: python benchmarks/gpu_check.py [--only ddp_syncbn,stall]

Each row runs in its own process(es) (`unison launch`, `unison.spawn`, or a plain process) and
prints one `GPUCHECK <row> PASS|FAIL <detail>` line; the driver prints a table and exits 1 if a
row failed. Without CUDA it says so and exits 0 (CI runs nothing here). On a one-GPU machine the
multi-process rows run on that GPU alone (NCCL with one rank: the CUDA paths, not the all-reduce);
the rows that need two ranks on two GPUs (mapping, stall, rollback) are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
LAUNCH = [sys.executable, "-m", "unison.launch"]


# ---- what every worker trains ---------------------------------------------------------------------
def _data():
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    x = torch.randn(160, 6, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return TensorDataset(x[:128], y[:128]), TensorDataset(x[128:], y[128:])


def _learner(bs, path=".", cbs=(), dropout=0.0, loss=None, sgd=False):
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from unison import DataLoaders, Learner, set_seed

    set_seed(0, deterministic=True)
    train, valid = _data()
    dls = DataLoaders(DataLoader(train, batch_size=bs, shuffle=True), DataLoader(valid, batch_size=16))
    model = nn.Sequential(
        nn.Linear(6, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 2)
    )
    loss = loss if loss is not None else nn.CrossEntropyLoss()
    # Parity rows use SGD: Adam divides by the gradients' size, so where one is ~0 the last-bit
    # differences of a sum taken in another order (2 ranks vs 1) grow to 1e-2 (seen on CPU too).
    opt = (lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)) if sgd else torch.optim.AdamW
    return Learner(dls, model, loss, opt_func=opt, lr=1e-2, path=path, cbs=list(cbs))


def _device():
    """cuda where there is one; the CPU lets a row's logic be tried without a GPU (it then fails)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _quiet():
    return contextlib.redirect_stdout(io.StringIO())


def _max_diff(a, b):
    return max(float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in a)


def _state(learn):
    return {k: v.detach().clone() for k, v in learn.raw_model.state_dict().items()}


def _gather(value):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# ---- rows (run inside the launched workers; rank 0's verdict is printed) -----------------------------
def case_ddp_syncbn(args):
    """NCCL DDP with SyncBatchNorm equals one GPU at the global batch; each rank on its own GPU."""
    import torch
    import torch.distributed as dist

    from unison.distributed import SyncBatchNorm

    seen = {}
    multi = _learner(bs=8, sgd=True)
    with _quiet(), multi.distrib_ctx(sync_bn=True):
        seen["backend"] = dist.get_backend()
        seen["sync_bn"] = isinstance(multi.raw_model[1], SyncBatchNorm)
        seen["device"] = str(multi.device)
        multi.fit(2)
        devices = _gather(torch.cuda.current_device())
    single = _learner(bs=8 * len(devices), sgd=True)
    single.model.cuda()
    with _quiet():
        single.fit(2)
    diff = _max_diff(_state(single), _state(multi))
    on_own_gpus = devices == list(range(len(devices)))
    seen["sync_bn"] = seen["sync_bn"] or len(devices) == 1  # (one rank: nothing to synchronise)
    ok = seen["backend"] == "nccl" and seen["sync_bn"] and on_own_gpus and diff < 1e-4
    return ok, f"backend {seen['backend']}, sync_bn {seen['sync_bn']}, devices {devices}, max diff {diff:.1e}"


def case_one_gpu(args):
    """`--gpus 1`: the model, AdamW state loaded on the CPU, and the loss's weight all move to the GPU."""
    import torch
    from torch import nn

    learn = _learner(bs=16, path=args.dir, loss=nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0])))
    with _quiet():
        learn.fit(1)
    learn.save("cpu")
    learn.load("cpu")  # mapped to the CPU: examples/mp_spawn.py's order (load, then distrib_ctx)
    with _quiet(), learn.distrib_ctx():
        device = learn.device
        learn.fit(1)  # a foreach AdamW step with state on two devices would raise here
        moments = {str(v.device) for s in learn.opt.state.values() for k, v in s.items() if k != "step"}
        weight = str(learn.loss_func.weight.device)
    ok = device.type == "cuda" and moments == {"cuda:0"} and weight == "cuda:0"
    return ok, f"model on {device}, optimizer state on {sorted(moments)}, loss weight on {weight}"


def case_mapping(args):
    """`--gpus 1,0`: rank 0 drives physical GPU 1, rank 1 physical GPU 0."""
    import torch

    with _quiet(), _learner(bs=8).distrib_ctx():
        uuids = _gather(str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid))
    expected = args.expect.split(",")
    return (
        uuids == expected,
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}, uuids match: {uuids == expected}",
    )


def case_fp16(args):
    """fp16 autocast with a GradScaler and gradient clipping on one GPU: finite, and it learns."""
    import math

    from unison import GradientClip, MixedPrecision

    learn = _learner(bs=16, cbs=[MixedPrecision("fp16"), GradientClip(1.0)])
    with _quiet(), learn.distrib_ctx():
        before = learn.validate()[0]
        scalers = []
        learn.fit(3, cbs=[_Probe(lambda lr: scalers.append(lr.scaler is not None))])
        after = learn.validate()[0]
    ok = all(scalers) and math.isfinite(after) and after < before
    return ok, f"valid loss {before:.3f} -> {after:.3f}, GradScaler on every batch: {all(scalers)}"


def case_bf16(args):
    """bf16 autocast under NCCL DDP: finite, and it learns (native bf16 or not is reported)."""
    import math

    import torch

    from unison import MixedPrecision

    learn = _learner(bs=8, cbs=[MixedPrecision("bf16")])
    with _quiet(), learn.distrib_ctx():
        before = learn.validate()[0]
        learn.fit(3)
        after = learn.validate()[0]
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    return math.isfinite(
        after
    ) and after < before, f"valid loss {before:.3f} -> {after:.3f}, native bf16 {native}"


def case_resumable(args):
    """Trains with a checkpoint each step; the last rank kills itself at step 5 of the first attempt."""
    import signal

    import torch

    from unison import Checkpoint
    from unison.distributed import num_distrib, rank_distrib

    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def kill(learn):
        kill.steps = getattr(kill, "steps", 0) + 1
        if args.kill and first and kill.steps == 5 and rank_distrib() == num_distrib() - 1:
            os.kill(os.getpid(), signal.SIGKILL)

    learn = _learner(bs=8, path=args.dir, dropout=0.2, cbs=[Checkpoint(every=1)])
    with _quiet(), learn.distrib_ctx():
        learn.fit(2, resume=True, cbs=[_Probe(kill, event="after_step")])
    if rank_distrib() == 0:
        torch.save(_state(learn), os.path.join(args.dir, "final.pt"))
    return True, f"restart count {os.environ.get('TORCHELASTIC_RESTART_COUNT')}"


def case_preds_save_load(args):
    """get_preds on 2 GPUs equals one GPU's, in order; save on GPU, load mapped per GPU."""
    import torch

    learn = _learner(bs=8, path=args.dir)
    single = _learner(bs=8)
    single.model.cuda()
    expected, _ = single.get_preds()
    with _quiet(), learn.distrib_ctx():
        preds, targets = learn.get_preds()
        learn.save("gpu")
        learn.load("gpu")
        again, _ = learn.get_preds()
    _, valid = _data()
    in_order = torch.equal(targets.cpu(), valid.tensors[1])
    diff = float((preds.cpu() - expected.cpu()).abs().max())
    same = torch.equal(preds, again)
    return (
        in_order and diff < 1e-5 and same,
        f"{len(preds)} rows in order {in_order}, diff {diff:.1e}, reload same {same}",
    )


def case_stall(args):
    """Rank 1 stops inside a step: the job must end naming it, before NCCL's watchdog aborts."""
    from unison.distributed import rank_distrib

    def hang(learn):
        hang.steps = getattr(hang, "steps", 0) + 1
        if hang.steps == 3 and rank_distrib() == 1:
            time.sleep(10_000)

    learn = _learner(bs=8)
    with _quiet(), learn.distrib_ctx():
        learn.fit(2, cbs=[_Probe(hang, event="after_step")])
    return False, "the job finished although rank 1 hung"


def case_to_parallel(args):
    """to_parallel on 2 GPUs equals one GPU; bf16 replicas run under bf16 (not fp16)."""
    import torch
    from torch import nn

    from unison import MixedPrecision

    single = _learner(bs=16, sgd=True)
    single.model.cuda()
    with _quiet():
        single.fit(1)
    gpus = list(range(min(torch.cuda.device_count(), 2)))
    dp = _learner(bs=16, sgd=True)
    with _quiet(), dp.parallel_ctx(gpus):
        dp.fit(1)
    diff = _max_diff(_state(single), _state(dp))

    dtypes = set()

    class Record(nn.Module):
        def forward(self, x):
            dtypes.add(torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None)
            return x

    bf = _learner(bs=16, cbs=[MixedPrecision("bf16")])
    bf.model = nn.Sequential(Record(), *bf.model)
    with _quiet(), bf.parallel_ctx(gpus):
        bf.fit(1)
    ok = diff < 1e-4 and dtypes == {torch.bfloat16}
    return ok, f"max diff to one GPU {diff:.1e}, replica autocast dtypes {sorted(map(str, dtypes))}"


def case_rollback(args):
    """A refused setup (each rank holding other data) leaves the model, its optimizer state and the
    loss's weight on the CPU, where they were."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from unison import DataLoaders

    learn = _learner(bs=8, loss=nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0])))
    with _quiet():
        learn.fit(1)
    rank = int(os.environ["RANK"])
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(rank))  # not the same on every rank
    learn.dls = DataLoaders(DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8))
    try:
        with learn.distrib_ctx():
            refused = False
    except ValueError:
        refused = True
    places = {str(learn.device), str(learn.loss_func.weight.device)}
    places |= {str(v.device) for s in learn.opt.state.values() for v in s.values()}
    ok = refused and places == {"cpu"}
    return ok, f"refused {refused}, model / optimizer state / loss weight on {sorted(places)}"


def case_fsdp(args):
    """FSDP2 (`distrib_ctx(shard=True)`) on the GPUs equals one GPU at the global batch; bf16 learns."""
    import math

    import torch.distributed as dist

    seen = {}
    sharded = _learner(bs=8, sgd=True)
    with _quiet(), sharded.distrib_ctx(shard=True):
        seen["backend"] = dist.get_backend()
        seen["device"] = str(sharded.device)
        sharded.fit(2)
        world = dist.get_world_size()
    single = _learner(bs=8 * world, sgd=True)
    single.model.to(_device())
    with _quiet():
        single.fit(2)
    diff = _max_diff(_state(single), _state(sharded))
    low = _learner(bs=8)
    with _quiet(), low.distrib_ctx(shard=True, mixed_precision="bf16"):
        before = low.validate()[0]
        low.fit(3)
        after = low.validate()[0]
    on_gpu = seen["device"].startswith("cuda")
    ok = seen["backend"] == "nccl" and on_gpu and diff < 1e-4 and math.isfinite(after) and after < before
    return ok, (
        f"{world} rank(s) on {seen['device']}, max diff to one GPU {diff:.1e}; "
        f"bf16 valid loss {before:.3f} -> {after:.3f}"
    )


def case_run_loop(args):
    """An own loop on `unison.Run` (DDP, exact BatchNorm) equals a plain one-GPU loop at the global batch."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    import unison

    def model_and_opt():
        model = _learner(bs=8).model  # the rows' model: Linear, BatchNorm, ReLU, Dropout(0), Linear
        return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

    train, _ = _data()
    model, opt = model_and_opt()
    with unison.Run() as run:
        model, opt = run.setup(model, opt)
        loader = run.loader(DataLoader(train, batch_size=8))
        for _ in run.epochs(2):
            model.train()
            for xb, yb in loader:
                run.backward(run.loss(F.cross_entropy(model(xb), yb, reduction="sum"), count=len(yb)))
                opt.step()
                opt.zero_grad()
        device, world = str(run.device), run.world_size
        got = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    plain, plain_opt = model_and_opt()
    plain.to(_device()).train()
    for _ in range(2):
        for xb, yb in DataLoader(train, batch_size=8 * world):
            F.cross_entropy(plain(xb.to(_device())), yb.to(_device())).backward()
            plain_opt.step()
            plain_opt.zero_grad()
    diff = _max_diff(got, plain.state_dict())
    detail = f"{world} rank(s) on {device}, max diff to a plain loop {diff:.1e}"
    return device.startswith("cuda") and diff < 1e-4, detail


class _Probe:
    """A callback calling `fn(learn)` at one event (built lazily: unison is imported in workers only)."""

    def __new__(cls, fn, event="after_batch"):
        from unison import Callback

        probe = type("Probe", (Callback,), {"order": 95, event: lambda self: fn(self.learn)})
        return probe()


CASES = {
    "ddp_syncbn": case_ddp_syncbn,
    "one_gpu": case_one_gpu,
    "mapping": case_mapping,
    "fp16": case_fp16,
    "bf16": case_bf16,
    "resumable": case_resumable,
    "preds_save_load": case_preds_save_load,
    "stall": case_stall,
    "to_parallel": case_to_parallel,
    "rollback": case_rollback,
    "fsdp": case_fsdp,
    "run_loop": case_run_loop,
}


def worker(args) -> None:
    ok, detail = CASES[args.case](args)
    if os.environ.get("RANK", "0") == "0":
        print(f"GPUCHECK {args.case} {'PASS' if ok else 'FAIL'} {detail}", flush=True)


# ---- the driver -----------------------------------------------------------------------------------
FORK_SPAWN = textwrap.dedent(
    """
    import torch, unison
    from benchmarks.gpu_check import _learner, _quiet
    assert not torch.cuda.is_initialized()

    def train():  # defined in an interactive __main__: spawn forks
        learn = _learner(bs=8)
        with _quiet(), learn.distrib_ctx():
            learn.fit(1)
            preds, _ = learn.get_preds()
        return str(learn.device), preds  # preds on the GPU: must come back on the CPU

    device, preds = unison.spawn(train, min(torch.cuda.device_count(), 2))
    ok = device == "cuda:0" and preds.device.type == "cpu" and not torch.cuda.is_initialized()
    print(f"GPUCHECK fork_spawn {'PASS' if ok else 'FAIL'} worker device {device}, result on {preds.device}, "
          f"parent CUDA initialised {torch.cuda.is_initialized()}")
    """
)


def _run(cmd, timeout=300, env=None):
    start = time.monotonic()
    try:
        out = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
        )
        return out.returncode, out.stdout + out.stderr, time.monotonic() - start
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return 124, text + f"\n(timed out after {timeout} s)", time.monotonic() - start


def _verdict(name, rc, text):
    found = re.search(rf"GPUCHECK {name} (PASS|FAIL) (.*)$", text, re.M)
    if rc == 0 and found:
        return found.group(1), found.group(2)
    tail = " | ".join(text.strip().splitlines()[-3:])
    return "FAIL", f"exit code {rc}: {tail[-300:]}"


def _launch_row(name, gpus, tmp, script_extra=()):
    work = Path(tmp) / name
    work.mkdir(parents=True, exist_ok=True)
    cmd = [*LAUNCH, "--gpus", gpus, str(HERE), "--case", name, "--dir", str(work), *script_extra]
    rc, text, _ = _run(cmd)
    return _verdict(name, rc, text)


def _kill_and_resume(tmp, gpus):
    import torch

    ref, run = Path(tmp) / "ref", Path(tmp) / "killed"
    for d in (ref, run):
        d.mkdir(parents=True, exist_ok=True)
    rc1, text1, _ = _run([*LAUNCH, "--gpus", gpus, str(HERE), "--case", "resumable", "--dir", str(ref)])
    rc2, text2, _ = _run(
        [
            *LAUNCH,
            "--gpus",
            gpus,
            "--max-restarts",
            "1",
            str(HERE),
            "--case",
            "resumable",
            "--kill",
            "--dir",
            str(run),
        ]
    )
    if rc1 or rc2 or not (run / "final.pt").exists():
        return (
            "FAIL",
            f"exit codes {rc1}, {rc2}: {' | '.join((text1 + text2).strip().splitlines()[-3:])[-300:]}",
        )
    a, b = torch.load(ref / "final.pt"), torch.load(run / "final.pt")
    restarted = "restart count 1" in text2
    diff = _max_diff(a, b)
    return (
        "PASS" if diff == 0 and restarted else "FAIL"
    ), f"restarted {restarted}, max diff to uninterrupted {diff:.1e}"


def _stall(tmp):
    timeout = 15
    cmd = [*LAUNCH, "--gpus", "0,1", "--timeout", str(timeout), str(HERE), "--case", "stall", "--dir", tmp]
    rc, text, took = _run(cmd, timeout=240)
    named = re.search(r"RankStalledError: rank 1 ", text) is not None
    return ("PASS" if rc != 0 and named else "FAIL"), f"exit {rc} after {took:.0f} s, rank 1 named: {named}"


def _fork_spawn():
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    rc, text, _ = _run([sys.executable, "-c", FORK_SPAWN], env={"PYTHONPATH": path})
    return _verdict("fork_spawn", rc, text)


def driver(only: set[str] | None) -> int:
    try:
        import torch
    except ImportError:
        print("gpu-check: torch is not installed")
        return 1
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here: skipped (it runs only on a machine with GPUs)")
        return 0
    n = torch.cuda.device_count()
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(min(n, 2))]
    # (row, GPUs it needs, what it checks); rows needing 1 use two GPUs where there are two.
    rows = [
        ("one_gpu", 1, "--gpus 1 (0 on one GPU): model, AdamW state, loss weight moved"),
        ("fp16", 1, "fp16 + GradScaler + clipping"),
        ("ddp_syncbn", 1, "NCCL DDP + SyncBatchNorm = one GPU"),
        ("bf16", 1, "bf16 under NCCL DDP"),
        ("fsdp", 1, "FSDP2 (shard=True) = one GPU; bf16 learns"),
        ("run_loop", 1, "own loop on unison.Run = a plain loop"),
        ("mapping", 2, "--gpus 1,0 maps rank 0 to GPU 1"),
        ("kill_resume", 1, "kill the last rank, --max-restarts 1, bit-exact resume"),
        ("fork_spawn", 1, "unison.spawn of a notebook function (fork)"),
        ("to_parallel", 1, "to_parallel = one GPU; bf16 replicas"),
        ("preds_save_load", 1, "get_preds / save / load on the GPUs"),
        ("rollback", 2, "a refused distrib_ctx leaves everything on the CPU"),
        ("stall", 2, "a hung rank is named (NCCL)"),
    ]
    all_gpus = "0,1" if n > 1 else "0"
    results = []
    with tempfile.TemporaryDirectory(prefix="unison-gpu-check-") as tmp:
        for name, needs, what in rows:
            if only and name not in only:
                continue
            if n < needs:
                results.append((name, what, "SKIP", f"needs {needs} GPUs, {n} here"))
                continue
            print(f"gpu-check: {name} ...", flush=True)
            if name == "one_gpu":
                verdict = _launch_row(name, "1" if n > 1 else "0", tmp)
            elif name == "fp16":
                verdict = _launch_row(name, "0", tmp)
            elif name == "mapping":
                verdict = _launch_row(name, "1,0", tmp, script_extra=("--expect", f"{uuids[1]},{uuids[0]}"))
            elif name == "kill_resume":
                verdict = _kill_and_resume(tmp, all_gpus)
            elif name == "fork_spawn":
                verdict = _fork_spawn()
            elif name == "to_parallel":
                rc, text, _ = _run([sys.executable, str(HERE), "--case", "to_parallel", "--dir", tmp])
                verdict = _verdict(name, rc, text)
            elif name == "stall":
                verdict = _stall(tmp)
            else:
                verdict = _launch_row(name, all_gpus, tmp)
            results.append((name, what, *verdict))
    print(f"\nunison GPU self-check on {n} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}\n")
    if n == 1:
        print("(one GPU: the multi-process rows ran one NCCL rank; mapping, rollback and stall need two)\n")
    print(f"| {'row':<16} | {'what':<58} | result | detail")
    print(f"|{'-' * 18}|{'-' * 60}|--------|-------")
    for name, what, verdict, detail in results:
        print(f"| {name:<16} | {what:<58} | {verdict:<6} | {detail}")
    return 1 if any(r[2] == "FAIL" for r in results) else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", choices=sorted(CASES), help="(internal) run one row inside a worker")
    parser.add_argument("--dir", default=".", help="(internal) the row's working directory")
    parser.add_argument("--kill", action="store_true", help="(internal) resumable: rank 1 kills itself")
    parser.add_argument("--expect", default="", help="(internal) mapping: the GPU uuids by rank")
    parser.add_argument("--only", default="", help="comma-separated rows to run (default: all)")
    args = parser.parse_args()
    if args.case:
        worker(args)
        return 0
    return driver(set(args.only.split(",")) if args.only else None)


if __name__ == "__main__":
    sys.exit(main())
