"""fastai vision through the bridge, exact with random augmentation: RandomResizedCrop per item,
aug_transforms and Normalize per batch, MixUp or CutMix, on a generated image folder. W processes
train on the very images one process (the same script under the bridge, W=1) does, and end on its
weights to float64 rounding; every rank on the same weights, bit for bit.

The in-process tests deal one loader's epoch as W ranks would (`RankShardedFastaiDL`, no process
group) and compare the images each rank makes with one process's rows, bit for bit."""

import sys
from pathlib import Path

import pytest
import torch
from fastai.vision.all import (
    Brightness,
    Flip,
    ImageDataLoaders,
    Normalize,
    RandomResizedCrop,
    aug_transforms,
    imagenet_stats,
    set_seed,
)

from tests.test_fastai_idioms import launch, run
from tests.vision.images import write_image_folder
from unison.fastai import RankShardedFastaiDL

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "fastai_vision.py"
TOL = 1e-9  # float64 rounding: the images are bit-equal, the sums over ranks are not ordered alike


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("images") / "digits")  # 48 training images, 32 px


def loaders(folder: Path, bs: int, workers: int = 0, batch_tfms=None):
    set_seed(42)
    return ImageDataLoaders.from_folder(
        folder,
        item_tfms=RandomResizedCrop(24, min_scale=0.5),
        batch_tfms=batch_tfms
        or [*aug_transforms(max_rotate=20, max_lighting=0.3), Normalize.from_stats(*imagenet_stats)],
        bs=bs,
        num_workers=workers,
    )


