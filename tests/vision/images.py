"""Image folders the vision tests train on, made here: scikit-learn's handwritten digits, upscaled
to RGB and written as image files in Imagenette's layout (`train/<class>/*.png`,
`valid/<class>/*.png`), so the pipeline from files on disk runs, decoding included. Nothing is
downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from sklearn.datasets import load_digits
from torch.utils.data import Dataset

CLASSES = ("zero", "one", "two", "three")


def write_image_folder(
    root: Path, per_class: int = 12, valid_per_class: int = 4, size: int = 32, suffix: str = ".png"
) -> Path:
    """Write `per_class` training and `valid_per_class` validation images of each of `CLASSES`
    under `root` (`size` x `size` RGB, tinted per image so colour transforms have something to do)
    and return `root`. The same files every call."""
    digits = load_digits()
    rng = np.random.default_rng(0)
    for label, name in enumerate(CLASSES):
        images = digits.images[digits.target == label][: per_class + valid_per_class]
        if len(images) < per_class + valid_per_class:
            raise ValueError(f"only {len(images)} digits of class {label}")
        for k, image in enumerate(images):
            split = "train" if k < per_class else "valid"
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            grey = (image / 16.0 * 255).astype(np.uint8)
            tint = rng.uniform(0.5, 1.0, size=3)
            rgb = (grey[..., None] * tint).astype(np.uint8)
            Image.fromarray(rgb).resize((size, size), Image.BILINEAR).save(folder / f"{name}_{k:03d}{suffix}")
    return root


def image_files(root: Path, split: str = "train") -> list[tuple[Path, int]]:
    """Every (file, class index) of `split` under `root`, in a fixed order."""
    return [
        (path, label)
        for label, name in enumerate(CLASSES)
        for path in sorted((root / split / name).iterdir())
    ]


class AugmentedImages(Dataset):
    """The image files `files` ((path, label) pairs) decoded with `torchvision.io.decode_image` and,
    for training, augmented at random by a `transforms.v2` pipeline (a crop of random scale and
    shape, a flip, colour jitter) drawing from torch's global generator, as a user's `Dataset` does;
    for validation centre-cropped. Images come as float64 in [0, 1], `size` x `size`."""

    def __init__(self, files: list[tuple[Path, int]], train: bool = True, size: int = 24) -> None:
        from torchvision.transforms import v2

        self.files = files
        to_float = v2.ToDtype(torch.float64, scale=True)
        if train:
            self.transform = v2.Compose(
                [
                    v2.RandomResizedCrop(size, scale=(0.5, 1.0), antialias=True),
                    v2.RandomHorizontalFlip(),
                    v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1),
                    to_float,
                ]
            )
        else:
            self.transform = v2.Compose([v2.CenterCrop(size), to_float])

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from torchvision.io import ImageReadMode, decode_image

        path, label = self.files[index]
        return self.transform(decode_image(str(path), mode=ImageReadMode.RGB)), label
