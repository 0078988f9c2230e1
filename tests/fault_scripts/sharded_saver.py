"""Saves sharded checkpoints in a loop, each holding weights all equal to its number, until killed.

python sharded_saver.py FOLDER
"""

import sys

import torch
from torch import nn

from unison.checkpoint.sharded import save_sharded
from unison.distributed import Collective

folder = sys.argv[1]
model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024))  # ~4M parameters: a save takes a while
value = 0
while True:
    value += 1
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    save_sharded(folder, model, None, {"value": value}, Collective())
