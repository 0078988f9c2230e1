"""Every `>>>` example in unison's docstrings runs, as a doctest, and prints what it shows.

An example that cannot run here (it needs a process group, a GPU, a launch or a file) is written
as a plain indented code block instead, without `>>>` (CONTRIBUTING.md, "Docs, docstrings and
figures"). `python -m pytest tests/test_doctests.py` runs them; they are in the fast tier.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re

import pytest

import unison

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def modules() -> list[str]:
    names = ["unison"]
    for info in pkgutil.walk_packages(unison.__path__, "unison."):
        if info.name.endswith("__main__"):
            continue
        names.append(info.name)
    return sorted(names)


def examples() -> list:
    params = []
    finder = doctest.DocTestFinder(exclude_empty=True)
    for name in modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as missing:  # an optional package (torchft, fastai) not installed
            if (missing.name or "").startswith("unison"):
                raise
            continue
        for test in finder.find(module, name):  # globs: a copy of the module's namespace
            if test.examples and test.name.startswith(name):
                params.append(pytest.param(test, id=test.name))
    return params


@pytest.mark.parametrize("test", examples())
def test_docstring_example(test, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    out: list[str] = []
    runner.run(test, out=out.append, clear_globs=True)
    assert runner.failures == 0, "".join(out)


def test_every_example_is_a_doctest_or_plain_code():
    """No `>>>` example is skipped: `# doctest: +SKIP` marks an example that does not run; write it as
    a plain code block instead."""
    skipped = []
    for name in modules():
        source = importlib.util.find_spec(name).origin
        with open(source) as f:
            for number, line in enumerate(f, 1):
                if re.search(r">>> .*doctest: *\+SKIP", line):
                    skipped.append(f"{source}:{number}: {line.strip()}")
    assert not skipped, "\n".join(skipped)
