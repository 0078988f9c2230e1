"""fastai's vision learners as users write them, on a generated image folder, through the bridge:

- resume: a DataBlock (GrandparentSplitter, parent_label) with RandomResizedCrop, aug_transforms and
  MixUp, fit_one_cycle with a checkpoint every `--every` steps (`distrib_ctx(checkpoint_every=...,
  resume=True)`); `--kill-rank R --at I` SIGKILLs rank R after step I of epoch 1 on the first
  attempt, and the restarted job resumes mid-epoch;
- torchvision: the same DataBlock, `vision_learner(dls, resnet18, pretrained=False)` frozen before
  `distrib_ctx` (as `pretrained=True` leaves it), `fine_tune` (a fit frozen, then one unfrozen);
- timm: `ImageDataLoaders.from_df` (a DataFrame of file names, labels and a validation column),
  `vision_learner(dls, "resnet10t", pretrained=False)`, `fit_one_cycle` (the whole model), then
  `fine_tune` (frozen after DDP wrapped it, then unfrozen).

    python tests/scripts/fastai_vision_models.py --root images --out one            # one process
    python -m unison.launch --nproc 2 tests/scripts/fastai_vision_models.py --root images --out two

Float64 from the inputs on (as tests/scripts/fastai_vision.py). The heads' dropout is off (`ps=0`):
a model's own dropout draws per rank (see docs/vision.md). Every rank writes `<out>.rank<R>.pt`.
"""

# ruff: noqa: F403, F405  (star imports, as fastai scripts are written)
import argparse
import os
import signal
from pathlib import Path

import pandas as pd
import torch
from fastai.vision.all import *

from unison.fastai import *  # (was: from fastai.distributed import *)

parser = argparse.ArgumentParser()
parser.add_argument("--root", required=True, help="an image folder: train/<class>/, valid/<class>/")
parser.add_argument("--out", required=True)
parser.add_argument("--bs", type=int, default=12, help="the global batch")
parser.add_argument("--parts", default="resume,torchvision,timm")
parser.add_argument("--every", type=int, default=3, help="resume: a checkpoint every N steps")
parser.add_argument("--kill-rank", type=int, help="resume: SIGKILL this rank at epoch 1, step --at (once)")
parser.add_argument("--at", type=int, default=2)
args = parser.parse_args()

torch.set_default_dtype(torch.float64)
world, rank = max(1, num_distrib()), rank_distrib()
out, root = Path(args.out), Path(args.root)
parts = args.parts.split(",")


class DoubleInputs(Callback):
    order = -4  # after the bridge has taken this rank's rows, before MixUp (0) mixes them

    def before_batch(self) -> None:
        self.learn.xb = tuple(x.double() for x in self.learn.xb)

    def after_backward(self) -> None:
        self.learn.loss = self.learn.loss.float()  # (fastai's loss smoother is float32 whatever the model)


class CrossEntropy64:
    """CrossEntropyLossFlat in the model's dtype (fastai's casts to float32)."""

    y_int = True

    def __init__(self) -> None:
        self.reduction = "mean"

    def __call__(self, out, targ):
        return F.cross_entropy(out, targ.long().view(-1), reduction=self.reduction)

    def decodes(self, x):
        return x.argmax(dim=-1)

    def activation(self, x):
        return F.softmax(x, dim=-1)


class Snapshots(Callback):
    """The weights after each fit and how many parameters trained in it (fine_tune's two fits)."""

    order = 99

    def __init__(self) -> None:
        self.fits: list[dict] = []

    def before_fit(self) -> None:
        if not self.learn.lock.locked():
            self.trainable = sum(p.requires_grad for p in self.learn.model.parameters())

    def after_fit(self) -> None:
        if not self.learn.lock.locked():
            self.fits.append({"trainable": self.trainable, "weights": weights(self.learn)})


