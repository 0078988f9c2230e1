"""Move a section of README.md into a page of the manual (docs/), and keep the tables of contents true.

    python docs/split_readme.py "Streaming" streaming.md
    python docs/split_readme.py "Bring your own model" bring-your-own-model.md --keep "What is exact"
    python docs/split_readme.py --toc        # only rewrite the tables of contents and the nav

A section is found by its heading's text at any level (`## Launching`, `### Streaming` under
`## API`) and runs to the next heading of its level or above, subsections included, except
those named with `--keep`, which stay in the README under the section's heading. Headings
inside fenced code (`# a comment` in a bash block) are not headings.

The page:
  - does not exist yet: it is written with the page's title (PAGES below, else the section's
    heading) and the section's text, its subsections promoted (`####` under `###` -> `##`);
  - exists: the section is appended to it as a `##` subsection.
Links to files of the repository (`[x](examples/x.py)`) become code (`x`), which the
manual cannot link to; links into docs/ become links between pages; nested lists indented
by two spaces get the four that Python-Markdown needs.

The README:
  - a section with kept subsections keeps its heading, its text replaced by one line,
    `Moved to the manual: [title](docs/page.md).`, then the kept subsections;
  - a subsection (`###`) is replaced by that line; a parent left with nothing but such
    lines is removed (the table of contents links its pages);
  - a top-level section (`##`) is removed: its one-line link is its entry in the README's
    table of contents, which now points at docs/page.md instead of the README's heading.

Then the three tables of contents are rewritten from PAGES and the pages present: the
README's (between `<!-- toc -->` and `<!-- /toc -->`), docs/index.md's (same markers) and
the `nav:` of mkdocs.yml. A page of PAGES not written yet is listed by its README section.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Page:
    file: str
    title: str
    summary: str
    section: str | None = None  # the README heading its text comes from, if any


#: The manual, in reading order (index.md, the home page, is not listed in its own contents).
PAGES = [
    Page("quickstart.md", "Quickstart", "set up, a first training script, `make demo`: 1 process against 2"),
    Page(
        "api-guide.md",
        "The API at a glance",
        "every public name in one table, metrics that stay exact, how data is sharded",
        "API",
    ),
    Page(
        "bring-your-own-model.md",
        "Bring your own model",
        "any batch and output structure, Hugging Face models, a model's own loss, exact per-token "
        "losses, param groups, `torch.compile`, the data check at start",
        "Bring your own model",
    ),
    Page(
        "own-loop.md",
        "Your own loop",
        "`unison.Run`: the Learner's guarantees in a loop you write, by the same engine; from Accelerate "
        "and Fabric, call by call; an odd-sized evaluation measured; nanoGPT ported",
    ),
    Page(
        "from-fastai.md",
        "From fastai",
        "a stock fastai `Learner` data-parallel with one line, exactly, resumed exactly after a kill; "
        "what fastai's own `distrib_ctx` does differently; the same script measured side by side",
    ),
    Page(
        "exact.md",
        "What is exact",
        "what W processes = 1 process means in float arithmetic, and where float noise grows",
        "What is exact",
    ),
    Page(
        "streaming.md",
        "Streaming",
        "`IterableDataset` streams, Hugging Face streaming and batch samplers, sharded exactly",
        "Streaming",
    ),
    Page(
        "launching.md",
        "Launching and clusters",
        "`unison launch`, several machines, elastic restarts, torchrun's options, SLURM, Kubernetes, "
        "Ray Train, `spawn` and `mp_spawn`",
        "Launching",
    ),
    Page(
        "faults.md",
        "Faults and resume",
        "checkpoints, exact resume, restarts, preemption, NaNs, hangs and frozen ranks, corrupt files, "
        "full disks",
        "Faults and resume",
    ),
    Page(
        "fault-tolerance.md",
        "Fault tolerance per step (torchft)",
        "a lost replica costs seconds, not a restart: torchft replicas that redo the step and heal, exactly",
    ),
    Page(
        "sharded.md",
        "Sharded training",
        "FSDP2 with `shard=True`, sharded checkpoints, memory and speed",
        "Sharded training",
    ),
    Page(
        "gpus.md",
        "GPUs and mixed precision",
        "device per process, what moves, NCCL stalls, `make gpu-check`, bf16 and fp16",
        "GPUs",
    ),
    Page(
        "benchmarks.md",
        "Benchmarks",
        "unison against a hand-written DDP loop: speed, memory, start-up",
        "Benchmarks",
    ),
    Page("layout.md", "Layout", "where each part of the code lives", "Layout"),
    Page("api.md", "API reference", "every public class and function, from its docstring"),
]

MOVED = "Moved to the manual: "
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
LINK = re.compile(r"\[([^\]\n]+)\]\(([^)\s]+)\)")


def code_mask(lines: list[str]) -> list[bool]:
    """For each line, whether it is part of a fenced code block (the fences included)."""
    mask, fence = [], None
    for line in lines:
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            mask.append(True)
        elif fence is not None:
            mask.append(True)
            if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                fence = None
        else:
            mask.append(False)
    return mask


def headings(lines: list[str]) -> list[tuple[int, int, str]]:
    """(line index, level, text) of every heading outside fenced code."""
    found = []
    for i, (line, in_code) in enumerate(zip(lines, code_mask(lines), strict=True)):
        match = None if in_code else HEADING.match(line)
        if match:
            found.append((i, len(match.group(1)), match.group(2)))
    return found


def span(lines: list[str], title: str, within: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """(start, end, level) of the section headed `title`: its heading up to the next of its level or above."""
    lo, hi = within or (0, len(lines))
    heads = [h for h in headings(lines) if lo <= h[0] < hi]
    hits = [h for h in heads if h[2] == title and h[1] >= 2]
    if len(hits) != 1:
        where = "README.md" if within is None else "the section"
        have = ", ".join(repr(h[2]) for h in heads if h[1] >= 2)
        raise SystemExit(f"split_readme: {len(hits)} headings {title!r} in {where} (need 1); it has: {have}")
    start, level, _ = hits[0]
    end = next((i for i, lv, _ in heads if i > start and lv <= level), hi)
    return start, end, level


def slug(title: str) -> str:
    """The anchor GitHub (and mkdocs' toc) gives a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).strip().replace(" ", "-")


def strip_blank(lines: list[str]) -> list[str]:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def for_docs(lines: list[str], shift: int) -> list[str]:
    """The README's text as a docs page's: headings moved by `shift` levels, links and nested lists fixed."""

    def link(match: re.Match) -> str:
        text, url = match.group(1), match.group(2)
        if re.match(r"^(https?:|mailto:|#)", url):
            return match.group(0)
        if url.startswith("docs/"):
            return f"[{text}]({url[len('docs/') :]})"
        return f"`{url}`" if text.strip("`") == url else f"{text} (`{url}`)"

    out, nested = [], False
    for line, in_code in zip(lines, code_mask(lines), strict=True):
        if in_code:
            out.append(line)
            continue
        heading = HEADING.match(line)
        if heading:
            level = max(1, min(6, len(heading.group(1)) + shift))
            line = "#" * level + " " + heading.group(2)
        line = LINK.sub(link, line)
        if re.match(r"^  [-*] ", line):
            nested = True
        elif line.strip() and not line.startswith(" "):
            nested = False
        if nested and line.startswith("  "):
            line = "  " + line
        out.append(line)
    return out


def move(root: Path, title: str, page_file: str, keep: list[str], page_title: str | None) -> str:
    """Move README section `title` into docs/`page_file`; return what was done, in one line."""
    readme, docs = root / "README.md", root / "docs"
    lines = readme.read_text().splitlines()
    start, end, level = span(lines, title)
    kept_spans = sorted(span(lines, name, (start + 1, end))[:2] for name in keep)
    body, kept, i = [], [], start + 1
    for k_start, k_end in kept_spans:
        body += lines[i:k_start]
        kept += lines[k_start:k_end]
        i = k_end
    body += lines[i:end]
    body = strip_blank(body)
    if not body:
        raise SystemExit(f"split_readme: section {title!r} has no text of its own to move")

    page = docs / page_file
    known = {p.file: p for p in PAGES}
    if page.exists():
        text = page.read_text().rstrip("\n")
        moved = for_docs(body, shift=2 - level)
        page.write_text(f"{text}\n\n## {title}\n\n" + "\n".join(moved) + "\n")
        anchor = f"docs/{page_file}#{slug(title)}"
        name = title
    else:
        name = page_title or (known[page_file].title if page_file in known else title)
        moved = for_docs(body, shift=1 - level)
        page.write_text(f"# {name}\n\n" + "\n".join(moved) + "\n")
        anchor = f"docs/{page_file}"

    line = f"{MOVED}[{name}]({anchor})."
    if kept:
        new = [lines[start], "", line, "", *strip_blank(kept), ""]
    elif level >= 3:
        new = [line, ""]
    else:
        new = []
    lines[start:end] = new
    if not kept and level >= 3:
        lines = drop_empty_parent(lines, start, level)
    readme.write_text("\n".join(lines).rstrip("\n") + "\n")
    return f"moved README section {title!r} to docs/{page_file} ({len(body)} lines)"


def drop_empty_parent(lines: list[str], at: int, level: int) -> list[str]:
    """Remove the section around line `at` (headed above `level`) if only links to the manual are left."""
    heads = [h for h in headings(lines) if h[0] < at and h[1] < level]
    if not heads:
        return lines
    start, level, _ = heads[-1]
    end = next((i for i, lv, _ in headings(lines) if i > start and lv <= level), len(lines))
    rest = [x for x in lines[start + 1 : end] if x.strip()]
    if level >= 2 and all(x.startswith(MOVED) for x in rest):
        return lines[:start] + lines[end:]
    return lines


def first_heading(path: Path) -> str:
    match = re.search(r"^# (.+)$", path.read_text(), re.MULTILINE)
    return match.group(1).strip() if match else path.stem


def pages_present(root: Path) -> list[Page]:
    """PAGES written so far, then any other page of docs/ (before the API reference)."""
    docs = root / "docs"
    known = [p for p in PAGES if (docs / p.file).exists()]
    names = {p.file for p in PAGES} | {"index.md"}
    extra = [Page(f.name, first_heading(f), "") for f in sorted(docs.glob("*.md")) if f.name not in names]
    if known and known[-1].file == "api.md":
        return known[:-1] + extra + known[-1:]
    return known + extra


def entry(title: str, link: str | None, summary: str) -> str:
    name = f"[{title}]({link})" if link else title
    return f"- {name}: {summary}" if summary else f"- {name}"


def replace_between(text: str, start: str, end: str, new: list[str], where: str) -> str:
    if start not in text or end not in text:
        raise SystemExit(f"split_readme: {where} has no {start} ... {end} block for the table of contents")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return head + start + "\n" + "\n".join(new) + "\n" + end + tail


def write_tocs(root: Path) -> None:
    """Rewrite the README's and docs/index.md's tables of contents and mkdocs.yml's nav."""
    readme, index, mkdocs = root / "README.md", root / "docs" / "index.md", root / "mkdocs.yml"
    present = pages_present(root)
    have = {p.file for p in present}
    readme_text = readme.read_text()
    in_readme = {h[2] for h in headings(readme_text.splitlines())}
    readme_toc, index_toc = [], []
    for page in present_order(present):
        if page.file in have:
            readme_toc.append(entry(page.title, f"docs/{page.file}", page.summary))
            index_toc.append(entry(page.title, page.file, page.summary))
        elif page.section in in_readme:
            note = f"{page.summary} (below, for now)"
            readme_toc.append(entry(page.title, f"#{slug(page.section)}", note))
            where = f'for now in the README\'s "{page.section}" section'
            index_toc.append(entry(page.title, None, f"{page.summary}; {where}"))
    marks = ("<!-- toc -->", "<!-- /toc -->")
    readme.write_text(replace_between(readme_text, *marks, readme_toc, "README.md"))
    index.write_text(replace_between(index.read_text(), *marks, index_toc, "docs/index.md"))
    text = mkdocs.read_text()
    if "\nnav:\n" not in text:
        raise SystemExit("split_readme: mkdocs.yml has no `nav:` (it must be its last key)")
    nav = ["  - Home: index.md"] + [f'  - "{p.title}": {p.file}' for p in present]
    mkdocs.write_text(text.split("\nnav:\n", 1)[0] + "\nnav:\n" + "\n".join(nav) + "\n")


def present_order(present: list[Page]) -> list[Page]:
    """Every page to list: PAGES in order (written or not), with other written pages before the reference."""
    known = {p.file for p in PAGES}
    extra = [p for p in present if p.file not in known]
    return [p for p in PAGES if p.file != "api.md"] + extra + [p for p in PAGES if p.file == "api.md"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("section", nargs="?", help="the README heading's text, e.g. 'Streaming'")
    parser.add_argument("page", nargs="?", help="the page in docs/, e.g. streaming.md")
    parser.add_argument("--keep", action="append", default=[], help="a subsection to leave in the README")
    parser.add_argument("--title", help="the new page's title (default: from PAGES, else the heading)")
    parser.add_argument("--toc", action="store_true", help="only rewrite the tables of contents and the nav")
    root = Path(__file__).resolve().parent.parent
    parser.add_argument("--root", type=Path, default=root, help=argparse.SUPPRESS)  # another checkout
    args = parser.parse_args(argv)
    if not args.toc:
        if not args.section or not args.page or not args.page.endswith(".md") or "/" in args.page:
            parser.error("give a README section and a page file name in docs/, e.g. 'Streaming' streaming.md")
        print(move(args.root, args.section, args.page, args.keep, args.title))
    write_tocs(args.root)
    print("rewrote the tables of contents: README.md, docs/index.md, mkdocs.yml nav")


if __name__ == "__main__":
    sys.exit(main())
