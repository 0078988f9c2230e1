"""Resume: a run stopped at any batch and resumed ends with the weights of an uninterrupted run."""

import contextlib
import io
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Callback, Checkpoint, CheckpointError, DataLoaders, Learner, set_seed
from unison.checkpoint.callback import GlobalBatchChangedWarning

N_TRAIN, EPOCHS = 48, 2


class Stop(Exception):
    """Stands for a crash: not a cancel exception, so fit ends at once."""


class StopAt(Callback):
    order = 95  # after Checkpoint wrote this batch's state

    def __init__(self, at):
        self.at, self.count = at, 0

    def after_batch(self):
        if self.learn.training:
            self.count += 1
            if self.count == self.at:
                raise Stop()


def _learner(path, bs, init_seed=0, dropout=0.2):
    set_seed(init_seed)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N_TRAIN + 20, 5, generator=g)
    y = (x.sum(1) > 0).long()
    dls = DataLoaders(
        DataLoader(TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=bs, shuffle=True),
        DataLoader(TensorDataset(x[N_TRAIN:], y[N_TRAIN:]), batch_size=8),
    )
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 2))
    learn = Learner(dls, model, nn.CrossEntropyLoss(), lr=1e-2, path=path, cbs=[Checkpoint(every=1)])
    learn.data_seed = 1234  # the data order of the run (a resumed run takes it from the checkpoint)
    return learn


def _fit(learn, cbs=(), resume=False):
    with contextlib.redirect_stdout(io.StringIO()):
        learn.fit_one_cycle(EPOCHS, lr_max=1e-2, cbs=cbs, resume=resume)


def _weights(learn):
    return {k: v.detach().clone() for k, v in learn.raw_model.state_dict().items()}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def _stop_and_resume_everywhere(path, bs, distributed):
    """Final weights of the uninterrupted run, and whether each stop-and-resume matched them bit for bit."""
    ctx = (lambda learn: learn.distrib_ctx()) if distributed else (lambda learn: contextlib.nullcontext())
    reference = _learner(path / "ref", bs)
    with ctx(reference):
        _fit(reference)
    n_steps = EPOCHS * len(reference.dls.train) // (dist.get_world_size() if distributed else 1)
    matches, valid_matches = [], []
    for at in range(1, n_steps):
        run_dir = path / f"stop{at}"
        first = _learner(run_dir, bs)
        with ctx(first), pytest.raises(Stop):
            _fit(first, cbs=[StopAt(at)])
        resumed = _learner(run_dir, bs, init_seed=99)  # a fresh process would start from other weights
        resumed.data_seed = 5  # ... and another seed: the checkpoint must restore both
        with ctx(resumed):
            _fit(resumed, resume=True)
        matches.append(_same(_weights(reference), _weights(resumed)))
        valid_matches.append(
            resumed.recorder.values == reference.recorder.values
            # each batch's loss over the ranks, those resumed from the checkpoint's part of an epoch too
            and resumed.recorder.losses == reference.recorder.losses
        )
    return n_steps, matches, valid_matches


def test_stop_at_every_batch_and_resume_one_process(tmp_path):
    n_steps, matches, recorder_matches = _stop_and_resume_everywhere(tmp_path, 8, distributed=False)
    assert n_steps == 12 and all(matches), matches
    assert all(recorder_matches)  # the epoch table too, partial epochs included


def test_stop_at_every_batch_and_resume_two_processes(pool2, tmp_path):
    for n_steps, matches, recorder_matches in pool2.run(_stop_and_resume_everywhere, tmp_path, 8, True):
        assert n_steps == 6 and all(matches), matches
        assert all(recorder_matches)