class Kill(Callback):
    order = 99

    def after_step(self) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if args.kill_rank == rank and first_attempt and (self.epoch, self.iter) == (1, args.at):
            os.kill(os.getpid(), signal.SIGKILL)


def weights(learn) -> dict:
    model = getattr(learn.model, "module", learn.model)  # (inside the block on W > 1: DDP's module)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def tfms() -> dict:
    return {
        "item_tfms": RandomResizedCrop(24, min_scale=0.5),
        "batch_tfms": [
            *aug_transforms(max_rotate=20, max_lighting=0.3),
            Normalize.from_stats(*imagenet_stats),
        ],
    }


def datablock_dls():
    set_seed(42)  # (every rank builds the same loaders)
    block = DataBlock(
        blocks=(ImageBlock, CategoryBlock),
        get_items=get_image_files,
        get_y=parent_label,
        splitter=GrandparentSplitter(valid_name="valid"),
        **tfms(),
    )
    return block.dataloaders(root, bs=args.bs // world, num_workers=0)


def dataframe_dls():
    set_seed(42)
    files = sorted(get_image_files(root))
    df = pd.DataFrame(
        {
            "name": [str(f.relative_to(root)) for f in files],
            "label": [f.parent.name for f in files],
            "is_valid": [f.parent.parent.name == "valid" for f in files],
        }
    )
    return ImageDataLoaders.from_df(
        df, root, fn_col="name", label_col="label", valid_col="is_valid", bs=args.bs // world, **tfms()
    )


saved: dict = {"rank": rank}
if "resume" in parts:
    set_seed(0)
    dls = datablock_dls()
    model = XResNet(ResBlock, 1, [1, 1, 1, 1], n_out=len(dls.vocab), stem_szs=(8, 16, 64), widen=0.25)
    learn = Learner(
        dls,
        model.double(),
        loss_func=CrossEntropy64(),
        cbs=[DoubleInputs(), Kill()],
        path=out.parent / f"{out.name}-resume",  # (its checkpoints: this run's own)
    )
    mix = MixUp(0.4)
    alpha = mix.distrib.concentration1.double()  # (a float64 Beta: fastai's `tensor()` makes it float32)
    mix.distrib = torch.distributions.Beta(alpha, alpha)
    with learn.distrib_ctx(checkpoint_every=args.every, resume=True):
        learn.fit_one_cycle(2, 1e-2, cbs=mix)
    saved["resume"] = {
        "weights": weights(learn),
        "values": [list(map(float, r)) for r in learn.recorder.values],
    }
    saved["attempt"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

if "torchvision" in parts:
    set_seed(0)
    snaps = Snapshots()
    learn = vision_learner(
        datablock_dls(),
        resnet18,
        pretrained=False,
        ps=0.0,
        loss_func=CrossEntropy64(),
        cbs=[DoubleInputs(), snaps],
    )
    learn.model.double()
    learn.freeze()  # (what vision_learner does with pretrained=True: DDP then wraps a frozen body)
    with learn.distrib_ctx():
        learn.fine_tune(1, base_lr=1e-2, freeze_epochs=1)  # frozen (as wrapped), then unfrozen
    saved["torchvision"] = snaps.fits

if "timm" in parts:
    set_seed(0)
    snaps = Snapshots()
    learn = vision_learner(
        dataframe_dls(),
        "resnet10t",
        pretrained=False,
        ps=0.0,
        loss_func=CrossEntropy64(),
        cbs=[DoubleInputs(), snaps],
    )
    learn.model.double()
    with learn.distrib_ctx():
        learn.fit_one_cycle(1, 1e-2)  # the whole model, as wrapped
        learn.fine_tune(1, base_lr=1e-2, freeze_epochs=1)  # frozen since wrapped, then unfrozen
    saved["timm"] = snaps.fits

torch.save(saved, f"{out}.rank{rank}.pt")
print(f"rank {rank} done, pid {os.getpid()}")
