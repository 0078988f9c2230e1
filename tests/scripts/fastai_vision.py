"""A fastai vision script as users write it, on a generated image folder: ImageDataLoaders.from_folder
with RandomResizedCrop per item, aug_transforms and Normalize per batch, MixUp (or CutMix), a small
xresnet, fit_one_cycle; then validation, ClassificationInterpretation, progressive resizing (new
DataLoaders at a larger size, one more fit), learn.export and load_learner on every rank, and
show_batch / show_results on rank 0. Only the import differs from fastai alone.

    python tests/scripts/fastai_vision.py --root images --out one        # unison, one process
    python -m unison.launch --nproc 2 tests/scripts/fastai_vision.py --root images --out two

Float64 from the inputs on (the images are made in float32 by fastai's pipeline, then cast), so
one process and W agree to float64 rounding. Every rank writes `<out>.rank<R>.pt`: the first
training batch it trained on (after augmentation and mixing), its weights after each fit, the
recorder's rows, the predictions, the confusion matrix and the exported learner's predictions.
"""

# ruff: noqa: F403, F405  (star imports, as fastai scripts are written)
import argparse
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # (show_batch / show_results draw into a file, no display)

import torch  # noqa: E402
from fastai.vision.all import *  # noqa: E402, F403

from unison.fastai import *  # noqa: E402, F403  (was: from fastai.distributed import *)

parser = argparse.ArgumentParser()
parser.add_argument("--root", required=True, help="an image folder: train/<class>/, valid/<class>/")
parser.add_argument("--out", required=True)
parser.add_argument("--bs", type=int, default=12, help="the global batch (1, 2 and 3 processes divide it)")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--mix", choices=["mixup", "cutmix"], default="mixup")
parser.add_argument(
    "--extras", action="store_true", help="interpretation, progressive resizing, export, shows"
)
args = parser.parse_args()

torch.set_default_dtype(torch.float64)
world, rank = max(1, num_distrib()), rank_distrib()  # noqa: F405
out, root = Path(args.out), Path(args.root)


class DoubleInputs(Callback):  # noqa: F405
    order = -4  # after the bridge has taken this rank's rows, before MixUp (0) mixes them

    def before_batch(self) -> None:
        self.learn.xb = tuple(x.double() for x in self.learn.xb)

    def after_backward(self) -> None:
        self.learn.loss = self.learn.loss.float()  # (fastai's loss smoother is float32 whatever the model)


class FirstBatch(Callback):  # noqa: F405
    """The images and targets of the first training step, as the model receives them."""

    order = 1  # after MixUp

    def __init__(self) -> None:
        self.seen: dict = {}

    def before_batch(self) -> None:
        if self.training and not self.seen:
            self.seen = {"x": self.learn.xb[0].detach().clone(), "y": self.learn.yb[0].detach().clone()}


class CrossEntropy64:
    """fastai's CrossEntropyLossFlat computed in the model's dtype (fastai's own casts its inputs to
    float32 whatever the model, which would hide float64 agreement behind float32 rounding)."""

    y_int = True  # (MixUp mixes the losses of integer targets)

    def __init__(self) -> None:
        self.reduction = "mean"

    def __call__(self, out, targ):
        return F.cross_entropy(out, targ.long().view(-1), reduction=self.reduction)  # noqa: F405

    def decodes(self, x):
        return x.argmax(dim=-1)

    def activation(self, x):
        return F.softmax(x, dim=-1)  # noqa: F405


def get_dls(size: int):
    set_seed(42)  # (every rank builds the same loaders)  # noqa: F405
    return ImageDataLoaders.from_folder(  # noqa: F405
        root,
        train="train",
        valid="valid",
        item_tfms=RandomResizedCrop(size, min_scale=0.5),  # noqa: F405
        batch_tfms=[*aug_transforms(max_rotate=20, max_lighting=0.3), Normalize.from_stats(*imagenet_stats)],  # noqa: F405
        bs=args.bs // world,
        num_workers=args.workers,
    )


def weights(learn) -> dict:
    model = getattr(learn.model, "module", learn.model)  # (inside the block on W > 1: DDP's module)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


set_seed(0)  # noqa: F405
dls = get_dls(24)
model = XResNet(ResBlock, 1, [1, 1, 1, 1], n_out=len(dls.vocab), stem_szs=(8, 16, 64), widen=0.25)  # noqa: F405
first = FirstBatch()
learn = Learner(
    dls,
    model.double(),
    loss_func=CrossEntropy64(),
    metrics=accuracy,
    cbs=[DoubleInputs(), first],
    path=out.parent,
)  # noqa: F405
mix = MixUp(0.4) if args.mix == "mixup" else CutMix(1.0)  # noqa: F405
# (fastai's `tensor()` makes the Beta's parameters float32 whatever the default: its weights then
# could not mix float64 inputs)
alpha = mix.distrib.concentration1.double()
mix.distrib = torch.distributions.Beta(alpha, alpha)
saved: dict = {"rank": rank}
with learn.distrib_ctx():
    learn.fit_one_cycle(args.epochs, 1e-2, cbs=mix)
    saved["first"] = first.seen
    saved["weights"] = weights(learn)
    saved["values"] = [list(map(float, row)) for row in learn.recorder.values]
    saved["losses"] = [float(x) for x in learn.recorder.losses]
    if args.extras:
        preds, targs = learn.get_preds()
        saved["preds"], saved["targs"] = preds, targs
        interp = ClassificationInterpretation.from_learner(learn)  # noqa: F405
        saved["confusion"] = torch.as_tensor(interp.confusion_matrix())
        learn.dls = get_dls(28)  # progressive resizing: the same folder at a larger size, one more fit
        learn.fit_one_cycle(1, 5e-3)
        saved["resized"] = weights(learn)
        learn.export(f"{out.name}.pkl")  # rank 0 writes; every rank returns once it is whole
        if rank == 0:  # (its one batch is this process's own: nothing is gathered)
            learn.show_results(max_n=4)
            plt.savefig(f"{out}.results.png")  # noqa: F405
if args.extras:
    reloaded = load_learner(out.parent / f"{out.name}.pkl")  # noqa: F405
    reloaded.model.double()
    batch = learn.dls.valid.one_batch()[0].double()
    with torch.no_grad():
        reloaded.model.eval()
        learn.model.eval()
        saved["reloaded"] = float((reloaded.model(batch) - learn.model(batch)).abs().max())
    if rank == 0:
        learn.dls.show_batch(max_n=4)
        plt.savefig(f"{out}.batch.png")  # noqa: F405
torch.save(saved, f"{out}.rank{rank}.pt")
print(f"rank {rank} done, pid {os.getpid()}")
