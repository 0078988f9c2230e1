"""The tutorial's toy dataset: random (input, target) pairs, kept in memory.

Seeded here so that every rank builds the same set (the tutorial's own does not seed, so its
ranks hold different random data; DistributedSampler then shards indices of different sets).
"""

import torch
from torch.utils.data import Dataset


class RandomPairs(Dataset):
    """`size` pairs of a 20-feature input and a 1-value target."""

    def __init__(self, size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.data[index]
