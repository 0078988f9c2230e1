"""A torchvision ResNet-18 trained on augmented image files, by an own loop on `unison.Run` or by
unison's `Learner` (tests/vision/test_item_draws.py).

python augmented_training.py --images D --dir OUT --bs 12                 # one process, global batch 12
unison launch --nproc 2 augmented_training.py --images D --dir OUT --bs 6 # two processes, the same batch
  --api learner        unison's Learner (fit_one_cycle) instead of the own loop (AdamW + OneCycleLR)
  --workers 2          DataLoader workers
  --channels-last      the model and its inputs in channels_last
  --compile            torch.compile the model

float64, 2 epochs of the 48 training images (`AugmentedImages`: a random crop, flip and colour
jitter from torch's global generator, per item), shuffled by the loader's own generator. Rank 0
writes the final weights to OUT/final.pt; every rank writes a digest of its weights'
bytes to OUT/rank<R>.digest.
"""

import argparse
import hashlib
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision.models import resnet18

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: tests.vision.images

from tests.vision.images import AugmentedImages, image_files  # noqa: E402

from unison import DataLoaders, Learner, Run, set_seed  # noqa: E402
from unison.distributed import rank_distrib  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--images", required=True)
parser.add_argument("--dir", required=True)
parser.add_argument("--bs", type=int, default=12, help="per process")
parser.add_argument("--api", choices=("run", "learner"), default="run")
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--channels-last", action="store_true")
parser.add_argument("--compile", action="store_true")
parser.add_argument("--model", choices=("resnet18", "vit"), default="resnet18", help="vit: a small timm ViT")
args = parser.parse_args()
EPOCHS, GLOBAL_STEPS = 2, 2 * 4  # 48 images, a global batch of 12

set_seed(0)
root = Path(args.images)
train_dl = DataLoader(
    AugmentedImages(image_files(root, "train")),
    batch_size=args.bs,
    shuffle=True,
    generator=torch.Generator().manual_seed(1),
    num_workers=args.workers,
)
if args.model == "vit":  # timm's VisionTransformer, built from a config (nothing downloaded)
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=24, patch_size=8, num_classes=4, embed_dim=32, depth=2, num_heads=2)
    model = model.double()
else:
    model = resnet18(num_classes=4).double()
if args.channels_last:
    model = model.to(memory_format=torch.channels_last)


def as_input(xb: torch.Tensor) -> torch.Tensor:
    return xb.contiguous(memory_format=torch.channels_last) if args.channels_last else xb


if args.api == "run":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=GLOBAL_STEPS)
    with Run(path=args.dir) as run:
        model, opt, sched = run.setup(torch.compile(model) if args.compile else model, opt, sched)
        train = run.loader(train_dl)
        for _ in run.epochs(EPOCHS):
            model.train()
            for xb, yb in train:
                loss = run.loss(F.cross_entropy(model(as_input(xb)), yb, reduction="sum"), count=len(yb))
                run.backward(loss)
                opt.step()
                opt.zero_grad()
                sched.step()
        weights, rank, main = run.model.state_dict(), run.rank, run.is_main
else:
    valid_dl = DataLoader(AugmentedImages(image_files(root, "valid"), train=False), batch_size=args.bs)
    learn = Learner(
        DataLoaders(train_dl, valid_dl),
        model,
        loss_func=F.cross_entropy,
        opt_func=partial(torch.optim.AdamW, weight_decay=0.01),
        path=args.dir,
        compile=args.compile,
    )
    with learn.distrib_ctx():
        learn.fit_one_cycle(EPOCHS, lr_max=1e-2)
    rank = rank_distrib()
    weights, main = learn.model.state_dict(), rank == 0

weights = {k.removeprefix("_orig_mod."): v.detach().contiguous() for k, v in weights.items()}
digest = hashlib.blake2b(b"".join(weights[k].cpu().numpy().tobytes() for k in sorted(weights)))
Path(args.dir, f"rank{rank}.digest").write_text(digest.hexdigest())
if main:
    torch.save(weights, Path(args.dir) / "final.pt")
