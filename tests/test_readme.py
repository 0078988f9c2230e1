"""The README's "Bring your own model" example runs as written and trains a tiny GPT-2."""

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def section_code(title):
    text = README.read_text()
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_bring_your_own_model_example_runs(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(section_code("Bring your own model"), "README.md", "exec"), {})
    found = re.search(r"^valid_loss (\d+\.\d+) logits \(17, 16, 50\)$", out.getvalue(), re.MULTILINE)
    assert found, out.getvalue()[-2000:]
    assert 0 < float(found.group(1)) < 4.0  # below log(50) = 3.91 after training: it learned something
    assert re.search(r"^next token \d+$", out.getvalue(), re.MULTILINE)
