"""`python -m unison.launch ...`: the same as `unison launch ...`."""

import sys

from unison.launch.launcher import main

sys.exit(main())
