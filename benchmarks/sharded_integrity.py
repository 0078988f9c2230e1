"""Cost of the checksums of a sharded (DCP) checkpoint: save and verify, with and without them.

A 50.4M-parameter model with its AdamW state (a 605 MB checkpoint) is saved with
`save_sharded` and checked with `read_meta`, as a resume does before loading anything:

- *sizes only*: the same code with the hashing taken out (what unison did before: the manifest
  held sizes alone, so flipped bits loaded unseen);
- *CRC32*: each rank hashes the shard files it wrote, rank 0 the `.metadata`; on load each
  rank hashes its share of the bytes and one gather agrees on the verdict.

For comparison, the same state as one plain checkpoint file: `atomic_save` and the CRC check of
its zip entries that every `safe_load` makes (`verify_integrity`). And the speed of candidate
checksums over the same bytes (zlib's CRC32, SHA-256, BLAKE2b), which chose CRC32.
Rounds are interleaved so load drift on a shared machine hits every variant alike; medians.

    python benchmarks/sharded_integrity.py                 # 1 process; prints Markdown for RESULTS.md
    python benchmarks/sharded_integrity.py --nproc 2       # 2 sharded processes (FSDP2, gloo)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

DIM, HIDDEN, BLOCKS = 1024, 4096, 6  # the model of benchmarks/sharded.py: 50.4M parameters


@contextlib.contextmanager
def _no_checksums() -> Iterator[None]:
    """save_sharded / read_meta with the hashing taken out (sizes only), for the baseline."""
    from unison.checkpoint import sharded as sc

    real = sc.file_checksum
    sc.file_checksum = lambda path, chunk=0: "skipped"  # type: ignore[assignment]
    real_check = sc.check_files

    def sizes_only(path, record, rank=0, world=1):  # type: ignore[no-untyped-def]
        return real_check(path, {**record, "checksums": {}}, rank, world)

    sc.check_files = sizes_only  # type: ignore[assignment]
    try:
        yield
    finally:
        sc.file_checksum, sc.check_files = real, real_check  # type: ignore[assignment]


def _stream(path: Path, update: Callable[[memoryview], None], chunk: int = 1 << 22) -> None:
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            update(view[:n])


def _hash_speeds(files: list[Path]) -> dict[str, float]:
    """Seconds to hash `files` with each candidate."""
    out = {}
    for name in ("crc32", "sha256", "blake2b"):
        start = time.perf_counter()
        for f in files:
            if name == "crc32":
                state = [0]
                _stream(f, lambda b: state.__setitem__(0, zlib.crc32(b, state[0])))  # noqa: B023
            else:
                h = hashlib.new(name)
                _stream(f, h.update)
        out[name] = time.perf_counter() - start
    return out


def measure(folder: str, repeats: int) -> dict[str, object]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from unison.checkpoint.format import atomic_save
    from unison.checkpoint.integrity import verify_integrity
    from unison.checkpoint.sharded import load_sharded, read_meta, save_sharded
    from unison.distributed import Collective, setup_distrib, teardown_distrib

    setup_distrib()  # a no-op on one process
    group = dist.group.WORLD if dist.is_initialized() else None
    collective = Collective(group)
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM)) for _ in range(BLOCKS)]
    )
    n_params = sum(p.numel() for p in model.parameters())
    if collective.world_size > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, DIM)).sum().backward()
    opt.step()  # the optimizer state exists: the checkpoint is what a run saves
    root = Path(folder)
    sharded = root / "c.dcp"
    plain = root / "c.pth"

    def timed(fn: Callable[[], object]) -> float:
        collective.barrier()
        start = time.perf_counter()
        fn()
        collective.barrier()
        return time.perf_counter() - start

    save = lambda: save_sharded(sharded, model, opt, {"step": 1}, collective)  # noqa: E731
    verify = lambda: read_meta(sharded, None, collective)  # noqa: E731

    def resume() -> None:  # what fit(resume=True) reads: the check, then the tensors into the model
        read_meta(sharded, model, collective)
        load_sharded(sharded, model, opt, collective)

    keys = ("save", "verify", "resume")
    times: dict[str, list[float]] = {
        k: [] for k in (*keys, *(f"{k}_crc" for k in keys), "plain_save", "plain_check")
    }
    speeds: list[dict[str, float]] = []
    save(), verify()  # warm up
    for _ in range(repeats):
        with _no_checksums():
            times["save"].append(timed(save))
            times["verify"].append(timed(verify))
            times["resume"].append(timed(resume))
        times["save_crc"].append(timed(save))
        times["verify_crc"].append(timed(verify))
        times["resume_crc"].append(timed(resume))
        if collective.is_main:
            speeds.append(_hash_speeds(sorted(p for p in sharded.iterdir() if p.name != "unison.pth")))
        if collective.world_size == 1:  # the plain file of the same state, one process
            state = {
                "unison_format": 1,
                "kind": "checkpoint",
                "model": model.state_dict(),
                "opt": opt.state_dict(),
            }
            times["plain_save"].append(timed(lambda: atomic_save(state, plain)))  # noqa: B023
            times["plain_check"].append(timed(lambda: verify_integrity(plain)))
    size = sum(p.stat().st_size for p in sharded.iterdir())
    plain_size = plain.stat().st_size if plain.exists() else 0
    teardown_distrib()
    return {
        "world": collective.world_size,
        "params": n_params,
        "mb": size / 1e6,
        "plain_mb": plain_size / 1e6,
        "med": {k: statistics.median(v) for k, v in times.items() if v},
        "hash": {k: statistics.median(s[k] for s in speeds) for k in speeds[0]} if speeds else {},
    }


def _report(r: dict, repeats: int) -> str:
    med, mb = r["med"], r["mb"]
    ms = lambda s: f"{s * 1e3:.0f} ms"  # noqa: E731
    lines = [
        f"{r['world']} process{'es' if r['world'] > 1 else ''}, {r['params'] / 1e6:.1f}M parameters + AdamW "
        f"state, {mb:.0f} MB sharded checkpoint, {repeats} interleaved rounds, medians:",
        "",
        "| step | sizes only | CRC32 of every file | cost of the checksums |",
        "| --- | ---: | ---: | ---: |",
    ]
    rows = (
        ("save", "`save_sharded`"),
        ("verify", "`read_meta` alone (the check)"),
        ("resume", "`read_meta` + `load_sharded` (what a resume reads)"),
    )
    for key, label in rows:
        a, b = med[key], med[f"{key}_crc"]
        pct = f" ({(b - a) / a * 100:+.0f}%)" if key != "verify" else ""
        lines.append(f"| {label} | {ms(a)} | {ms(b)} | **{(b - a) * 1e3:+.0f} ms**{pct} |")
    a, b = med["save"] + med["resume"], med["save_crc"] + med["resume_crc"]
    lines.append(
        f"| save, then resume | {ms(a)} | {ms(b)} | **{(b - a) * 1e3:+.0f} ms** ({(b - a) / a * 100:+.0f}%) |"
    )
    if "plain_check" in med:
        lines += [
            "",
            f"Plain file of the same state ({r['plain_mb']:.0f} MB): `atomic_save` {ms(med['plain_save'])}, "
            f"CRC check of its zip entries (`verify_integrity`, every `safe_load`) {ms(med['plain_check'])} "
            f"({r['plain_mb'] / med['plain_check'] / 1e3:.2f} GB/s); the sharded check: "
            f"{ms(med['verify_crc'])} ({mb / med['verify_crc'] / 1e3:.2f} GB/s).",
        ]
    if r["hash"]:
        speeds = ", ".join(f"{k} {ms(v)} ({mb / v / 1e3:.2f} GB/s)" for k, v in r["hash"].items())
        lines += ["", f"Hashing the checkpoint's files on one process: {speeds}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.nproc == 1:
            result = measure(tmp, args.repeats)
        else:
            import unison

            result = unison.spawn(measure, args.nproc, args=(tmp, args.repeats))
    print(_report(result, args.repeats))


if __name__ == "__main__":
    main()
