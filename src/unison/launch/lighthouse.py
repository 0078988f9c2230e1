"""The `unison launch` options that start or join torchft's lighthouse for `distrib_ctx(fault_tolerant=True)`
replicas (`unison lighthouse` is `unison.cli`'s; torchft's server starts in `distributed.lighthouse`).

- `ReplicaOptions` / `add_replica_options` / `replica_options`: `unison launch --lighthouse ADDRESS`,
  `--start-lighthouse [--min-replicas N] [--lighthouse-join-timeout-ms MS] [--lighthouse-quorum-tick-ms MS]
  [--lighthouse-heartbeat-timeout-ms MS]` and `--replica-id NAME`, checked before anything starts;
  `served_lighthouse` runs the launch's own lighthouse in a process of its own while the launch runs.

One `unison launch` is one replica group: with `--max-restarts N` its elastic agent restarts this
group alone when one of its processes dies, while the other replica groups (other launches) keep
training.

>>> parser = argparse.ArgumentParser()
>>> add_replica_options(parser)
>>> replica_options(parser.parse_args(["--lighthouse", "http://host:29510", "--replica-id", "a"])).env()
{'TORCHFT_LIGHTHOUSE': 'http://host:29510', 'UNISON_REPLICA_ID': 'a'}
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import select
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from unison.distributed.lighthouse import (
    HEARTBEAT_TIMEOUT_MS,
    JOIN_TIMEOUT_MS,
    QUORUM_TICK_MS,
)
from unison.distributed.network import port_in_use
from unison.env_names import LIGHTHOUSE_ENV, LIGHTHOUSE_PARENT_ENV, REPLICA_ENV
from unison.launch.options import LaunchError

#: The port `unison lighthouse` and `unison launch --start-lighthouse` serve on unless told.
DEFAULT_PORT = 29510
#: A served lighthouse's timings in ms, (field, default, what it sets): `unison lighthouse
#: --join-timeout-ms MS`, and `unison launch --lighthouse-join-timeout-ms MS` for the one it starts.
TIMINGS = (
    ("join_timeout_ms", JOIN_TIMEOUT_MS, "wait for late replicas"),
    ("quorum_tick_ms", QUORUM_TICK_MS, "quorum check period"),
    ("heartbeat_timeout_ms", HEARTBEAT_TIMEOUT_MS, "a replica silent this long is gone"),
)
_ADDRESS = re.compile(r"^http://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


class LighthouseOptionError(LaunchError):
    """A `--lighthouse` / `--start-lighthouse` / `--replica-id` choice that cannot work."""


@dataclass(frozen=True)
class ReplicaOptions:
    """`unison launch`'s replica-group options, checked.

    >>> ReplicaOptions(start_lighthouse=True, min_replicas=2, replica_id="a").env()
    {'UNISON_REPLICA_ID': 'a'}
    """

    lighthouse: str | None = None
    start_lighthouse: bool = False
    min_replicas: int = 1
    lighthouse_port: int = DEFAULT_PORT
    replica_id: str | None = None
    #: the started lighthouse's timings (`unison lighthouse`'s options of the same names, in ms)
    join_timeout_ms: int = JOIN_TIMEOUT_MS
    quorum_tick_ms: int = QUORUM_TICK_MS
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS

    @property
    def active(self) -> bool:
        return bool(self.lighthouse or self.start_lighthouse or self.replica_id)

    def env(self, served_at: str | None = None) -> dict[str, str]:
        """What the workers get: the lighthouse's address and the group's name."""
        env = {}
        if self.lighthouse or served_at:
            env[LIGHTHOUSE_ENV] = str(self.lighthouse or served_at)
        if self.replica_id:
            env[REPLICA_ENV] = self.replica_id
        return env


def add_replica_options(parser: argparse.ArgumentParser) -> None:
    """`--lighthouse`, `--start-lighthouse`, `--min-replicas`, `--lighthouse-port`, `--replica-id`."""
    add = parser.add_argument
    add(
        "--lighthouse",
        metavar="ADDRESS",
        help="the torchft lighthouse to join (http://host:port), for distrib_ctx(fault_tolerant=True)",
    )
    add(
        "--start-lighthouse",
        action="store_true",
        help="start torchft's lighthouse in its own process for the launch's life and print its address",
    )
    add("--min-replicas", type=int, default=None, metavar="N", help="started lighthouse: fewest replicas")
    add("--lighthouse-port", type=int, default=None, metavar="P", help="its port (default 29510; 0: any)")
    add("--replica-id", metavar="NAME", help="this replica group's name (UNISON_REPLICA_ID); kept on restart")
    for field, default, text in TIMINGS:
        text = f"started lighthouse: {text} ({default})"
        add(timing_flag(field, "--lighthouse-"), dest=field, type=int, metavar="MS", help=text)


def timing_flag(field: str, prefix: str) -> str:
    """The option of a `TIMINGS` field: `timing_flag("quorum_tick_ms", "--")` is "--quorum-tick-ms"."""
    return prefix + field.replace("_", "-")


def check_served(
    min_replicas: int | None, port: int | None, timings: dict[str, int | None], prefix: str
) -> None:
    """A lighthouse to serve, checked: raise `LighthouseOptionError` (one line) on a bad setting.
    `prefix` starts the port's and timings' options: "--" (`unison lighthouse --port`) or
    "--lighthouse-" (`unison launch --lighthouse-port`).

    >>> check_served(2, 0, {"quorum_tick_ms": 100}, "--")
    """
    for field, value in timings.items():
        if value is not None and value < 1:
            flag = timing_flag(field, prefix)
            raise LighthouseOptionError(f"{flag} must be at least 1 (milliseconds), got {value}")
    if min_replicas is not None and min_replicas < 1:
        raise LighthouseOptionError(f"--min-replicas must be at least 1, got {min_replicas}")
    if port is not None and not 0 <= port < 65536:
        raise LighthouseOptionError(f"{prefix}port must be in 0..65535, got {port}")


def replica_options(a: argparse.Namespace) -> ReplicaOptions:
    """Check the replica-group options; raise `LighthouseOptionError` (one line) on bad input."""
    if a.lighthouse and a.start_lighthouse:
        raise LighthouseOptionError(
            "--lighthouse and --start-lighthouse exclude each other: join one lighthouse, or start it"
        )
    address = _ADDRESS.match(a.lighthouse) if a.lighthouse else None
    if a.lighthouse and address is None:
        raise LighthouseOptionError(f"--lighthouse {a.lighthouse}: expected http://host:port")
    if address is not None and not 0 < int(address.group(2)) < 65536:
        raise LighthouseOptionError(f"--lighthouse {a.lighthouse}: the port must be in 1..65535")
    timings = {field: getattr(a, field, None) for field, _, _ in TIMINGS}
    started_only = [("--min-replicas", a.min_replicas), ("--lighthouse-port", a.lighthouse_port)]
    for flag, value in [(timing_flag(f, "--lighthouse-"), v) for f, v in timings.items()] + started_only:
        if value is not None and not a.start_lighthouse:
            raise LighthouseOptionError(f"{flag} needs --start-lighthouse")
    check_served(a.min_replicas, a.lighthouse_port, timings, "--lighthouse-")
    if a.replica_id is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", a.replica_id):
        raise LighthouseOptionError(
            f"--replica-id {a.replica_id!r}: use letters, digits, '.', '_' or '-' (names the group in logs)"
        )
    port = DEFAULT_PORT if a.lighthouse_port is None else a.lighthouse_port
    if a.start_lighthouse and port and port_in_use(port):
        raise LighthouseOptionError(
            f"--start-lighthouse: port {port} is already in use on this machine (another lighthouse?): "
            "join it with --lighthouse http://host:port, or choose --lighthouse-port"
        )
    given = {field: value for field, value in timings.items() if value is not None}
    return ReplicaOptions(a.lighthouse, a.start_lighthouse, a.min_replicas or 1, port, a.replica_id, **given)


@contextlib.contextmanager
def served_lighthouse(opts: ReplicaOptions) -> Iterator[str | None]:
    """With `--start-lighthouse`: `unison lighthouse` in a process of its own, serving until the
    block ends (or its launcher dies); its address. Its log goes to a temporary file, read back
    only when it fails to start (a port in use: one line).

        with served_lighthouse(ReplicaOptions(start_lighthouse=True, min_replicas=2)) as address:
            print(address)
    """
    if not opts.start_lighthouse:
        yield None
        return
    cmd = [sys.executable, "-m", "unison.cli", "lighthouse", "--min-replicas", str(opts.min_replicas)]
    cmd += ["--port", str(opts.lighthouse_port)]
    for field, _, _ in TIMINGS:
        cmd += [timing_flag(field, "--"), str(getattr(opts, field))]
    env = {**os.environ, LIGHTHOUSE_PARENT_ENV: str(os.getpid())}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        assert proc.stdout is not None  # stdout=PIPE
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            line = proc.stdout.readline().strip() if ready else ""
            if not line.startswith(f"{LIGHTHOUSE_ENV}="):
                if ready:  # it said something else and ended: its last line says why
                    proc.wait(timeout=10)
                log.seek(0)
                said = log.read().strip().splitlines() or ["it did not start within 60 s"]
                raise RuntimeError(said[-1].removeprefix("unison lighthouse: "))
            yield line.split("=", 1)[1]
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
