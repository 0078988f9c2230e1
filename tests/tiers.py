"""Test tiers: what a test starts decides where it runs (a pytest plugin, loaded by tests/conftest.py).

A tier is a marker, registered in pyproject.toml:

    procs       starts Python processes: a gloo group (the pool fixtures), spawn, a fresh interpreter
    launch      runs `unison launch` (torch's elastic agent and its workers) or `unison check-exact`
    netns       builds network namespaces joined by a veth pair (root and iproute2; skips otherwise)
    ray         starts a local Ray cluster
    lighthouse  starts a torchft lighthouse (a server) and replicas that reach it
    slurm       runs jobs on the session's SLURM cluster (munged, slurmctld, slurmd: tests/slurm_cluster.py)

Every tier implies `slow`, so `pytest -m "not slow"` (`make test-fast`) is the in-process tier:
nothing in it starts an interpreter, a process group or a server; a forked DataLoader worker (a
copy of the test's process, milliseconds) and small system tools (`mount`, `ip`, a fake
`scontrol`) are allowed there.

A tier is applied by hand (`@pytest.mark.launch`, or a module's `pytestmark`) or by the fixture
a test uses (FIXTURE_TIERS), also when the test takes the fixture by name through
`request.getfixturevalue` (a parameter that holds the fixture's name).

Under pytest-xdist (`make test`: `-n` workers, `--dist loadgroup`), the tests that share one of
our fixtures wider than a function (the session's process pools, a module's launch run or network
namespaces) form one group and run on one worker, so the fixture starts once; the groups and
tests that take longest run first (as long as they took in the last run, kept in pytest's cache,
else by their tiers), so no long test starts last.

The process check (`--tier-check`): a test outside every tier that starts a Python interpreter
(a `subprocess` of this Python or of a console script beside it) is reported, or fails with
`--tier-check=fail` (`make test-fast`), naming the marker to add.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

TIERS = ("procs", "launch", "netns", "ray", "lighthouse", "slurm")

# Fixtures that start something: a test using one is in that tier.
FIXTURE_TIERS = {
    "pool2": "procs",
    "pool3": "procs",
    "bare_pool2": "procs",
    "machines": "netns",
    "local_ray": "ray",
    "slurm": "slurm",
}

# What a test of each tier takes, roughly, on a quiet 2-core machine (seconds): only the order in
# which parallel workers take the tests depends on it (the longest first), never a result.
TIER_COST_S = {"ray": 80.0, "netns": 45.0, "lighthouse": 40.0, "slurm": 30.0, "launch": 25.0, "procs": 4.0}
IN_PROCESS_COST_S = 0.2
# Tests on one session fixture (a pool) share it in runs of about this many, one worker each.
SESSION_GROUP_SIZE = 40

PYTHON_DIR = Path(sys.executable).parent  # the interpreter and its console scripts (unison, mkdocs)


# pytest-xdist's own grouping (xdist_group marks read into the test ids) does not reach pytest 9's
# structured test ids: each worker writes the groups it found into this folder instead, and the
# scheduler below reads them (the controller collects nothing itself).
GROUPS_ENV = "UNISON_TEST_GROUPS"


class TierWarning(pytest.PytestWarning):
    """A test outside every tier started a Python process."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier-check",
        choices=("warn", "fail", "off"),
        default="warn",
        help="a test outside every tier (procs, launch, netns, ray, lighthouse, slurm) that starts a Python "
        "process: warn (default), fail (make test-fast) or off",
    )


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        os.environ[GROUPS_ENV] = tempfile.mkdtemp(prefix="unison-test-groups-")  # the workers inherit it


