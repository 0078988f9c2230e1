"""A real SLURM cluster for the tests: munged, slurmctld and two slurmd (two nodes) on this machine.

Debian's `slurm-wlm` (22.05: `apt-get install slurmctld slurmd slurm-client munge`, which
`make slurm-deps` does) run without systemd: a private `munged` with its own key and socket, then
`slurmctld` and `slurmd` in the foreground, every file (slurm.conf, state, spool, logs) in one
temporary folder and both ports free ones, so nothing of the machine's own SLURM is used or
changed. `proctrack/linuxproc` and `task/none` (no cgroups needed), no accounting,
`select/cons_tres`. The daemons are children of the test process and get SIGTERM if it dies
(`PR_SET_PDEATHSIG`): none outlives the session.

Two nodes, `unison-n1` and `unison-n2`: each `slurmd -N <node>` runs in its own UTS namespace
(its host name is the node's, as `hostname` in a task says) and mount namespace (an /etc/hosts
of its own, where both names are 127.0.0.1, bound over the machine's), on a port of its own,
sharing the machine's network. Where namespaces cannot be made (`unshare` refused), one node
with the machine's host name instead, and `nodes` says 1.

Two settings shorten what a real cluster waits, so the suite stays fast (both named in
docs/faults.md): `AuthInfo=cred_expire=5` (a requeued job is held `cred_expire + 1` s before it
may start again: 121 s by default) and `SchedulerParameters=bf_interval=1` (the backfill pass,
which starts it, runs every second instead of every 30 s).

>>> # with SlurmCluster.start(tmp) as cluster:
>>> #     job = cluster.sbatch(["--ntasks=2", "--wrap", "srun hostname"])
>>> #     cluster.wait_done(job)
"""

from __future__ import annotations

import ctypes
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo")
CPUS = 4  # declared (config_overrides): 4 tasks fit on a 2-core machine
CRED_EXPIRE_S = 5  # the least SLURM takes ("AuthInfo=cred_expire=2 invalid")
_PR_SET_PDEATHSIG = 1
# Reasons a pending job gives when it can never start on this cluster (too many nodes, ...).
_NEVER = {"PartitionNodeLimit", "PartitionConfig", "BadConstraints", "ReqNodeNotAvail"}
_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


def why_unavailable() -> str | None:
    """One line saying why no cluster can run here, or None when one can."""
    missing = [name for name in DAEMONS + CLIENTS if _which(name) is None]
    if missing:
        return (
            f"SLURM is not installed ({', '.join(missing)} missing): `make slurm-deps` installs Debian's "
            "slurmctld slurmd slurm-client munge"
        )
    if os.geteuid() != 0:
        return "the SLURM daemons (slurmd starts every user's tasks) need root; the tests run as a user"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def _free_port(lo: int = 0) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", lo))
        return s.getsockname()[1]


def _first_job_id() -> int:
    """A first job id whose rendezvous port (unison's 15000 + id mod 15000) and the next 50 are free
    now, so two clusters on one machine (two test sessions) do not meet on one port."""
    for _ in range(200):
        port = random.randrange(15000, 29900)
        try:
            for p in range(port, port + 50):
                _free_port(p)
        except OSError:
            continue
        return port  # its job port: 15000 + port mod 15000 = port
    raise RuntimeError("no run of 50 free ports in 15000..29999 for the SLURM test cluster's jobs")


