"""The README, CONTRIBUTING, the manual and the code's comments say what is, not what was.

A measurement with its date, commit, machine and load belongs in docs/benchmarks.md (its one row
format); a change's story belongs in CHANGELOG.md and the commit log. Elsewhere a line with a date
(2026-11-26), a machine load, CPU-seconds, a commit a figure was measured on, or a history phrase
("used to", "before this work", "since <date>", "re-run on") fails this test.
"""

from __future__ import annotations

import ast
import io
import re
import shutil
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PATTERNS = {
    "a date": re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b"),
    "a machine load": re.compile(
        r"\bload(?: average)?s? (?:of )?(?:about )?\d|\bload average\b|\bat load\b", re.IGNORECASE
    ),
    "CPU-seconds": re.compile(r"\bCPU[- ]s(?:econds?)?\b", re.IGNORECASE),
    "history": re.compile(
        r"(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bbeen )(?<!\bwas )(?<!\bwere )\bused to\b"
        r"|\bbefore this (?:work|change|fix)\b|\bre-run on\b"
        r"|\bsince (?:(?:19|20)\d\d|then|the (?:change|fix))\b",
        re.IGNORECASE,
    ),
    "a commit measured on": re.compile(r"\b(?:on|at|commit) [0-9a-f]{7,40}\b"),
}

#: Lines in files that other work in progress owns (issues 47 and 48), to be rewritten there:
#: (file, the start of the line). Each must still be there (so the list only shrinks); empty it
#: as they go.
PENDING: set[tuple[str, str]] = set()


def prose_files(root: Path) -> list[Path]:
    docs = [p for p in sorted((root / "docs").glob("*.md")) if p.name != "benchmarks.md"]
    return [root / "README.md", root / "CONTRIBUTING.md", *docs]


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment and docstring line of a Python source."""
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    first = body[0].lineno
                    found += [(first + i, line) for i, line in enumerate(body[0].value.value.splitlines())]
    return found


def history_lines(root: Path) -> list[tuple[str, int, str, str]]:
    """(file, line number, what it carries, the line) for every dated or history line."""
    hits = []
    candidates = [(p, list(enumerate(p.read_text().splitlines(), 1))) for p in prose_files(root)]
    candidates += [(p, comments_and_docstrings(p.read_text())) for p in sorted((root / "src").rglob("*.py"))]
    for path, lines in candidates:
        rel = path.relative_to(root).as_posix()
        for number, line in lines:
            for what, pattern in PATTERNS.items():
                if pattern.search(line):
                    hits.append((rel, number, what, line.strip()))
                    break
    return hits


def pending(rel: str, line: str) -> bool:
    return any(rel == f and line.lstrip("#: ").startswith(start) for f, start in PENDING)


def test_no_dates_loads_or_history_outside_the_benchmarks():
    found = [hit for hit in history_lines(ROOT) if not pending(hit[0], hit[3])]
    where = "\n".join(f"{f}:{n}: {what}: {line}" for f, n, what, line in found)
    assert not found, (
        "dated or history lines: move a measurement to docs/benchmarks.md, a change's story to "
        f"CHANGELOG.md, or say what is:\n{where}"
    )


def test_every_pending_line_is_still_there():
    hits = {(f, line) for f, _, _, line in history_lines(ROOT)}
    gone = [
        entry
        for entry in PENDING
        if not any(
            pending(f, line) and f == entry[0] and line.lstrip("#: ").startswith(entry[1]) for f, line in hits
        )
    ]
    assert not gone, f"rewritten: remove from PENDING: {gone}"


def test_an_added_dated_or_history_line_is_found(tmp_path):
    """The check itself: a copy of the checkout passes until such a line is added to any kind of file."""
    for name in ("README.md", "CONTRIBUTING.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("*.py"))
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    module = tmp_path / "src" / "pkg" / "mod.py"
    module.write_text('"""A module."""\n\nX = "used to be"  # a value, not a comment\n')
    before = {(f, line) for f, _, _, line in history_lines(tmp_path)}
    added = {
        "README.md": "Measured on 2026-11-26 on this machine.",
        "CONTRIBUTING.md": "The suite took 600 s (load average 4.6).",
        "docs/faults.md": "Each restart costs 1.3 CPU-s.",
        "docs/gpus.md": "It used to hang; now it ends.",
        "docs/launching.md": "591 s on 031e893.",
    }
    for name, line in added.items():
        with open(tmp_path / name, "a") as f:
            f.write(f"\n{line}\n")
    module.write_text('"""A module.\n\nSince 2026-11-27 it also checks.\n"""\n\nX = 1  # this used to be 2\n')
    (tmp_path / "docs" / "benchmarks.md").write_text("| 2026-11-26 | 431b708 | load 4 |\n")  # its place
    after = {(f, line) for f, _, _, line in history_lines(tmp_path)} - before
    assert {f for f, _ in after} == {*added, "src/pkg/mod.py"}, after
    assert {line for f, line in after if f == "src/pkg/mod.py"} == {
        "Since 2026-11-27 it also checks.",
        "# this used to be 2",
    }


def test_present_tense_is_not_taken_for_history():
    text = "This is used to pick a port. A lock is released since the store has ended. Load it with `load`."
    assert not any(p.search(text) for p in PATTERNS.values())
