"""A griffe extension for the API reference: `>>>` examples in docstrings become code blocks.

unison's docstrings are free text with interactive examples (`>>> ...`, `... ...`, then the
output). Markdown would read `>>>` as nested block quotes and `x[0]` as a link reference, so
each run of example lines (up to a blank line or a line of prose) is fenced as `pycon` code
before mkdocstrings renders it. The docstrings themselves are not changed.
"""

import re

import griffe

PROMPT = re.compile(r"^(\s*)>>> ?")
FENCE = re.compile(r"^\s*(```|~~~)")


def fence_examples(text: str) -> str:
    """`text` with every run of `>>>` example lines (and their output) inside a pycon fence."""
    lines, out, i, in_fence = text.splitlines(), [], 0, False
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            in_fence = not in_fence
        match = None if in_fence else PROMPT.match(line)
        if not match:
            out.append(line)
            i += 1
            continue
        indent = match.group(1)
        block = []
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            block.append(lines[i][len(indent) :])
            i += 1
        if out and out[-1].strip():
            out.append("")
        out += [f"{indent}```pycon", *(indent + b for b in block), f"{indent}```"]
        if i < len(lines) and lines[i].strip():
            out.append("")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fence the `>>>` examples of every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_examples(obj.docstring.value)
