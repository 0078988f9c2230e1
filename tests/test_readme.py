"""The README's training script keeps the promise beside it (2 processes = 1 at twice the batch), and
the manual's "Bring your own model" example (once the README's) runs as written and trains a tiny GPT-2."""

import contextlib
import io
import os
import re
import sys
from pathlib import Path

import pytest

from tests.hangs import run_or_report

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


# ---- the README's own example keeps the promise beside it ----------------------------------------
README = DOCS.parent / "README.md"
# Appended to the example, unchanged otherwise: rank 0 prints what `validate` returned.
REPORT = (
    "\nfrom unison.distributed import rank_distrib\n"
    "if rank_distrib() == 0:\n"
    "    print(f'VALIDATE {valid_loss!r} {acc!r}')\n"
)


def readme_example() -> str:
    """The README's "A training script" block, as a user copies it."""
    text = README.read_text()
    return re.search(r"## A training script\n\n```python\n(.*?)```", text, re.DOTALL).group(1)


def _train(code: str, folder: Path, *runner: str) -> tuple[float, float, dict]:
    """Run `code` (with REPORT) in `folder` through `runner`; (valid_loss, accuracy, saved weights)."""
    import torch

    folder.mkdir()
    (folder / "train.py").write_text(code + REPORT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(DOCS.parent / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    done = run_or_report([*runner, "train.py"], 300, cwd=folder, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    found = re.search(r"VALIDATE (\S+) (\S+)$", done.stdout, re.MULTILINE)
    assert found, done.stdout[-2000:]
    saved = torch.load(folder / "models" / "model.pth", weights_only=True)["model"]
    return float(found.group(1)), float(found.group(2)), saved


@pytest.mark.launch  # three real processes
def test_readme_example_on_two_processes_equals_one_at_twice_the_batch(tmp_path):
    """The promise beside the example ("W processes at batch b train to the same weights as one
    process at batch W*b"), kept by the example itself: it ran 2 processes at 64 to valid loss
    0.413610 and 1 process at 128 to 0.413646, 6.8e-3 apart in `0.bias` (a Linear bias before a
    BatchNorm under AdamW: docs/exact.md)."""
    code = readme_example()
    assert code.count("batch_size=64") == 1, code  # the per-process batch the text speaks of
    one = _train(code.replace("batch_size=64", "batch_size=128"), tmp_path / "one", sys.executable)
    two = _train(code, tmp_path / "two", sys.executable, "-m", "unison.launch", "--nproc", "2")
    assert abs(one[0] - two[0]) <= 1e-5 * max(1.0, abs(one[0])), (one[0], two[0])
    assert one[1] == two[1], (one[1], two[1])  # the same predictions on the same 128 rows
    assert one[2].keys() == two[2].keys()
    gaps = {name: float((one[2][name].double() - two[2][name].double()).abs().max()) for name in one[2]}
    assert max(gaps.values()) <= 1e-5, gaps
    assert 0.5 < one[1] <= 1.0  # and it learned the rule (chance is 0.5)


def readme_block(heading: str) -> str:
    """The first Python block under a README heading."""
    text = README.read_text()
    return re.search(rf"## {heading}\n.*?```python\n(.*?)```", text, re.DOTALL).group(1)


def test_readme_own_loop_fragment_trains_with_the_script_above(tmp_path, monkeypatch):
    """The "Your own loop" fragment, on the x, y and model of the training script above it (as its
    marker says), runs as a plain one-process run and learns the rule."""
    import torch

    setup = readme_example().split("learn = Learner(")[0]  # imports, data and model
    code = setup + "import unison\nimport torch.nn.functional as F\n" + readme_block("Your own loop")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        exec(compile(code, "README.md (Your own loop)", "exec"), scope)
    model, x, y = scope["model"], scope["x"], scope["y"]
    model.eval()
    with torch.no_grad():
        acc = (model(x[896:]).argmax(1) == y[896:]).float().mean().item()
    assert acc > 0.8, acc
