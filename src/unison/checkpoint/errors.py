"""The errors a checkpoint raises: one line naming the file and what is wrong with it."""

from __future__ import annotations

import errno


class CheckpointError(ValueError):
    """A checkpoint file that is missing, damaged, foreign, or does not fit the model."""


class DiskFullError(CheckpointError):
    """A checkpoint did not fit on its disk (ENOSPC); the previous checkpoint is kept whole."""

    errno = errno.ENOSPC
