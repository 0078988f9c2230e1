"""Sharded checkpoints (torch.distributed.checkpoint): bit-exact resume, resharding, atomic saves."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# The same stand-in for a crash, the same fit (two one-cycle epochs) and weight snapshot.
from tests.checkpoint.test_callback import Stop, StopAt, _fit, _weights
from unison import Checkpoint, CheckpointError, DataLoaders, Learner, set_seed
from unison.checkpoint.sharded import export_state_dict, read_meta, save_sharded, sharded_path
from unison.distributed import Collective

N_TRAIN = 96
SAVER = Path(__file__).parent.parent / "fault_scripts" / "sharded_saver.py"


def _learner(path, bs, init_seed=0):
    set_seed(init_seed)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N_TRAIN + 20, 5, generator=g)
    y = (x.sum(1) > 0).long()
    dls = DataLoaders(
        DataLoader(TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=bs, shuffle=True),
        DataLoader(TensorDataset(x[N_TRAIN:], y[N_TRAIN:]), batch_size=8),
    )
    model = nn.Sequential(nn.Linear(5, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    learn = Learner(dls, model, nn.CrossEntropyLoss(), lr=1e-2, path=path, cbs=[Checkpoint(every=1)])
    learn.data_seed = 1234
    return learn


def _max_diff(a, b):
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _sharded_stop_and_resume(path, stops):
    """For each stop: whether the resumed sharded run matched the uninterrupted one bit for bit."""
    reference = _learner(path / "ref", 12)
    with reference.distrib_ctx(shard=True):
        _fit(reference)
    results = []
    for at in stops:
        run_dir = path / f"stop{at}"
        first = _learner(run_dir, 12)
        with first.distrib_ctx(shard=True), pytest.raises(Stop):
            _fit(first, cbs=[StopAt(at)])
        folder = sharded_path(first.get_cb(Checkpoint).file)
        resumed = _learner(run_dir, 12, init_seed=99)
        resumed.data_seed = 5
        with resumed.distrib_ctx(shard=True):
            _fit(resumed, resume=True)
        a, b = _weights(reference), _weights(resumed)
        results.append(
            {
                "folder": folder.is_dir() and not first.get_cb(Checkpoint).file.exists(),
                "exact": all(torch.equal(a[k], b[k]) for k in a),
                "recorder": resumed.recorder.values == reference.recorder.values,
            }
        )
    return results


def test_sharded_resume_is_bit_exact_mid_epoch(pool2, tmp_path):
    # 96 samples / (2 x 12) = 4 steps an epoch: stop mid-epoch 0, at its end, and mid-epoch 1
    for per_rank in pool2.run(_sharded_stop_and_resume, tmp_path, [2, 4, 6]):
        for r in per_rank:
            assert r["folder"] and r["exact"] and r["recorder"], per_rank


def _write_on_two(path, at):
    reference = _learner(path / "ref", 12)
    with reference.distrib_ctx(shard=True):
        _fit(reference)
    first = _learner(path / "run", 12)
    with first.distrib_ctx(shard=True), pytest.raises(Stop):
        _fit(first, cbs=[StopAt(at)])
    return _weights(reference) if dist.get_rank() == 0 else None


def _resume_on_three(path):
    resumed = _learner(path / "run", 8, init_seed=7)  # 3 x 8: the global batch of 2 x 12
    with resumed.distrib_ctx(shard=True):
        _fit(resumed, resume=True)
    return _weights(resumed)


def test_two_rank_checkpoint_resumes_on_one_and_three(pool2, pool3, tmp_path):
    reference = pool2.run(_write_on_two, tmp_path, 3)[0]
    saved = sorted(p.name for p in (tmp_path / "run" / "models" / "checkpoint.dcp").iterdir())
    assert saved == [".metadata", "__0_0.distcp", "__1_0.distcp", "unison.pth"]  # one file per rank's shards
    pristine = tmp_path / "pristine"
    subprocess.run(["cp", "-r", str(tmp_path / "run"), str(pristine)], check=True)
    # one plain process, no group, at batch 24
    alone = _learner(pristine, 24, init_seed=7)
    _fit(alone, resume=True)
    assert _max_diff(reference, _weights(alone)) < 1e-5
    # three sharded processes at batch 8
    for weights in pool3.run(_resume_on_three, tmp_path):
        assert _max_diff(reference, weights) < 1e-5


def _save_load_export(path):
    trained = _learner(path, 12)
    with trained.distrib_ctx(shard=True):
        _fit(trained)
        saved = trained.save("final")
    fresh = _learner(path, 12, init_seed=5)
    with fresh.distrib_ctx(shard=True):
        fresh.load("final")
    return {"saved": str(saved), "trained": _weights(trained), "loaded": _weights(fresh)}


def test_save_load_and_export_of_a_sharded_learner(pool2, tmp_path):
    results = pool2.run(_save_load_export, tmp_path)
    for r in results:
        assert r["saved"].endswith("final.dcp")
        assert _max_diff(r["trained"], r["loaded"]) == 0
    # one process reads the two-process save, with its optimizer state
    alone = _learner(tmp_path, 24, init_seed=5)
    alone.load("final")
    assert _max_diff(results[0]["trained"], _weights(alone)) == 0
    assert alone.opt is not None and len(alone.opt.state) == 5  # AdamW state of every parameter
    # a plain state_dict for inference, no process group needed
    out = export_state_dict(tmp_path / "models" / "final.dcp", tmp_path / "weights.pth")
    plain = torch.load(out, weights_only=True)
    model = _learner(tmp_path, 24, init_seed=11).model
    model.load_state_dict(plain)
    assert _max_diff(results[0]["trained"], model.state_dict()) == 0


def _write_plain(folder, value):
    model = nn.Linear(4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return save_sharded(folder, model, None, {"value": value}, Collective())


def test_torn_checkpoints_are_refused(tmp_path):
    folder = _write_plain(tmp_path / "c.dcp", 1.0)
    learn = _learner(tmp_path, 24)
    (folder / "__0_0.distcp").write_bytes((folder / "__0_0.distcp").read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="torn: __0_0.distcp should have"):
        read_meta(folder)
    (folder / "unison.pth").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        read_meta(folder)
    ok = _write_plain(tmp_path / "d.dcp", 1.0)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        read_meta(ok, learn.model)


@pytest.mark.procs
def test_a_killed_save_never_replaces_the_last_good_checkpoint(tmp_path):
    folder = tmp_path / "ckpt.dcp"
    for attempt in range(2):
        stale = set(folder.parent.glob(".ckpt.dcp.tmp-*"))  # left by the previous kill
        proc = subprocess.Popen([sys.executable, str(SAVER), str(folder)], stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        # Kill while a save is being written: its temporary folder exists beside a good checkpoint.
        while time.monotonic() < deadline:
            if folder.exists() and set(folder.parent.glob(".ckpt.dcp.tmp-*")) - stale:
                break
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        meta = read_meta(folder)  # complete, whatever the moment of the kill
        plain = export_state_dict(folder, tmp_path / f"w{attempt}.pth")
        weights = torch.load(plain, weights_only=True)
        assert all(torch.all(t == meta["value"]) for t in weights.values()), meta["value"]
        assert meta["value"] >= 1


def _plain_then_sharded(path):
    """A one-process run's checkpoint (a plain file) resumes on two sharded processes."""
    reference = _learner(path / "ref", 24)
    _fit(reference)
    if dist.get_rank() == 0:
        first = _learner(path / "run", 24)
        with pytest.raises(Stop):
            _fit(first, cbs=[StopAt(3)])
        first.save("plain")
    dist.barrier()
    resumed = _learner(path / "run", 12, init_seed=7)
    with resumed.distrib_ctx(shard=True):
        _fit(resumed, resume=True)
    loaded = _learner(path / "run", 12, init_seed=8)
    with loaded.distrib_ctx(shard=True):
        loaded.load("plain")
        has_opt_state = len(loaded.opt.state) == 5
    plain = torch.load(path / "run" / "models" / "plain.pth", weights_only=True)["model"]
    return (
        _max_diff(_weights(reference), _weights(resumed)),
        _max_diff(plain, _weights(loaded)),
        has_opt_state,
    )


def test_a_plain_checkpoint_resumes_sharded(pool2, tmp_path):
    for resumed_diff, loaded_diff, has_opt_state in pool2.run(_plain_then_sharded, tmp_path):
        assert resumed_diff < 1e-5 and loaded_diff == 0 and has_opt_state
