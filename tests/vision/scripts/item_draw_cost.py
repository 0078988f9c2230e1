"""What seeding each item costs (docs/benchmarks.md): the time per item of fetching a batch of a
dataset as it is, and through `SeededItems` (each item under its own seed, the generators put back
after the batch), for a 32x32 PNG decoded and augmented (`AugmentedImages`) and for an item that is
only its index. Alternating rounds; the medians per item.

python tests/vision/scripts/item_draw_cost.py [--rounds 7]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: tests.vision.images

from tests.vision.images import AugmentedImages, image_files, write_image_folder  # noqa: E402

from unison.data.item_draws import SeededItems, item_seed  # noqa: E402


class Index(Dataset):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> int:
        return i


def per_item_us(fetch, keys: list, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(20):
            fetch(keys)
        times.append((time.perf_counter() - start) / (20 * len(keys)) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        images = AugmentedImages(image_files(write_image_folder(Path(folder)), "train"))
        for name, dataset in (("32x32 PNG, decoded and augmented", images), ("the index", Index())):
            indices = list(range(12))
            seeded = SeededItems(dataset)
            plain = per_item_us(lambda idx, d=dataset: [d[i] for i in idx], indices, args.rounds)

            # the seeds made too, as the loader's batch sampler makes them
            def fetch_seeded(idx: list[int], s: SeededItems = seeded) -> list:
                return s.__getitems__([(i, item_seed(0, 0, i)) for i in idx])

            each = per_item_us(fetch_seeded, indices, args.rounds)
            print(f"{name}: {plain:.1f} us an item as it is, {each:.1f} us seeded (+{each - plain:.1f} us)")


if __name__ == "__main__":
    main()
