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
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hangs import run_or_report

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
BLOCK_TIMEOUT_S = 300

#: Blocks of the README sections being rewritten now (Streaming, Faults and resume, Sharded
#: training), which cannot carry their `<!-- not-run -->` line yet: by their first line.
UNMARKED_FRAGMENTS: dict[str, str] = {}  # every fragment now carries its own not-run marker

split_spec = importlib.util.spec_from_file_location("split_readme", DOCS / "split_readme.py")
split_readme = sys.modules["split_readme"] = importlib.util.module_from_spec(split_spec)
split_spec.loader.exec_module(split_readme)


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
    """One hop: every page is in the nav, in docs/index.md's contents and in the README's."""
    readme, index = (ROOT / "README.md").read_text(), (DOCS / "index.md").read_text()
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")
    for page in pages:
        assert re.search(rf": {re.escape(page)}$", nav, re.MULTILINE), f"{page} is not in mkdocs.yml's nav"
        assert f"]({page})" in index, f"{page} is not in docs/index.md's contents"
        assert f"](docs/{page})" in readme, f"{page} is not in README.md's contents"
    headings = {h[2] for h in split_readme.headings(readme.splitlines())}
    for page in split_readme.PAGES:  # a page not written yet is still a README section, listed
        if page.file not in pages:
            assert page.section in headings, f"{page.file}: neither in docs/ nor a README section"
            assert f"(#{split_readme.slug(page.section)})" in readme


SAMPLE = """# tool

## Set up

<!-- toc -->
<!-- /toc -->

## API

The table.

### Streaming

Streams are exact.

```bash
# not a heading
run --it
```

#### Resume

Mid-epoch, see [the example](examples/stream.py) and [`x.py`](x.py).

- a point
  - a nested point
    that goes on

## Launching

Launch it.
"""


def sample_checkout(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(SAMPLE)
    (tmp_path / "docs" / "index.md").write_text("# tool\n\n<!-- toc -->\n<!-- /toc -->\n")
    (tmp_path / "mkdocs.yml").write_text("site_name: tool\nnav:\n  - Home: index.md\n")
    return tmp_path


def test_split_readme_moves_a_nested_section_and_drops_an_emptied_parent(tmp_path):
    root = sample_checkout(tmp_path)
    split_readme.main(["API", "api-guide.md", "--keep", "Streaming", "--root", str(root)])
    readme = (root / "README.md").read_text()
    assert (
        "## API\n\nMoved to the manual: [The API at a glance](docs/api-guide.md).\n\n### Streaming" in readme
    )
    assert (root / "docs" / "api-guide.md").read_text() == "# The API at a glance\n\nThe table.\n"

    split_readme.main(["Streaming", "streaming.md", "--root", str(root)])
    page = (root / "docs" / "streaming.md").read_text()
    assert page.startswith("# Streaming\n\nStreams are exact.\n\n```bash\n# not a heading\n")
    assert "\n## Resume\n" in page  # #### under ### -> ## on its own page
    assert "see the example (`examples/stream.py`) and `x.py`." in page  # no link out of docs/
    assert "- a point\n    - a nested point\n      that goes on\n" in page  # four spaces for Python-Markdown
    readme = (root / "README.md").read_text()
    assert "## API" not in readme and "Streams are exact" not in readme  # nothing but links was left
    assert "- [The API at a glance](docs/api-guide.md)" in readme
    assert "- [Streaming](docs/streaming.md): " in readme
    assert "- [Launching and clusters](#launching): " in readme  # not moved yet: its README anchor
    assert "- Launching and clusters: " in (root / "docs" / "index.md").read_text()
    assert '  - "Streaming": streaming.md' in (root / "mkdocs.yml").read_text()

    split_readme.main(["Launching", "launching.md", "--root", str(root)])
    readme = (root / "README.md").read_text()
    assert "## Launching" not in readme and "- [Launching and clusters](docs/launching.md): " in readme
    assert (root / "docs" / "launching.md").read_text() == "# Launching and clusters\n\nLaunch it.\n"


def test_split_readme_appends_to_an_existing_page_and_refuses_an_unknown_section(tmp_path):
    root = sample_checkout(tmp_path)
    (root / "docs" / "streaming.md").write_text("# Streaming\n\nIntro.\n")
    split_readme.main(["Resume", "streaming.md", "--root", str(root)])
    assert (
        (root / "docs" / "streaming.md").read_text().startswith("# Streaming\n\nIntro.\n\n## Resume\n\nMid")
    )
    assert "Moved to the manual: [Resume](docs/streaming.md#resume)." in (root / "README.md").read_text()
    with pytest.raises(SystemExit, match="0 headings 'Nowhere'"):
        split_readme.main(["Nowhere", "x.md", "--root", str(root)])


@pytest.mark.procs
@pytest.mark.timeout(360)
def test_moving_the_remaining_sections_keeps_the_build_strict(tmp_path):
    """The later run of docs/split_readme.py, on a copy: every README section that still has a page
    to go to moves, and the manual still builds in strict mode."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(ROOT / "README.md", root)
    shutil.copy(ROOT / "mkdocs.yml", root)
    shutil.copytree(DOCS, root / "docs")
    (root / "src").symlink_to(ROOT / "src")
    headings = {h[2] for h in split_readme.headings((root / "README.md").read_text().splitlines())}
    todo = [p for p in split_readme.PAGES if not (root / "docs" / p.file).exists() and p.section in headings]
    for page in todo:
        split_readme.main([page.section, page.file, "--root", str(root)])
    left = {h[2] for h in split_readme.headings((root / "README.md").read_text().splitlines())}
    if "Check your own workload" in left:  # a subsection beside "What is exact", not inside it
        split_readme.main(["Check your own workload", "exact.md", "--root", str(root)])
    readme = (root / "README.md").read_text()
    assert "Moved to the manual" not in readme  # every parent emptied of its subsections went too
    proc = mkdocs_build(root / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-4000:]
