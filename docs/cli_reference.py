"""Write docs/cli.md, the command-line reference, from the commands' own `--help`.

    python docs/cli_reference.py          # rewrite docs/cli.md
    python docs/cli_reference.py --check  # exit 1 if docs/cli.md is not what the commands print

tests/test_docs.py runs the check, so a new option cannot be left out of the manual.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent / "cli.md"
WIDTH = "100"  # argparse wraps to $COLUMNS: fixed, so the page does not depend on the terminal

INTRO = """# Command line

`unison` has four subcommands. Each also runs as `python -m unison <subcommand> ...`, for a
machine where another program named `unison` comes first on `PATH` (Debian's file
synchroniser); `python -m unison.launch ...` is `unison launch ...`. How to use them:
[Launching](launching.md), [Clusters](clusters.md), [What is exact](exact.md#check-your-own-workload)
(`check-exact`), [Fault tolerance per step](fault-tolerance.md) (`lighthouse`). The environment
variables they read and set: [Environment variables](environment.md).

This page is the commands' own `--help`, written by `docs/cli_reference.py`.
"""

COMMANDS = [
    ("unison launch", ["launch", "--help"]),
    ("unison check-exact", ["check-exact", "--help"]),
    ("unison env", None),
    ("unison lighthouse", ["lighthouse", "--help"]),
]

ENV_TEXT = """`unison env` takes no options. It prints what a launch on this machine depends on, one fact
per line: the versions of unison, torch and Python; the backends (gloo, NCCL, MPI); the GPUs;
the rank variables of the environment (`RANK`, `WORLD_SIZE`, `SLURM_*`, `PET_*`, ...); the
network interface gloo would use and whether `GLOO_SOCKET_IFNAME` overrides it; and the thread
count each worker would get."""


def help_text(argv: list[str]) -> str:
    """What `unison <argv>` prints, run in this process."""
    from unison.cli import main

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(argv)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return out.getvalue().rstrip() + "\n"


def page() -> str:
    parts = [INTRO]
    for title, argv in COMMANDS:
        parts.append(f"## `{title}`\n")
        parts.append(ENV_TEXT + "\n" if argv is None else f"```text\n{help_text(argv)}```\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = page()
    if "--check" in args:
        if PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python docs/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
