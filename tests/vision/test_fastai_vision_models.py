"""fastai's vision learners through the bridge (tests/scripts/fastai_vision_models.py), 2 processes
against the same script on one (W=1 under the bridge), float64:

- `vision_learner` with a torchvision body (resnet18) frozen before `distrib_ctx`, then `fine_tune`;
- `vision_learner` with a timm body (resnet10t) on `ImageDataLoaders.from_df`, `fit_one_cycle`, then
  `fine_tune` (frozen after DDP wrapped the model, then unfrozen);
- a `DataBlock` with augmentation and MixUp, rank 1 SIGKILLed mid-epoch and the job resumed from the
  checkpoint.

One launch (and one run on one process) makes all three; nothing is downloaded (`pretrained=False`).
DDP synchronises the parameters that required a gradient when it wrapped the model: without the
bridge wrapping it again when fine_tune unfreezes the body, rank 0 and rank 1 trained the body on
their own gradients and ended apart (and a body frozen after wrapping stopped DDP at its next
forward)."""

import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from fastai.vision.all import (
    ImageDataLoaders,
    Normalize,
    RandomResizedCrop,
    aug_transforms,
    get_image_files,
    imagenet_stats,
    set_seed,
)

from tests.test_fastai_idioms import launch, run
from tests.vision.images import write_image_folder
from unison.fastai import RankShardedFastaiDL

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "fastai_vision_models.py"
TOL = 1e-9  # float64 rounding (measured about 1e-13)


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("images") / "digits")


@pytest.fixture(scope="module")
def runs(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The script on one process, then on two with rank 1 killed at epoch 1, step 2 of the resume part
    (a checkpoint every 3 steps: the newest is mid-epoch, epoch 1 step 1) and restarted once."""
    tmp = tmp_path_factory.mktemp("models")
    homes = {name: tmp / name for name in ("TORCH_HOME", "HF_HOME")}  # (torchvision, timm)
    with pytest.MonkeyPatch.context() as env:
        for name, home in homes.items():  # (any download would land here)
            env.setenv(name, str(home))
        env.setenv("HF_HUB_OFFLINE", "1")
        run([sys.executable, str(SCRIPT), "--root", str(folder), "--out", str(tmp / "one")], cwd=tmp)
        proc = launch(
            2,
            tmp / "two",
            "--root",
            str(folder),
            "--kill-rank",
            "1",
            launch_args=("--max-restarts", "1"),
            script=SCRIPT,
        )
    one = torch.load(tmp / "one.rank0.pt", weights_only=False)
    two = [torch.load(tmp / f"two.rank{r}.pt", weights_only=False) for r in range(2)]
    downloaded = [p for home in homes.values() if home.exists() for p in home.rglob("*") if p.is_file()]
    return {"one": one, "two": two, "stderr": proc.stderr, "stdout": proc.stdout, "downloaded": downloaded}


@pytest.mark.launch
@pytest.mark.timeout(600)
@pytest.mark.parametrize("part", ["torchvision", "timm"])
def test_vision_learner_and_fine_tune_on_two_processes_end_on_one_processs_weights(
    runs: dict, part: str
) -> None:
    """Each fit of fine_tune (frozen body, then unfrozen; for timm a whole-model fit first) ends on one
    process's weights, BatchNorm included, and on the same weights on both ranks, bit for bit; the
    frozen fit trains fewer parameters than the unfrozen one, as on one process."""
    one, (r0, r1) = runs["one"][part], runs["two"]
    assert (
        [f["trainable"] for f in one]
        == [f["trainable"] for f in r0[part]]
        == [f["trainable"] for f in r1[part]]
    )
    frozen, unfrozen = one[-2]["trainable"], one[-1]["trainable"]
    assert (
        0
        < frozen
        < unfrozen
        == sum(1 for k in one[-1]["weights"] if "running" not in k and "num_batches" not in k)
    )
    for mine, rank0, rank1 in zip(one, r0[part], r1[part], strict=True):
        assert max_diff(rank0["weights"], rank1["weights"]) == 0.0
        assert max_diff(mine["weights"], rank0["weights"]) < TOL
    assert any("running_mean" in k for k in one[-1]["weights"])  # (BatchNorm's statistics compared too)
    assert not runs["downloaded"]  # pretrained=False: no weights fetched


@pytest.mark.launch
@pytest.mark.timeout(600)
def test_a_run_killed_mid_epoch_with_augmentation_resumes_to_one_processs_weights(runs: dict) -> None:
    """RandomResizedCrop, aug_transforms and MixUp, rank 1 SIGKILLed at epoch 1 step 2, the job
    restarted: it resumes from the mid-epoch checkpoint (epoch 1, step 1), draws the epoch's images
    again as they were first drawn and ends on the uninterrupted run's weights and recorder rows."""
    assert "restarting the workers" in runs["stderr"]
    one, (r0, r1) = runs["one"]["resume"], runs["two"]
    assert r0["attempt"] == r1["attempt"] == 1  # the resumed attempt wrote these
    assert max_diff(r0["resume"]["weights"], r1["resume"]["weights"]) == 0.0
    assert max_diff(one["weights"], r0["resume"]["weights"]) < TOL
    for mine, theirs in zip(one["values"], r0["resume"]["values"], strict=True):
        assert (
            max(abs(x - y) for x, y in zip(mine, theirs, strict=True)) < 1e-6
        )  # (fastai's smoother: float32)


def test_from_df_ranks_make_one_processs_rows(folder: Path) -> None:
    """ImageDataLoaders.from_df with item and batch augmentation: each of 2 ranks makes one
    process's rows of every step, bit for bit (in process, no group)."""
    files = sorted(get_image_files(folder))
    df = pd.DataFrame(
        {
            "name": [str(f.relative_to(folder)) for f in files],
            "label": [f.parent.name for f in files],
            "is_valid": [f.parent.parent.name == "valid" for f in files],
        }
    )

    def images(world: int) -> list[torch.Tensor]:
        set_seed(42)
        dls = ImageDataLoaders.from_df(
            df,
            folder,
            fn_col="name",
            label_col="label",
            valid_col="is_valid",
            bs=12 // world,
            item_tfms=RandomResizedCrop(24, min_scale=0.5),
            batch_tfms=[
                *aug_transforms(max_rotate=20, max_lighting=0.3),
                Normalize.from_stats(*imagenet_stats),
            ],
        )
        state = dls.train.rng.getstate()
        out = []
        for rank in range(world):
            dls.train.rng.setstate(state)
            out.append(torch.cat([x for x, _ in RankShardedFastaiDL(dls.train, rank, world, pad=False)]))
        return out

    (one,) = images(1)
    for rank, mine in enumerate(images(2)):
        steps = [one[k * 12 : (k + 1) * 12][rank::2] for k in range(len(one) // 12)]
        assert torch.equal(torch.cat(steps), mine)