def _two_then_one(path, at):
    """Run on 2 processes at batch 8, stop; rank 0 resumes alone at batch 16."""
    reference = _learner(path / "ref", 8, dropout=0.0)
    with reference.distrib_ctx():
        _fit(reference)
    first = _learner(path / "run", 8, dropout=0.0)
    with first.distrib_ctx(), pytest.raises(Stop):
        _fit(first, cbs=[StopAt(at)])
    if dist.get_rank() != 0:
        return None
    alone = _learner(path / "run", 16, init_seed=7, dropout=0.0)
    _fit(alone, resume=True)
    a, b = _weights(reference), _weights(alone)
    return max(float((a[k] - b[k]).abs().max()) for k in a), alone.recorder.values, reference.recorder.values


def test_resume_on_fewer_processes_with_the_same_global_batch(pool2, tmp_path):
    diff, got, expected = pool2.run(_two_then_one, tmp_path, 4)[0]
    assert diff < 1e-5
    assert len(got) == len(expected) == EPOCHS
    assert all(
        abs(g - e) < 1e-5
        for row_g, row_e in zip(got, expected, strict=True)
        for g, e in zip(row_g, row_e, strict=True)
    )


def test_resume_with_another_global_batch_mid_epoch_is_refused(tmp_path):
    first = _learner(tmp_path, 8)
    with pytest.raises(Stop):
        _fit(first, cbs=[StopAt(3)])  # 24 samples into epoch 0
    other = _learner(tmp_path, 16)
    before = _weights(other)
    with pytest.raises(CheckpointError, match="not a whole number of global batches of 16"):
        _fit(other, resume=True)
    assert _same(before, _weights(other))  # refused before anything changed


