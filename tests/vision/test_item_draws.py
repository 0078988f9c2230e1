"""Random augmentation (torchvision `transforms.v2` in a `Dataset` reading image files) is exact:
a ResNet-18 (BatchNorm included) trained in float64 by an own loop on `unison.Run` and by unison's
`Learner`, on 2 and 3 processes (the own loop's 3 in channels_last) and with DataLoader workers,
ends on one process's weights, every rank on the same bytes; one process's own loop on those of
the plain loop written here, which draws each item under the seed of its position in the epoch
(docs/vision.md). torch.compile is left out: compiling on CPU takes minutes a run."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, default_collate
from torchvision.models import resnet18

from tests.hangs import run_or_report
from tests.vision.images import AugmentedImages, image_files, write_image_folder
from unison.rng import mix_seed, seeded_draws

pytestmark = pytest.mark.launch  # real launches of 2 and 3 processes

SCRIPT = Path(__file__).resolve().parent / "scripts" / "augmented_training.py"
GLOBAL_BS = 12
TOL = 1e-9  # float64 rounding of another summation order (a batch split over ranks), through AdamW


def train(images: Path, out: Path, world: int, *options: str) -> dict[str, object]:
    """One run of the script on `world` processes at the global batch of 12: rank 0's weights and
    each rank's digest of its weights."""
    out.mkdir()
    script = [
        str(SCRIPT),
        "--images",
        str(images),
        "--dir",
        str(out),
        "--bs",
        str(GLOBAL_BS // world),
        *options,
    ]
    launcher = [] if world == 1 else ["-m", "unison.launch", "--nproc", str(world)]
    done = run_or_report([sys.executable, *launcher, *script], 600)
    assert done.returncode == 0, done.stderr[-3000:]
    digests = [(out / f"rank{r}.digest").read_text() for r in range(world)]
    return {"weights": torch.load(out / "final.pt", weights_only=True), "digests": digests}


def max_diff(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest difference of a tensor, relative to the tensor's size where that exceeds 1 (a
    BatchNorm's running variance of 16 carries its rounding at that scale)."""
    assert got.keys() == expected.keys()
    diffs = []
    for k, value in expected.items():
        scale = max(1.0, float(value.double().abs().max()))
        diffs.append(float((got[k].double() - value.double()).abs().max()) / scale)
    return max(diffs)


def plain_loop(images: Path) -> dict[str, torch.Tensor]:
    """What the script's own loop trains on one process, written without unison: the loader's own
    shuffle (its generator), each item loaded under the seed of (data seed 0, epoch, its position in
    the epoch), AdamW + OneCycleLR, 2 epochs of 4 batches of 12."""
    torch.manual_seed(0)  # set_seed(0): the data seed is torch's initial seed
    dataset = AugmentedImages(image_files(images, "train"))
    positions = DataLoader(
        range(len(dataset)), batch_size=GLOBAL_BS, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    model = resnet18(num_classes=4).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=8)
    model.train()
    for epoch in range(2):
        for k, batch in enumerate(positions):
            items = []
            for row, index in enumerate(batch.tolist()):
                with seeded_draws(mix_seed(0, epoch, k * GLOBAL_BS + row, "item")):
                    items.append(dataset[index])
            xb, yb = default_collate(items)
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def own_loop_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("own-loop")
    images = write_image_folder(root / "images")
    return {
        "1": train(images, root / "w1", 1),
        "2": train(images, root / "w2", 2),
        "3, channels_last": train(images, root / "w3", 3, "--channels-last"),
        "2 workers": train(images, root / "w2-workers", 2, "--workers", "2"),
        "images": images,
    }


@pytest.mark.timeout(900)
def test_one_process_on_run_trains_on_the_images_of_the_plain_loop(own_loop_runs):
    diff = max_diff(own_loop_runs["1"]["weights"], plain_loop(own_loop_runs["images"]))
    print(f"one process on Run against the plain loop: {diff:.2g}")
    assert diff < TOL


@pytest.mark.timeout(900)
@pytest.mark.parametrize("runs", ["2", "3, channels_last", "2 workers"])
def test_an_own_loop_on_w_processes_ends_on_one_process_weights_every_rank_alike(own_loop_runs, runs):
    assert_one_process_weights(own_loop_runs, runs, "own loop")


def assert_one_process_weights(all_runs: dict, runs: str, what: str) -> None:
    """Run `runs` ends within TOL of the one-process run, every rank on the same bytes."""
    got = all_runs[runs]
    diff = max_diff(got["weights"], all_runs["1"]["weights"])
    print(f"{what}, {runs!r} against one process: {diff:.2g}")
    assert diff < TOL
    assert len(set(got["digests"])) == 1, got["digests"]


@pytest.fixture(scope="module")
def learner_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    root = tmp_path_factory.mktemp("learner")
    images = write_image_folder(root / "images")
    learner = ("--api", "learner", "--model", "vit")  # a small timm ViT (LayerNorm, attention)
    return {
        "1": train(images, root / "w1", 1, *learner),
        "2": train(images, root / "w2", 2, *learner),
        "3": train(images, root / "w3", 3, *learner),
        "2 workers": train(images, root / "w2-workers", 2, *learner, "--workers", "2"),
    }


@pytest.mark.timeout(900)
@pytest.mark.parametrize("runs", ["2", "3", "2 workers"])
def test_a_learner_on_w_processes_ends_on_one_process_weights_every_rank_alike(learner_runs, runs):
    assert_one_process_weights(learner_runs, runs, "Learner (a small ViT)")
