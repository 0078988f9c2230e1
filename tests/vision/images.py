"""Image folders the vision tests train on, made here: scikit-learn's handwritten digits, upscaled
to RGB and written as image files in Imagenette's layout (`train/<class>/*.png`,
`valid/<class>/*.png`), so the pipeline from files on disk runs, decoding included. Nothing is
downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

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
    return [(path, label) for label, name in enumerate(CLASSES) for path in sorted((root / split / name).iterdir())]