def pytest_unconfigure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop(GROUPS_ENV, ""), ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup`, each test's group read from what the workers wrote (GROUPS_ENV)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FixtureGroupScheduling(LoadGroupScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            if scope != nodeid:  # xdist's own "@group" suffix (pytest before 9)
                return scope
            if self.groups is None:  # read once the workers have collected (and written them)
                self.groups = {}
                for path in Path(os.environ.get(GROUPS_ENV, "/nonexistent")).glob("*.json"):
                    self.groups.update(json.loads(path.read_text()))
            return self.groups.get(nodeid, nodeid)

    return FixtureGroupScheduling(config, log)


def _requested(item: pytest.Item) -> set[str]:
    """The fixtures a test uses: by argument, and by name through a parameter (getfixturevalue):
    a parameter's string that names no fixture is dropped by the callers' lookups."""
    names = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        names |= {v for v in callspec.params.values() if isinstance(v, str) and v.isidentifier()}
    return names


def tiers_of(item: pytest.Item) -> set[str]:
    """The tiers a test is in: its markers, and the fixtures it uses."""
    marked = {tier for tier in TIERS if item.get_closest_marker(tier)}
    return marked | {FIXTURE_TIERS[name] for name in _requested(item) if name in FIXTURE_TIERS}


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """Keys of our fixtures wider than a function that this test uses (one instance per key)."""
    manager = item.session._fixturemanager  # pytest's own lookup, as getfixturevalue does it
    keys = []
    for name in sorted(_requested(item)):
        defs = manager.getfixturedefs(name, item)
        if not defs:
            continue
        fixture = defs[-1]
        if fixture.scope == "function" or not fixture.baseid.startswith("tests"):
            continue  # per test, or pytest's own (tmp_path_factory): nothing to share
        if fixture.scope == "session":
            keys.append(f"fixture:{name}")
        else:  # module (or package, class): one instance for each module that uses it
            keys.append(f"fixture:{name}:{Path(item.nodeid.split('::')[0]).stem}")
    return keys


def _mark_groups(item: pytest.Item) -> set[str]:
    """The names of a test's xdist_group marks."""
    marks = item.iter_markers("xdist_group")
    return {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}


def _group(items: list[pytest.Item]) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Tests joined by a shared fixture or an xdist_group mark, transitively: nodeid -> group, and
    each group's fixtures (by name, for a readable group name)."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    by_session_fixture: dict[str, list[pytest.Item]] = {}
    for item in items:
        shared = _shared_fixtures(item)
        keys = [key for key in shared if key.count(":") == 2] + [f"mark:{n}" for n in _mark_groups(item)]
        for key in keys:
            parent[find(key)] = find(f"test:{item.nodeid}")
        # A session fixture (a process pool, the SLURM cluster) groups only tests that nothing
        # narrower groups; a test that uses another one as well starts it on its worker too.
        if not keys and any(key.count(":") == 1 for key in shared):
            by_session_fixture.setdefault(next(k for k in shared if k.count(":") == 1), []).append(item)
    for key, users in by_session_fixture.items():
        # Many tests on one pool: split in runs of about SESSION_GROUP_SIZE, one fixture each.
        runs = -(-len(users) // SESSION_GROUP_SIZE)
        for n, item in enumerate(users):
            parent[find(f"{key}{'#' + str(n * runs // len(users) + 1) if runs > 1 else ''}")] = find(
                f"test:{item.nodeid}"
            )
    names: dict[str, set[str]] = {}
    for key in parent:
        if not key.startswith("test:"):
            names.setdefault(find(key), set()).add(key.split(":", 1)[1])
    return {item.nodeid: find(f"test:{item.nodeid}") for item in items}, names


def _cost(item: pytest.Item, measured: dict[str, float]) -> float:
    """Seconds the test took in the last run that ran it (pytest's cache), else its tiers' estimate."""
    if item.nodeid in measured:
        return measured[item.nodeid]
    return sum(TIER_COST_S[t] for t in tiers_of(item)) or IN_PROCESS_COST_S


DURATIONS_KEY = "unison/durations"  # in pytest's cache (.pytest_cache): nodeid -> seconds, last run
# What the tests of 2 s or more took in a full `make test` (3 workers, 2 cores), committed: a fresh
# clone (CI) has no cache, and its tiers' estimates put a 60 s launch beside a 5 s one. The cache,
# where there is one, wins. Refresh after a full run: `python tests/tiers.py`.
DURATIONS_FILE = Path(__file__).with_name("durations.json")
_took: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's time (setup, call, teardown), for the next run's order (xdist: in the controller)."""
    _took[report.nodeid] = _took.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    cache = getattr(session.config, "cache", None)
    if cache is None or hasattr(session.config, "workerinput") or not _took:
        return
    cache.set(DURATIONS_KEY, {**cache.get(DURATIONS_KEY, {}), **{k: round(v, 2) for k, v in _took.items()}})


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        found = tiers_of(item)
        for tier in sorted(found):
            if not item.get_closest_marker(tier):
                item.add_marker(tier)
        if found and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    if not hasattr(config, "workerinput"):
        return  # not an xdist worker: the tests run in the order they are written
    groups, fixtures = _group(items)
    members: dict[str, list[pytest.Item]] = {}
    for item in items:
        members.setdefault(groups[item.nodeid], []).append(item)
    for root, group in members.items():
        if len(group) < 2:
            continue
        # xdist names a test's group by its xdist_group marks joined: give each member them all
        names = set().union(*(_mark_groups(item) for item in group))
        names = names or {"+".join(sorted(fixtures.get(root, {"shared"})))}
        for item in group:
            for name in sorted(names - _mark_groups(item)):
                item.add_marker(pytest.mark.xdist_group(name))
    written = {i.nodeid: "_".join(sorted(_mark_groups(i))) for i in items if _mark_groups(i)}
    folder = os.environ.get(GROUPS_ENV)
    if folder and os.path.isdir(folder):
        path = Path(folder) / f"{config.workerinput['workerid']}.json"
        path.with_suffix(".tmp").write_text(json.dumps(written))
        path.with_suffix(".tmp").rename(path)  # whole, for the scheduler that reads it
    # The groups that take longest first (members kept together, in their written order), so that no
    # long test is left to start last while the other workers have finished.
    cache = getattr(config, "cache", None)
    measured = json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.exists() else {}
    measured.update(cache.get(DURATIONS_KEY, {}) if cache is not None else {})
    cost = {root: sum(_cost(i, measured) for i in group) for root, group in members.items()}
    first = {root: n for n, root in reversed(list(enumerate(groups[i.nodeid] for i in items)))}
    written = {item.nodeid: n for n, item in enumerate(items)}
    items.sort(key=lambda i: (-cost[groups[i.nodeid]], first[groups[i.nodeid]], written[i.nodeid]))


# ---- the process check --------------------------------------------------------------------------
_started: list[str] = []
_watching = [False]


def _python_program(executable: object, argv: object) -> str | None:
    """The program a subprocess runs, where it is a Python interpreter or one of its console scripts."""
    if isinstance(argv, (str, bytes)):
        argv = shlex.split(os.fsdecode(argv)) if argv else []
    program = executable if executable is not None else (argv[0] if argv else "")
    program = os.fsdecode(program) if isinstance(program, (str, bytes, os.PathLike)) else ""
    path = Path(program)
    if path.name.startswith("python") or (path.is_absolute() and path.parent == PYTHON_DIR):
        return " ".join(str(a) for a in list(argv)[:4])
    return None


def _audit(event: str, args: tuple) -> None:
    if event == "subprocess.Popen" and _watching[0]:
        found = _python_program(args[0], args[1])
        if found:
            _started.append(found)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    mode = item.config.getoption("--tier-check")
    if mode == "off" or item.get_closest_marker("slow"):
        return (yield)
    _started.clear()
    _watching[0] = True
    try:
        result = yield
    finally:
        _watching[0] = False
    if _started:
        message = (
            f"{item.nodeid} is in the in-process tier but started a Python process ({_started[0]}): "
            f"mark it @pytest.mark.procs (or launch, netns, ray, lighthouse, slurm; see tests/tiers.py)"
        )
        if mode == "fail":
            pytest.fail(message, pytrace=False)
        warnings.warn(TierWarning(message), stacklevel=1)
    return result


sys.addaudithook(_audit)  # an audit hook cannot be removed: it only records while _watching


if __name__ == "__main__":  # tests/durations.json from the last full run's cache (run from the repository)
    cached = Path(".pytest_cache/v") / DURATIONS_KEY
    kept = {k: v for k, v in sorted(json.loads(cached.read_text()).items()) if v >= 2.0}
    DURATIONS_FILE.write_text(json.dumps(kept, indent=0) + "\n")
    print(f"{DURATIONS_FILE}: {len(kept)} tests of 2 s or more")
