"""The manual's table of contents, written once here, into the three places that list it.

    python docs/toc.py          # rewrite them
    python docs/toc.py --check  # exit 1 if one of them differs from MANUAL

The three: mkdocs.yml's `nav:` (its last key), docs/index.md's contents and the README's links
into the manual (each between `<!-- toc -->` and `<!-- /toc -->`). tests/test_docs.py runs the
check, and checks that every page of docs/ is listed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Page:
    file: str
    title: str
    summary: str


#: The manual by what the reader wants: (part, what the part is for, its pages).
MANUAL: list[tuple[str, str, list[Page]]] = [
    (
        "Tutorial",
        "start here",
        [Page("quickstart.md", "Quickstart", "set up, a first training script, 1 process against 2")],
    ),
    (
        "How-to guides",
        "one task each",
        [
            Page("launching.md", "Launching", "`unison launch`, torchrun's options, `spawn` and `mp_spawn`"),
            Page("clusters.md", "Clusters", "several machines, SLURM, Kubernetes, TorchX, Ray Train"),
            Page(
                "faults.md",
                "Faults and preemption",
                "checkpoints, exact resume, restarts, preemption, NaNs, hangs",
            ),
            Page(
                "fault-tolerance.md",
                "Fault tolerance per step",
                "torchft replicas: a lost replica costs seconds",
            ),
            Page("own-loop.md", "Your own loop", "`unison.Run`: the same guarantees in a loop you write"),
            Page("from-fastai.md", "From fastai", "a stock fastai `Learner`, data-parallel with one line"),
            Page(
                "bring-your-own-model.md",
                "Bring your own model",
                "any batch and output, Hugging Face models, losses",
            ),
            Page("sharded.md", "Sharded training", "FSDP2 with `shard=True`, sharded checkpoints"),
            Page(
                "streaming.md", "Streaming", "`IterableDataset` streams and batch samplers, sharded exactly"
            ),
            Page("vision.md", "Vision", "random augmentation exact: torchvision transforms, workers, fastai"),
            Page(
                "gpus.md",
                "GPUs and mixed precision",
                "a device per process, NCCL, `make gpu-check`, bf16, fp16",
            ),
        ],
    ),
    (
        "Reference",
        "every name, command, option and variable",
        [
            Page("api-guide.md", "The API at a glance", "every public name in one table"),
            Page("api.md", "API reference", "every public class and function, from its docstring"),
            Page(
                "cli.md", "Command line", "`unison launch`, `check-exact`, `env`, `lighthouse`: every option"
            ),
            Page(
                "environment.md",
                "Environment variables",
                "what unison reads and what it sets for its workers",
            ),
            Page("layout.md", "Layout", "where each part of the code lives"),
        ],
    ),
    (
        "Explanation",
        "why it works",
        [
            Page(
                "exact.md",
                "What is exact",
                "W processes = 1 process in float arithmetic, and where noise grows",
            ),
            Page(
                "how-it-works.md",
                "How the data order and fault tolerance work",
                "one order for every W; surviving a fault",
            ),
        ],
    ),
    (
        "Benchmarks",
        "every measurement, with its date, commit, machine, load and command",
        [
            Page(
                "benchmarks.md",
                "Benchmarks",
                "unison against hand-written loops; the measurements the manual cites",
            )
        ],
    ),
]

MARKS = ("<!-- toc -->", "<!-- /toc -->")


def pages() -> list[Page]:
    return [page for _, _, part in MANUAL for page in part]


def index_toc() -> list[str]:
    lines: list[str] = []
    for part, what, part_pages in MANUAL:
        lines += ["", f"**{part}** ({what})", ""]
        lines += [f"- [{p.title}]({p.file}): {p.summary}" for p in part_pages]
    return lines[1:]


def readme_toc() -> list[str]:
    return [
        f"- **{part}:** " + " · ".join(f"[{p.title}](docs/{p.file})" for p in part_pages)
        for part, _, part_pages in MANUAL
    ]


def nav() -> list[str]:
    lines = ["  - Home: index.md"]
    for part, _, part_pages in MANUAL:
        if len(part_pages) == 1 and part_pages[0].title == part:
            lines.append(f'  - "{part}": {part_pages[0].file}')
            continue
        lines.append(f'  - "{part}":')
        lines += [f'      - "{p.title}": {p.file}' for p in part_pages]
    return lines


def between(text: str, new: list[str], where: str) -> str:
    start, end = MARKS
    if start not in text or end not in text:
        raise SystemExit(f"toc: {where} has no {start} ... {end} block")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return head + start + "\n" + "\n".join(new) + "\n" + end + tail


def written(root: Path = ROOT) -> dict[Path, str]:
    """Each file that lists the manual, as it should read."""
    readme, index, mkdocs = root / "README.md", root / "docs" / "index.md", root / "mkdocs.yml"
    config = mkdocs.read_text()
    if "\nnav:\n" not in config:
        raise SystemExit("toc: mkdocs.yml has no `nav:` (it must be its last key)")
    return {
        readme: between(readme.read_text(), readme_toc(), "README.md"),
        index: between(index.read_text(), index_toc(), "docs/index.md"),
        mkdocs: config.split("\nnav:\n", 1)[0] + "\nnav:\n" + "\n".join(nav()) + "\n",
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    stale = [path for path, text in written().items() if path.read_text() != text]
    if "--check" in args:
        for path in stale:
            print(
                f"{path} does not list the manual as docs/toc.py does: run python docs/toc.py",
                file=sys.stderr,
            )
        return 1 if stale else 0
    for path, text in written().items():
        path.write_text(text)
    print(f"rewrote {len(stale)} of README.md, docs/index.md, mkdocs.yml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
