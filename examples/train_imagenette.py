"""fastai's Imagenette training script (fastai's `train_imagenette.py`: a `DataBlock` of images and
categories split by grandparent folder, `RandomResizedCrop` and `FlipItem` per item, `Normalize`
per batch, an xresnet, label smoothing, optional MixUp, `fit_flat_cos` inside `learn.distrib_ctx()`),
pointed at an image folder in Imagenette's layout (`train/<class>/`, `valid/<class>/`) instead of
a download. The only change from the fastai script is its import: `from unison.fastai import *`
where it had `from fastai.distributed import *`.

    python examples/train_imagenette.py images --bs 64                       # one process
    unison launch --nproc 2 examples/train_imagenette.py images --bs 32      # two: the same global batch

`--bs` is each process's batch, as in fastai. On W processes every augmentation draw (crop, flip,
MixUp's weights and pairs) is a function of the item's place in the epoch and the seed, so two
processes at 32 train on the very images one process at 64 does, and end on its weights.
Rank 0 writes `--out` when given.
"""

# ruff: noqa: F403, F405  (star imports, as fastai scripts are written)
from fastai.callback.mixup import *
from fastai.vision.all import *
from fastai.vision.models.xresnet import *

from unison.fastai import *  # (fastai's script: from fastai.distributed import *)


def get_dls(source: Path, size: int, bs: int, workers: int | None = None):
    "Imagenette's DataBlock on `source`."
    workers = ifnone(workers, min(8, num_cpus()))
    dblock = DataBlock(
        blocks=(ImageBlock, CategoryBlock),
        splitter=GrandparentSplitter(valid_name="valid"),
        get_items=get_image_files,
        get_y=parent_label,
        item_tfms=[RandomResizedCrop(size, min_scale=0.35), FlipItem(0.5)],
        batch_tfms=[Normalize.from_stats(*imagenet_stats)],
    )
    return dblock.dataloaders(source, path=source, bs=bs, num_workers=workers)


@call_parse
def main(
    folder: str,  # an image folder in Imagenette's layout
    lr: float = 1e-2,  # learning rate
    size: int = 128,  # image size (px)
    sqrmom: float = 0.99,  # sqr_mom
    mom: float = 0.9,  # momentum
    eps: float = 1e-6,  # epsilon
    wd: float = 1e-2,  # weight decay
    epochs: int = 5,  # number of epochs
    bs: int = 64,  # batch size of each process
    mixup: float = 0.0,  # MixUp's alpha (0: none)
    opt: str = "ranger",  # optimizer (adam, rms, sgd, ranger)
    arch: str = "xresnet50",  # architecture
    workers: int = None,  # DataLoader workers
    seed: int = 42,  # every process builds the same loaders and model
    out: str = None,  # write the final weights here (rank 0)
):
    "Training of Imagenette (start it with `unison launch` for distributed training)."
    if opt == "adam":
        opt_func = partial(Adam, mom=mom, sqr_mom=sqrmom, eps=eps)
    elif opt == "rms":
        opt_func = partial(RMSprop, sqr_mom=sqrmom)
    elif opt == "sgd":
        opt_func = partial(SGD, mom=mom)
    else:
        opt_func = partial(ranger, mom=mom, sqr_mom=sqrmom, eps=eps)
    set_seed(seed)
    dls = rank0_first(get_dls, Path(folder), size, bs, workers)
    if rank_distrib() == 0:
        print(f"epochs: {epochs}; lr: {lr}; size: {size}; sqrmom: {sqrmom}; mom: {mom}; eps: {eps}")
    model = globals()[arch](n_out=dls.c)
    top_k = partial(top_k_accuracy, k=min(5, dls.c))  # (fastai's top 5, on a folder of fewer classes)
    learn = Learner(
        dls, model, opt_func=opt_func, metrics=[accuracy, top_k], loss_func=LabelSmoothingCrossEntropy()
    )
    cbs = MixUp(mixup) if mixup else []
    n_gpu = torch.cuda.device_count()
    ctx = learn.parallel_ctx if num_distrib() == 0 and n_gpu else learn.distrib_ctx
    with ctx():
        learn.fit_flat_cos(epochs, lr, wd=wd, cbs=cbs)
    if out and rank_distrib() == 0:
        torch.save({k: v.detach().cpu() for k, v in learn.model.state_dict().items()}, out)
