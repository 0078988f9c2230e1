"""`python -m unison ...`: the same as the `unison` command, for every subcommand.

Where another program named `unison` comes first on PATH (Debian's file synchroniser is one),
`python -m unison launch --nproc 2 train.py` runs this one.
"""

import sys

from unison.cli import main

if __name__ == "__main__":
    sys.exit(main())
