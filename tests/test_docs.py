"""The manual: it builds in strict mode, its contents list every page, and its Python runs.

Every ```python block of README.md and docs/*.md runs as a script of its own, in a fresh
folder, and must exit 0. A block that cannot run alone (it needs a launcher, a GPU, a file,
or it is a fragment) says so on the line before its fence:

    <!-- not-run: a fragment of examples/stream_digits.py -->

and one whose output another test checks names that test:

    <!-- tested-by: tests/test_readme.py -->
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hangs import run_or_report

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
BLOCK_TIMEOUT_S = 300

#: Blocks that cannot carry their `<!-- not-run -->` line, by their first line (none: every
#: fragment carries its own marker).
UNMARKED_FRAGMENTS: dict[str, str] = {}


def _load(name: str):
    """A script of docs/ (docs/toc.py, docs/cli_reference.py) as a module."""
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


toc = _load("toc")
cli_reference = _load("cli_reference")


def python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """(line of the fence, code, why it is not run here or None) for each ```python block of `path`."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(`{3,}|~{3,})\s*(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        indent, mark, lang = fence.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == mark)
        if lang in ("python", "py"):
            code = "\n".join(line[len(indent) :] for line in lines[i + 1 : end]) + "\n"
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            why = re.match(r"^<!--\s*(not-run|tested-by):\s*(.+?)\s*-->$", before)
            first = next(line for line in code.splitlines() if line.strip())
            reason = (f"{why.group(1)}: {why.group(2)}" if why else None) or UNMARKED_FRAGMENTS.get(
                first.strip()
            )
            blocks.append((i + 1, code, reason))
        i = end + 1
    return blocks


def unique_blocks():
    """Each distinct block once (the README's training script is also the quickstart's)."""
    seen, params = {}, []
    for path in MARKDOWN:
        for line, code, reason in python_blocks(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if code in seen:
                continue
            seen[code] = where
            params.append(pytest.param(code, reason, id=where))
    return params


@pytest.mark.procs
@pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)
@pytest.mark.parametrize("code, reason", unique_blocks())
def test_python_block_runs(code, reason, tmp_path):
    if reason and reason.startswith("tested-by: "):
        assert (ROOT / reason.split(": ", 1)[1].split()[0]).exists(), reason
        pytest.skip(f"{reason} runs it and checks its output")
    if reason:
        pytest.skip(reason)
    (tmp_path / "block.py").write_text(code)
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env["MPLBACKEND"] = "Agg"
    proc = run_or_report([sys.executable, "block.py"], BLOCK_TIMEOUT_S, cwd=tmp_path, env=env)
    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", proc.stderr)
    if missing and not missing.group(1).startswith("unison"):
        pytest.skip(f"needs {missing.group(1)}, not installed")
    assert proc.returncode == 0, (
        f"a Python block of the docs failed (exit {proc.returncode}); fix it, or mark a block that cannot "
        f"run alone with `<!-- not-run: reason -->` on the line before its fence.\n"
        f"stdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-3000:]}"
    )


def test_blocks_are_found_and_markers_parse():
    blocks = [b for path in MARKDOWN for b in python_blocks(path)]
    assert len(blocks) >= 4
    run = [code for _, code, reason in blocks if reason is None]
    assert any("learn.fit_one_cycle" in code for code in run)  # the README's training script runs


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (`make test` installs it: the test extra)")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "--site-dir", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.procs
@pytest.mark.timeout(360)
def test_manual_builds_in_strict_mode(tmp_path):
    """A broken link, a page left out of the nav, or a docstring griffe cannot read fails the build."""
    proc = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("unison.Learner", "unison.Learner.fit_one_cycle", "unison.distributed.DistributedDL"):
        assert f'id="{name}"' in api, name


def public_names(module: str) -> list[str]:
    return list(__import__(module, fromlist=["__all__"]).__all__)


def test_api_reference_documents_every_public_name():
    api = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^::: ([\w.]+)$", api, re.MULTILINE))
    missing = [f"unison.{n}" for n in public_names("unison") if f"unison.{n}" not in documented]
    missing += [
        f"unison.distributed.{n}"
        for n in public_names("unison.distributed")
        if f"unison.distributed.{n}" not in documented
    ]
    assert not missing, f"add to docs/api.md: {missing}"


def test_tables_of_contents_list_every_page():
    """One hop: every page is in the nav, in docs/index.md's contents and in the README's, as
    docs/toc.py lists the manual; and every page it lists exists."""
    assert toc.main(["--check"]) == 0, "run python docs/toc.py"
    readme, index = (ROOT / "README.md").read_text(), (DOCS / "index.md").read_text()
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")
    for page in pages:
        assert re.search(rf": {re.escape(page)}$", nav, re.MULTILINE), f"{page} is not in mkdocs.yml's nav"
        assert f"]({page})" in index, f"{page} is not in docs/index.md's contents"
        assert f"](docs/{page})" in readme, f"{page} is not in README.md's contents"
    assert sorted(p.file for p in toc.pages()) == pages, "docs/toc.py's MANUAL and docs/*.md differ"


def test_toc_check_fails_when_a_page_is_left_out(tmp_path):
    for name in ("README.md", "mkdocs.yml"):
        (tmp_path / name).write_text((ROOT / name).read_text())
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text((DOCS / "index.md").read_text())
    assert all(path.read_text() == text for path, text in toc.written(tmp_path).items())
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace(" · [Clusters](docs/clusters.md)", ""))
    assert readme.read_text() != toc.written(tmp_path)[readme]


def test_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 120


def test_cli_reference_is_what_the_commands_print():
    """docs/cli.md is the `--help` of every subcommand: a new option cannot be left out of it."""
    assert (DOCS / "cli.md").read_text() == cli_reference.page(), "run python docs/cli_reference.py"


def test_environment_reference_names_every_variable():
    """docs/environment.md names every variable of unison.env_names and every UNISON_* in src/."""
    import unison.env_names as names

    page = (DOCS / "environment.md").read_text()
    wanted = {v for k, v in vars(names).items() if k.endswith("_ENV") and isinstance(v, str)}
    for path in (ROOT / "src" / "unison").rglob("*.py"):
        wanted |= set(re.findall(r"\bUNISON_[A-Z0-9_]+\b", path.read_text()))
    missing = sorted(name for name in wanted if f"`{name}`" not in page)
    assert not missing, f"add to docs/environment.md: {missing}"
