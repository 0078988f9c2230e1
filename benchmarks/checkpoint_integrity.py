"""Cost of checking a checkpoint's integrity (every zip entry's CRC32) on load, on a 100 MB file.

Times, interleaved and warm (the file in the page cache, as right after a save or on a resume):
`torch.load(weights_only=True)` alone, the CRC check alone (`verify_integrity`), and unison's
`safe_load`, which does both.

    python benchmarks/checkpoint_integrity.py            # prints one Markdown line for RESULTS.md
    python benchmarks/checkpoint_integrity.py --mb 200 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from unison.checkpoint.format import atomic_save, safe_load
from unison.checkpoint.integrity import verify_integrity


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=100, help="checkpoint size in MB (float32 weights)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    numel = args.mb * 1_000_000 // 4
    # A model-like state: a few dozen tensors, like a real network's layers.
    parts = 40
    state = {f"layer{i}.weight": torch.randn(numel // parts) for i in range(parts)}
    with tempfile.TemporaryDirectory() as tmp:
        path = atomic_save({"unison_format": 1, "kind": "checkpoint", "model": state}, Path(tmp) / "c.pth")
        size_mb = path.stat().st_size / 1e6
        load = lambda: torch.load(path, weights_only=True)  # noqa: E731
        check = lambda: verify_integrity(path)  # noqa: E731
        both = lambda: safe_load(path)  # noqa: E731
        load(), check(), both()  # warm the page cache
        times: dict[str, list[float]] = {"load": [], "check": [], "safe_load": []}
        for _ in range(args.repeats):  # interleaved, so load drift hits all three alike
            times["load"].append(_timed(load))
            times["check"].append(_timed(check))
            times["safe_load"].append(_timed(both))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"| {size_mb:.0f} MB checkpoint | {med['load'] * 1e3:.0f} ms | {med['check'] * 1e3:.0f} ms "
        f"({size_mb / med['check'] / 1e3:.2f} GB/s) | {med['safe_load'] * 1e3:.0f} ms | "
        f"**+{med['check'] / med['load'] * 100:.0f}%** |"
    )


if __name__ == "__main__":
    main()
