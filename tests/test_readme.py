"""The manual's "Bring your own model" example (once the README's) runs as written and trains a tiny GPT-2."""

import contextlib
import io
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


def page_code(page):
    """The first Python block of a page of the manual (docs/)."""
    return re.search(r"```python\n(.*?)```", (DOCS / page).read_text(), re.DOTALL).group(1)


def test_bring_your_own_model_example_runs(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(page_code("bring-your-own-model.md"), "docs/bring-your-own-model.md", "exec"), {})
    found = re.search(r"^valid_loss (\d+\.\d+) logits \(17, 16, 50\)$", out.getvalue(), re.MULTILINE)
    assert found, out.getvalue()[-2000:]
    assert 0 < float(found.group(1)) < 4.0  # below log(50) = 3.91 after training: it learned something
    assert re.search(r"^next token \d+$", out.getvalue(), re.MULTILINE)
