import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Worker processes import test functions by module name (tests.distributed.test_x).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
# Every Python process the tests start dumps its stacks on SIGABRT: a command that does not finish is
# reported with where each of its processes stood (tests/hangs.py).
os.environ["PYTHONFAULTHANDLER"] = "1"
sys.path.insert(0, str(ROOT))

from tests.tiers import (  # noqa: E402, F401  (pytest hooks: the tiers, groups and process check)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_call,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
)
from tests.worker_pool import WorkerPool  # noqa: E402


@pytest.fixture(scope="session")
def pool2():
    """Two ranks joined in one gloo group for the whole session."""
    with WorkerPool(2) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool3():
    """Three ranks joined in one gloo group for the whole session."""
    with WorkerPool(3) as pool:
        yield pool


@pytest.fixture(scope="session")
def bare_pool2():
    """Two ranks with launcher variables but no process group: unison must make its own."""
    with WorkerPool(2, init_group=False) as pool:
        yield pool
