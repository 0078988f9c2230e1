import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Worker processes import test functions by module name (tests.distributed.test_x).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
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


# TEMP: CPU per test
import json as _json  # noqa: E402
import resource as _resource  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    def cpu():
        c = _resource.getrusage(_resource.RUSAGE_CHILDREN)
        s = _resource.getrusage(_resource.RUSAGE_SELF)
        return c.ru_utime + c.ru_stime, s.ru_utime + s.ru_stime
    import time as _t
    c0, s0 = cpu()
    w0 = _t.monotonic()
    yield
    c1, s1 = cpu()
    with open(f"/tmp/cpu_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "a") as f:
        f.write(_json.dumps({"id": item.nodeid, "children": c1 - c0, "self": s1 - s0, "wall": _t.monotonic() - w0}) + "\n")