def test_resume_at_another_global_batch_says_so_in_one_warning(tmp_path):
    """An elastic job that lost a node resumes at a smaller global batch: allowed, never silent."""
    first = _learner(tmp_path, 8)
    with pytest.raises(Stop):
        _fit(first, cbs=[StopAt(6)])  # 48 samples: the end of epoch 0, a whole number of batches of 16
    other = _learner(tmp_path, 16)
    with pytest.warns(GlobalBatchChangedWarning, match="global batch of 16 .* the interrupted run had 8"):
        _fit(other, resume=True)
    same = _learner(tmp_path / "same", 8)
    with pytest.raises(Stop):
        _fit(same, cbs=[StopAt(3)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", GlobalBatchChangedWarning)
        _fit(_learner(tmp_path / "same", 8), resume=True)  # the same global batch: no warning


def test_resume_without_a_checkpoint_starts_fresh(tmp_path):
    a = _learner(tmp_path / "a", 8)
    _fit(a)
    b = _learner(tmp_path / "b", 8)  # made after a's fit: the same RNG state when it starts
    _fit(b, resume=True)
    assert _same(_weights(a), _weights(b))


class SeeFile(Callback):
    def __init__(self, file):
        self.file, self.seen = file, []

    def before_epoch(self):
        self.seen.append(self.file.exists())


@pytest.mark.procs
def test_resume_removes_the_temp_file_a_killed_save_left(tmp_path):
    first = _learner(tmp_path, 8)
    with pytest.raises(Stop):
        _fit(first, cbs=[StopAt(3)])
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / "models" / f".checkpoint.pth.{int(gone.stdout)}.0123456789ab.tmp"  # its writer is dead
    stale.write_bytes(b"PK" + b"\0" * 4096)
    resumed = _learner(tmp_path, 8)
    watch = SeeFile(stale)
    _fit(resumed, cbs=[watch], resume=True)
    assert watch.seen[0] is False  # already gone when training resumed, before any new save


def test_resume_needs_a_checkpoint_callback(tmp_path):
    learn = _learner(tmp_path, 8)
    learn.remove_cb(Checkpoint)
    with pytest.raises(ValueError, match="needs a Checkpoint callback"):
        learn.fit(1, resume=True)


def test_damaged_checkpoint_is_refused_and_nothing_changes(tmp_path):
    learn = _learner(tmp_path, 8)
    with pytest.raises(Stop):
        _fit(learn, cbs=[StopAt(2)])
    good = learn.get_cb(Checkpoint).file
    data = good.read_bytes()
    fresh = _learner(tmp_path, 8, init_seed=5)
    before = _weights(fresh)
    ckpt = fresh.get_cb(Checkpoint)
    step = max(1, len(data) // 150)
    for cut in list(range(0, len(data), step)) + [len(data) - 1]:
        good.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="damaged or truncated|not a unison checkpoint"):
            ckpt.restore_latest()
        assert _same(before, _weights(fresh))
    good.write_bytes(data)
    assert ckpt.restore_latest() and not _same(before, _weights(fresh))


class _Payload:
    pass


def test_checkpoint_holding_a_pickled_object_is_refused(tmp_path):
    learn = _learner(tmp_path, 8)
    learn.get_cb(Checkpoint).file.parent.mkdir(parents=True)
    torch.save({"unison_format": 1, "kind": "checkpoint", "model": _Payload()}, learn.get_cb(Checkpoint).file)
    with pytest.raises(CheckpointError, match="not plain tensors"):
        learn.fit(1, resume=True)


def _write_on_two(path, at):
    reference = _learner(path / "ref", 6, dropout=0.0)
    with reference.distrib_ctx():
        _fit(reference)
    first = _learner(path / "run", 6, dropout=0.0)
    with first.distrib_ctx(), pytest.raises(Stop):
        _fit(first, cbs=[StopAt(at)])
    return _weights(reference), reference.recorder.values


def _resume_on_three(path):
    resumed = _learner(path / "run", 4, init_seed=7, dropout=0.0)  # 3 x 4: the global batch of 2 x 6
    with resumed.distrib_ctx():
        _fit(resumed, resume=True)
    return _weights(resumed), resumed.recorder.values


def test_resume_on_more_processes_mid_epoch(pool2, pool3, tmp_path):
    # Rank 0 takes the partial epoch's loss sums of both writers, ranks 1-2 start empty: their
    # epoch sums must still have one dtype, or the all-reduce of the train loss mismatches.
    reference, expected = pool2.run(_write_on_two, tmp_path, 2)[0]
    for weights, got in pool3.run(_resume_on_three, tmp_path):
        assert max(float((reference[k] - weights[k]).abs().max()) for k in reference) < 1e-5
        assert all(
            abs(g - e) < 1e-5
            for row_g, row_e in zip(got, expected, strict=True)
            for g, e in zip(row_g, row_e, strict=True)
        )


class CountSteps(Callback):
    def __init__(self):
        self.steps = 0

    def after_step(self):
        self.steps += 1


def _fit_into(path):
    """(error message, steps trained) of a fit whose checkpoints go to `path`."""
    learn, counter = _learner(path, 6), CountSteps()
    try:
        with learn.distrib_ctx():
            _fit(learn, cbs=[counter])
    except CheckpointError as exc:
        return str(exc), counter.steps
    return None, counter.steps


def test_a_checkpoint_folder_that_cannot_be_written_is_refused_before_the_first_step(tmp_path):
    """A read-only folder used to be found at the first save, after a step had trained (OSError:
    [Errno 30] from inside the save); now before any step, in one line naming the folder and errno."""
    from tests.fault_scripts import disks

    with disks.read_only(tmp_path / "ro") as folder:
        message, steps = _fit_into(folder)
    assert steps == 0, message
    assert message is not None and "\n" not in message
    assert f"{folder / 'models'}" in message and "[Errno 30] Read-only file system" in message, message


def test_every_rank_refuses_an_unwritable_checkpoint_folder_before_the_first_step(pool2, tmp_path):
    """Rank 0 writes the checkpoints and finds the folder read-only: every rank raises the same
    error before the first step, none is left waiting in a collective."""
    from tests.fault_scripts import disks

    with disks.read_only(tmp_path / "ro") as folder:
        results = pool2.run(_fit_into, folder)
    assert [steps for _, steps in results] == [0, 0]
    messages = {message for message, _ in results}
    assert len(messages) == 1 and "[Errno 30] Read-only file system" in messages.pop()