def _die_with_parent() -> None:
    """In the daemon, before exec: SIGTERM when the test process that started it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _namespaces_work() -> bool:
    """True when this process may give a child its own UTS and mount namespaces (root, no seccomp)."""
    unshare = _which("unshare")
    if unshare is None:
        return False
    probe = [unshare, "--uts", "--mount", "--propagation", "private", "true"]
    return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


class SlurmCluster:
    """One controller and two nodes (or one: see the module's docstring), all files in `root`."""

    def __init__(self, root: Path):
        self.root = root
        self.nodes = ["unison-n1", "unison-n2"] if _namespaces_work() else [socket.gethostname()]
        self.node = self.nodes[0]
        self.conf = root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        # The clients find the cluster by SLURM_CONF; a job's tasks inherit it (scontrol requeue).
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        self.env["SLURM_CONF"] = str(self.conf)

    @classmethod
    def start(cls, root: Path, timeout: float = 90.0) -> SlurmCluster:
        """Write the configuration, start the three daemons, wait until the node is idle."""
        cluster = cls(root)
        try:
            cluster._write_config()
            cluster._start_daemons()
            cluster._wait_idle(timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- setting up ------------------------------------------------------------------------------
    def _write_config(self) -> None:
        munge = self.root / "munge"
        for folder in (munge, self.root / "state", self.root / "spool", self.root / "log"):
            folder.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o755)  # munged wants its socket's folder reachable, not writable, by others
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = munge / "socket"
        self.first_job_id = _first_job_id()
        r = self.root
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=unisontest",
                    "SlurmctldHost=localhost(127.0.0.1)",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    # cred_expire: a requeued job is held cred_expire + 1 s (default 120 + 1)
                    f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}",
                    # the backfill pass starts a requeued job once eligible: every 1 s, not 30
                    "SchedulerType=sched/backfill",
                    "SchedulerParameters=bf_interval=1,sched_interval=1",
                    f"FirstJobId={self.first_job_id}",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}/%n",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd'}-%n.pid",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log'}/slurmd-%n.log",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "MpiDefault=none",
                    "SwitchType=switch/none",
                    "ReturnToService=2",
                    "MinJobAge=600",  # ended jobs stay visible to scontrol show job
                    "SlurmdParameters=config_overrides",  # the declared CPUs, whatever the machine has
                    *(
                        f"NodeName={node} NodeAddr=127.0.0.1 Port={_free_port()} CPUs={CPUS} State=UNKNOWN"
                        for node in self.nodes
                    ),
                    "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def _start_daemons(self) -> None:
        munge = self.root / "munge"
        self._daemon(
            "munged",
            ["-F", "--force", f"--socket={self.munge_socket}", f"--key-file={munge / 'munge.key'}"]
            + [f"--log-file={munge / 'log'}", f"--pid-file={munge / 'pid'}", f"--seed-file={munge / 'seed'}"],
        )
        self._wait_for(lambda: self.munge_socket.exists(), 20, "munged made no socket")
        self._daemon("slurmctld", ["-D", "-i", "-f", str(self.conf)])
        self._wait_for(
            lambda: self._run(["scontrol", "ping"]).returncode == 0, 40, "slurmctld did not answer"
        )
        if len(self.nodes) == 1:
            self._daemon("slurmd", ["-D", "-f", str(self.conf), "-N", self.node])
            return
        hosts = self.root / "hosts"
        hosts.write_text(Path("/etc/hosts").read_text() + "".join(f"127.0.0.1 {n}\n" for n in self.nodes))
        for node in self.nodes:  # the namespaces end with the slurmd: exec, no shell left behind
            slurmd = f"{_which('slurmd')} -D -f {self.conf} -N {node}"
            inner = f"mount --bind {hosts} /etc/hosts && hostname {node} && exec {slurmd}"
            self._daemon(node, ["--uts", "--mount", "--propagation", "private", "sh", "-c", inner], "unshare")

    def _daemon(self, name: str, args: list[str], program: str | None = None) -> None:
        out = open(self.root / "log" / f"{name}.console", "wb")  # noqa: SIM115 - the daemon's lifetime
        self.procs[name] = subprocess.Popen(
            [_which(program or name) or name, *args],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        out.close()

    def _wait_idle(self, timeout: float) -> None:
        def idle() -> bool:
            out = self._run(["sinfo", "-h", "-N", "-o", "%T"]).stdout.split()
            return out == ["idle"] * len(self.nodes)

        self._wait_for(idle, timeout, "the nodes did not become idle")

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"SLURM test cluster: {what} ({'; '.join(self._logs_tail())})")
            time.sleep(0.2)

    def _logs_tail(self) -> list[str]:
        said = [f"{n} exited {p.returncode}" for n, p in self.procs.items() if p.poll() is not None]
        for log in sorted((self.root / "log").glob("*")):
            lines = log.read_text(errors="replace").strip().splitlines()
            if lines:
                said.append(f"{log.name}: {lines[-1]}")
        return said

    # ---- using it --------------------------------------------------------------------------------
    def _run(self, cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def run(self, cmd: list[str], timeout: float = 60) -> str:
        """Run a SLURM client command against this cluster; its stdout (it must succeed)."""
        done = self._run(cmd, timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
        """Submit (`sbatch --parsable ARGS`); the job id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *args],
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        """`scontrol show job JOB` as a dict (JobState, ExitCode, Restarts, EligibleTime, ...)."""
        text = self.run(["scontrol", "show", "job", "-o", job])
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_state(self, job: str, states: set[str], timeout: float) -> dict[str, str]:
        """Poll until the job is in one of `states` (e.g. {"RUNNING"}); its last record."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job)
            if info.get("JobState") in states:
                return info
            if info.get("JobState") == "PENDING" and info.get("Reason") in _NEVER:
                raise RuntimeError(f"job {job} can never start here ({info['Reason']}): {info}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} still {info.get('JobState')} after {timeout:.0f} s: {info}")
            time.sleep(0.2)

    def wait_done(self, job: str, timeout: float = 240) -> dict[str, str]:
        """Poll until the job ended (COMPLETED, FAILED, ...); its last record."""
        return self.wait_state(job, _ENDED, timeout)

    # ---- tearing down ----------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel every job, wait for their processes, then end the daemons (SIGTERM, then SIGKILL)."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self._run(["scancel", "--full", "--state=RUNNING"], timeout=30)
            self._run(["scancel", "--state=PENDING"], timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                left = self._run(["squeue", "-h", "-o", "%i"], timeout=30).stdout.split()
                if not left:
                    break
                time.sleep(0.2)
        for name in reversed(list(self.procs)):  # the slurmd first, munged last
            proc = self.procs[name]
            if proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=20)