def epoch_images(folder: Path, world: int, workers: int = 0) -> list[torch.Tensor]:
    """Each rank's training images of the first epoch, when `world` ranks deal fastai's loader."""
    dls = loaders(folder, 12 // world, workers)
    state = dls.train.rng.getstate()  # (every rank builds its loader from the same seed)
    images = []
    for rank in range(world):
        dls.train.rng.setstate(state)
        images.append(torch.cat([x for x, _ in RankShardedFastaiDL(dls.train, rank, world, pad=False)]))
    return images


@pytest.mark.parametrize("world, workers", [(2, 0), (3, 0), (2, 2)])
def test_every_rank_makes_the_rows_one_process_makes(folder: Path, world: int, workers: int) -> None:
    """Rank r's images of an epoch are one process's rows r, r+W, ... bit for bit (item crop, flips,
    rotation, zoom, warp, lighting), DataLoader workers or not."""
    (one,) = epoch_images(folder, 1)
    ranks = epoch_images(folder, world, workers)
    for rank, mine in enumerate(ranks):
        steps = [one[k * 12 : (k + 1) * 12][rank::world] for k in range(len(one) // 12)]
        assert torch.equal(torch.cat(steps), mine)


def test_a_random_transform_before_collation_is_refused_on_w_processes(folder: Path) -> None:
    """fastai's before_batch sees a rank's list of items: a random transform there cannot draw as one
    process does, and is refused, named, before anything loads."""
    dls = loaders(folder, 6, batch_tfms=[Normalize.from_stats(*imagenet_stats)])
    dl = dls.train.new(before_batch=[Brightness(max_lighting=0.3)])
    with pytest.raises(ValueError, match=r"random transform Brightness in TfmdDL\.before_batch"):
        RankShardedFastaiDL(dl, rank=0, world_size=2, pad=False)
    RankShardedFastaiDL(
        dls.train.new(after_batch=[Flip()]), rank=0, world_size=2, pad=False
    )  # (exact: accepted)


def rank_files(out: Path, world: int) -> list[dict]:
    return [torch.load(f"{out}.rank{r}.pt", weights_only=False) for r in range(world)]


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def one_process(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The script under the bridge on one process (MixUp), with the extras (get_preds,
    ClassificationInterpretation, a resized fit, export and load_learner, shows)."""
    out = tmp_path_factory.mktemp("one") / "one"
    run([sys.executable, str(SCRIPT), "--root", str(folder), "--out", str(out), "--extras"], cwd=out.parent)
    return rank_files(out, 1)[0]


@pytest.mark.launch
@pytest.mark.timeout(480)
@pytest.mark.parametrize("world, workers", [(2, 0), (3, 0), (2, 2)])
def test_mixup_and_augmentation_on_w_processes_end_on_one_processs_weights(
    folder: Path, one_process: dict, tmp_path: Path, world: int, workers: int
) -> None:
    """fit_one_cycle with RandomResizedCrop, aug_transforms and MixUp: the first step's mixed images
    are one process's rows bit for bit, the weights one process's to float64 rounding, every rank's
    the same; with W=2 also validation, the confusion matrix, progressive resizing and the exported
    learner; DataLoader workers change nothing."""
    extras = ("--extras",) if (world, workers) == (2, 0) else ()
    out = tmp_path / "many"
    proc = launch(world, out, "--root", str(folder), "--workers", str(workers), *extras, script=SCRIPT)
    assert f"global batch 12 = {world} processes x {12 // world}" in proc.stdout
    ranks = rank_files(out, world)
    for rank, mine in enumerate(ranks):
        assert torch.equal(one_process["first"]["x"][rank::world], mine["first"]["x"])  # MixUp's pairs too
        assert torch.equal(one_process["first"]["y"][rank::world], mine["first"]["y"])
        assert max_diff(ranks[0]["weights"], mine["weights"]) == 0.0
    assert max_diff(one_process["weights"], ranks[0]["weights"]) < TOL
    for mine, theirs in zip(one_process["values"], ranks[0]["values"], strict=True):
        assert (
            max(abs(x - y) for x, y in zip(mine, theirs, strict=True)) < 1e-6
        )  # (fastai's smoother: float32)
    if extras:
        for mine in ranks:
            assert float((one_process["preds"] - mine["preds"]).abs().max()) < TOL
            assert torch.equal(one_process["targs"], mine["targs"])
            assert torch.equal(one_process["confusion"], mine["confusion"])
            assert max_diff(one_process["resized"], mine["resized"]) < TOL
            assert mine["reloaded"] == 0.0  # the exported learner predicts as the trained one
        assert (out.parent / "many.results.png").exists() and (out.parent / "many.batch.png").exists()


@pytest.mark.launch
@pytest.mark.timeout(480)
def test_cutmix_on_two_processes_cuts_one_processs_boxes(folder: Path, tmp_path: Path) -> None:
    """CutMix draws one box per batch and pairs rows across it: on 2 processes the box and the pairs
    are those of one process's global batch."""
    args = ("--root", str(folder), "--mix", "cutmix")
    run([sys.executable, str(SCRIPT), *args, "--out", str(tmp_path / "one")], cwd=tmp_path)
    launch(2, tmp_path / "two", *args, script=SCRIPT)
    one, ranks = rank_files(tmp_path / "one", 1)[0], rank_files(tmp_path / "two", 2)
    for rank, mine in enumerate(ranks):
        assert torch.equal(one["first"]["x"][rank::2], mine["first"]["x"])
    assert max_diff(ranks[0]["weights"], ranks[1]["weights"]) == 0.0
    assert max_diff(one["weights"], ranks[0]["weights"]) < TOL


@pytest.mark.launch
@pytest.mark.timeout(480)
def test_fastais_imagenette_script_on_two_processes_ends_on_one_processs_weights(
    folder: Path, tmp_path: Path
) -> None:
    """examples/train_imagenette.py (fastai's Imagenette script with its import changed: DataBlock,
    RandomResizedCrop and FlipItem per item, xresnet18, ranger, label smoothing, MixUp, DataLoader
    workers) at batch 6 on 2 processes ends on the weights of one process at 12 (float32 rounding)."""
    example = ROOT / "examples" / "train_imagenette.py"
    args = (
        str(folder),
        "--size",
        "24",
        "--epochs",
        "2",
        "--arch",
        "xresnet18",
        "--mixup",
        "0.4",
        "--workers",
        "2",
    )
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    run([sys.executable, str(example), *args, "--bs", "12", "--out", str(one)], cwd=tmp_path)
    proc = launch(2, two, *args, "--bs", "6", script=example)
    assert "global batch 12 = 2 processes x 6" in proc.stdout
    a, b = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    assert max(float((a[k].double() - b[k].double()).abs().max()) for k in a) < 1e-5
