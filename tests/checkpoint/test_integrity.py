"""Sharded (DCP) checkpoints carry a checksum of every file: damage is refused before anything loads.

A real 2-process sharded run writes the checkpoint; each test damages a copy the way a disk
or a copy tool would (flipped bytes, a cut, a lost file) and resumes it on 1 and 2 processes.
"""

import shutil
import sys
import time
import warnings
import zlib
from pathlib import Path

import pytest
import torch.distributed as dist
from torch import nn

from tests.checkpoint.test_callback import Stop, StopAt
from tests.checkpoint.test_sharded import _fit, _learner, _max_diff, _weights
from tests.hangs import run_or_report
from unison import Checkpoint, CheckpointError
from unison.checkpoint.format import atomic_save, safe_load
from unison.checkpoint.sharded import META_FILE, read_meta, save_sharded
from unison.distributed import Collective

FOLDER = ("models", "checkpoint.dcp")
SCRIPT = Path(__file__).resolve().parents[1] / "fault_scripts" / "sharded_resumable.py"


def _flip(file, n=16):
    """Flip every bit of `n` bytes in the middle of `file`, as in the report."""
    data = bytearray(file.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + n):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def _cut(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


DAMAGES = {  # what is done, to which file of the checkpoint
    "flipped shard": ("__0_0.distcp", _flip),
    "flipped other shard": ("__1_0.distcp", _flip),
    "truncated shard": ("__1_0.distcp", _cut),
    "missing shard": ("__0_0.distcp", lambda f: f.unlink()),
    "missing .metadata": (".metadata", lambda f: f.unlink()),
    "flipped .metadata": (".metadata", _flip),
}


def _learner_keeping(path, bs, init_seed=0, keep_previous=False):
    learn = _learner(path, bs, init_seed)
    if keep_previous:
        learn.remove_cb(Checkpoint)
        learn.add_cb(Checkpoint(every=1, keep_previous=True))
    return learn


def _write_on_two(path, at, keep_previous=False):
    """An uninterrupted sharded run's weights (rank 0), and a run stopped after `at` steps."""
    reference = _learner(path / "ref", 12)
    with reference.distrib_ctx(shard=True):
        _fit(reference)
    first = _learner_keeping(path / "run", 12, keep_previous=keep_previous)
    with first.distrib_ctx(shard=True), pytest.raises(Stop):
        _fit(first, cbs=[StopAt(at)])
    return _weights(reference) if dist.get_rank() == 0 else None


def _resume_sharded(run_dir, keep_previous=False):
    """Resume on this pool's processes, sharded: (error or None, weights after, initial weights)."""
    learn = _learner_keeping(run_dir, 12, init_seed=7, keep_previous=keep_previous)
    initial = _weights(learn)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with learn.distrib_ctx(shard=True):
            try:
                _fit(learn, resume=True)
            except CheckpointError as exc:
                error = str(exc)
    warned = [str(w.message) for w in caught if "checkpoint" in str(w.message)]
    return error, _weights(learn), initial, warned


def _step_once_sharded(run_dir):
    """Resume sharded keeping the previous checkpoint, train one step (one save), stop: the warnings."""
    learn = _learner_keeping(run_dir, 12, init_seed=7, keep_previous=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with learn.distrib_ctx(shard=True), pytest.raises(Stop):
            _fit(learn, cbs=[StopAt(1)], resume=True)
    return [str(w.message) for w in caught if "checkpoint" in str(w.message)]


def _resume_alone(run_dir, keep_previous=False):
    """Resume on this one process (no group, a plain model, the same global batch of 24)."""
    learn = _learner_keeping(run_dir, 24, init_seed=7, keep_previous=keep_previous)
    initial = _weights(learn)
    try:
        _fit(learn, resume=True)
    except CheckpointError as exc:
        return str(exc), _weights(learn), initial
    return None, _weights(learn), initial


@pytest.fixture(scope="module")
def two_rank_checkpoint(pool2, tmp_path_factory):
    """(folder of a 2-process run stopped mid-epoch, the uninterrupted run's weights)."""
    root = tmp_path_factory.mktemp("sharded_integrity")
    reference = pool2.run(_write_on_two, root, 3)[0]
    return root / "run", reference


def _damaged_copy(run, dest, what):
    shutil.copytree(run, dest)
    name, damage = DAMAGES[what]
    damage(dest.joinpath(*FOLDER, name))
    return name


@pytest.mark.parametrize("what", list(DAMAGES))
def test_a_damaged_sharded_checkpoint_is_refused_naming_the_file(what, two_rank_checkpoint, pool2, tmp_path):
    run, reference = two_rank_checkpoint
    saved = sorted(p.name for p in run.joinpath(*FOLDER).iterdir())
    assert saved == [".metadata", "__0_0.distcp", "__1_0.distcp", META_FILE]
    # The intact copy resumes onto the uninterrupted weights (the control).
    error, weights, _ = _resume_alone(shutil.copytree(run, tmp_path / "intact"))
    assert error is None and _max_diff(reference, weights) < 1e-5
    # One process: refused in one line naming the file, before anything was loaded.
    name = _damaged_copy(run, tmp_path / "alone", what)
    error, weights, initial = _resume_alone(tmp_path / "alone")
    assert error is not None, (
        f"{what}: the damaged checkpoint loaded ({_max_diff(reference, weights):.1e} away)"
    )
    assert name in error and "refused" in error and "\n" not in error, error
    assert _max_diff(initial, weights) == 0
    # Two processes: each checks its share of the files, and both refuse with the same line
    # (only one of them read the damaged file: the verdict is agreed, no rank hangs).
    _damaged_copy(run, tmp_path / "two", what)
    results = pool2.run(_resume_sharded, tmp_path / "two", timeout=120)
    assert [r[0] for r in results] == [error.replace(str(tmp_path / "alone"), str(tmp_path / "two"))] * 2
    for _, weights, initial, _ in results:
        assert _max_diff(initial, weights) == 0


def test_flipped_bytes_are_named_as_such(two_rank_checkpoint, tmp_path):
    run, _ = two_rank_checkpoint
    _damaged_copy(run, tmp_path / "c", "flipped shard")
    error, _, _ = _resume_alone(tmp_path / "c")
    assert error == (
        f"{tmp_path / 'c' / 'models' / 'checkpoint.dcp'} is damaged: __0_0.distcp fails its checksum "
        "(CRC32 mismatch: its bytes changed since the save), refused"
    )


def test_the_manifest_holds_each_files_crc32(tmp_path):
    """The checksums written are those of the bytes on disk, computed here independently."""
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 4))
    folder = save_sharded(tmp_path / "c.dcp", model, None, {"step": 1}, Collective())
    record = safe_load(folder / META_FILE, kind="sharded")
    on_disk = {p.name: p.read_bytes() for p in folder.iterdir() if p.name != META_FILE}
    assert record["checksum"] == "crc32"
    assert record["checksums"] == {n: f"{zlib.crc32(b):08x}" for n, b in on_disk.items()}
    assert record["files"] == {n: len(b) for n, b in on_disk.items()}
    assert read_meta(folder) == {"step": 1}
    _flip(folder / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp fails its checksum"):
        read_meta(folder)


def test_a_checkpoint_without_checksums_loads_with_a_warning(two_rank_checkpoint, tmp_path):
    """Written by an older unison (sizes only): it loads, saying that bit flips cannot be seen."""
    run, reference = two_rank_checkpoint
    copy = shutil.copytree(run, tmp_path / "old")
    meta_file = copy.joinpath(*FOLDER, META_FILE)
    record = safe_load(meta_file)
    del record["checksums"], record["checksum"]
    atomic_save(record, meta_file)
    with pytest.warns(UserWarning, match="older unison.*no checksums"):
        error, weights, _ = _resume_alone(copy)
    assert error is None and _max_diff(reference, weights) < 1e-5


def test_keep_previous_resumes_from_the_previous_checkpoint_when_the_newest_is_damaged(pool2, tmp_path):
    reference = pool2.run(_write_on_two, tmp_path, 3, True)[0]
    run = tmp_path / "run"
    models = run / "models"
    assert sorted(p.name for p in models.iterdir()) == ["checkpoint.dcp", "checkpoint.prev.dcp"]
    # The previous folder is the step before: its position is one global batch earlier.
    assert read_meta(models / "checkpoint.dcp")["samples_done"] == 3 * 24
    assert read_meta(models / "checkpoint.prev.dcp")["samples_done"] == 2 * 24
    # Newest damaged: resumed from the previous one, which also ends on the uninterrupted weights.
    for dest in ("alone", "two", "both", "not_kept"):
        shutil.copytree(run, tmp_path / dest)
        _flip(tmp_path / dest / "models" / "checkpoint.dcp" / "__1_0.distcp")
    with pytest.warns(UserWarning, match=r"__1_0\.distcp fails its checksum.*checkpoint\.prev\.dcp"):
        error, weights, _ = _resume_alone(tmp_path / "alone", keep_previous=True)
    assert error is None and _max_diff(reference, weights) < 1e-5
    # On 2 sharded processes: one more step, one more save, then stopped again.
    warned = pool2.run(_step_once_sharded, tmp_path / "two", timeout=120)
    assert any("checkpoint.prev.dcp" in w for w in warned[0]) and not warned[1]  # one voice
    # That save replaced the refused folder and kept the good one it resumed from as the previous.
    models = tmp_path / "two" / "models"
    assert read_meta(models / "checkpoint.prev.dcp")["samples_done"] == 2 * 24
    assert read_meta(models / "checkpoint.dcp")["samples_done"] == 3 * 24
    for error, weights, _, warned in pool2.run(_resume_sharded, tmp_path / "two", True, timeout=120):
        assert error is None and _max_diff(reference, weights) < 1e-5 and not warned
    # Both damaged: refused, naming both.
    _flip(tmp_path / "both" / "models" / "checkpoint.prev.dcp" / "__0_0.distcp")
    error, _, _ = _resume_alone(tmp_path / "both", keep_previous=True)
    assert error is not None and "checkpoint.dcp is damaged: __1_0.distcp" in error, error
    assert "previous checkpoint is refused too" in error and "prev.dcp is damaged: __0_0.distcp" in error
    # Without keep_previous the damaged newest is refused, never replaced by the previous one.
    error, _, _ = _resume_alone(tmp_path / "not_kept")
    assert (
        error is not None
        and "__1_0.distcp fails its checksum" in error
        and "previous checkpoint" not in error
    )


def test_keep_previous_works_the_same_for_a_plain_checkpoint(tmp_path):
    """A plain `checkpoint.pth` (one process): the same knob keeps `checkpoint.prev.pth`, used when asked."""
    from tests.checkpoint import test_callback as plain

    reference = plain._learner(tmp_path / "ref", 8, dropout=0)
    plain._fit(reference)
    first = plain._learner(tmp_path / "run", 8, dropout=0)
    first.remove_cb(Checkpoint)
    first.add_cb(Checkpoint(every=1, keep_previous=True))
    with pytest.raises(Stop):
        plain._fit(first, cbs=[StopAt(3)])
    models = tmp_path / "run" / "models"
    assert sorted(p.name for p in models.iterdir()) == ["checkpoint.prev.pth", "checkpoint.pth"]
    assert safe_load(models / "checkpoint.prev.pth")["samples_done"] == 2 * 8
    shutil.copytree(tmp_path / "run", tmp_path / "not_kept")
    _flip(models / "checkpoint.pth", n=4)
    _flip(tmp_path / "not_kept" / "models" / "checkpoint.pth", n=4)
    resumed = plain._learner(tmp_path / "run", 8, init_seed=5, dropout=0)
    resumed.remove_cb(Checkpoint)
    resumed.add_cb(Checkpoint(every=1, keep_previous=True))
    with pytest.warns(UserWarning, match=r"checkpoint\.pth is damaged.*previous checkpoint .*prev\.pth"):
        with pytest.raises(Stop):
            plain._fit(resumed, cbs=[StopAt(1)], resume=True)  # one more step, one more save
    # That save replaced the refused file and kept the good one it resumed from as the previous.
    assert safe_load(models / "checkpoint.prev.pth")["samples_done"] == 2 * 8
    assert safe_load(models / "checkpoint.pth")["samples_done"] == 3 * 8
    again = plain._learner(tmp_path / "run", 8, init_seed=6, dropout=0)
    plain._fit(again, resume=True)
    assert _max_diff(_weights(reference), _weights(again)) < 1e-6
    refused = plain._learner(tmp_path / "not_kept", 8, init_seed=5, dropout=0)
    with pytest.raises(CheckpointError, match="checkpoint.pth is damaged"):
        plain._fit(refused, resume=True)


def _launch(folder, nproc):
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", nproc, str(SCRIPT), "--dir", str(folder)]
    start = time.monotonic()
    proc = run_or_report(cmd, 180)
    return proc, time.monotonic() - start


@pytest.mark.launch
def test_a_launched_resume_of_a_flipped_checkpoint_fails_naming_the_file(tmp_path):
    """The reported run, through `unison launch`: 2 sharded processes write, 16 bytes flip, and the
    resume on 2 processes and on 1 ends non-zero with the file named, instead of rc 0."""
    done, _ = _launch(tmp_path, "2")
    assert done.returncode == 0, done.stderr[-3000:]
    _flip(tmp_path / "models" / "checkpoint.dcp" / "__0_0.distcp")
    expected = f"{tmp_path / 'models' / 'checkpoint.dcp'} is damaged: __0_0.distcp fails its checksum"
    for nproc in ("2", "1"):
        again, elapsed = _launch(tmp_path, nproc)
        assert again.returncode != 0 and "WEIGHTS" not in again.stdout, again.stdout[-2000:]
        assert f"CheckpointError: {expected}" in again.stderr, again.stderr[-3000:]
        assert elapsed < 90
