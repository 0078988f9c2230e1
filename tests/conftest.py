import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Worker processes import test functions by module name (tests.distributed.test_x).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(ROOT))

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


POOL_FIXTURES = {"pool2", "pool3", "bare_pool2"}


def pytest_collection_modifyitems(items):
    """Tests on the shared process pools start real processes: mark them slow like the launch tests."""
    for item in items:
        if POOL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
