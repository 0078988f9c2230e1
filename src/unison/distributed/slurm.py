"""What SLURM tells a task it started: rank, world, local rank, and where rank 0 lives.

`srun --ntasks-per-node=2 python train.py` starts every process itself, with no launcher: each
task reads its place from `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`, `SLURM_LOCALID`, and the
rendezvous address from the first host of the step's node list, with a port derived from the
job id (so every task of the job computes the same one), unless `MASTER_ADDR` / `MASTER_PORT`
are set. Only a task srun started counts: a batch script, an `salloc` shell or torchrun inside
a job also carry `SLURM_*` variables (`SLURM_PROCID=0`, `SLURM_NTASKS=8` in a batch script),
and reading those as "rank 0 of 8" is the classic hang at rendezvous. srun marks its tasks
with the step's variables (`SLURM_STEP_NUM_TASKS`), which none of those have.

>>> expand_hostlist("n[001-003,007],login")
['n001', 'n002', 'n003', 'n007', 'login']
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
from collections.abc import Mapping
from itertools import product

PORT_BASE, PORT_SPAN = 15000, 15000  # job ports in 15000..29999: below Linux's ephemeral range
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "GROUP_RANK")


def is_srun_task(env: Mapping[str, str]) -> bool:
    """True in a process srun started as one task of a step, and not under another launcher.

    >>> is_srun_task({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"})       # a batch script
    False
    """
    if any(name in env for name in _LAUNCHER_VARS):  # torchrun / unison launch inside the job
        return False
    return "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env


def expand_hostlist(hostlist: str) -> list[str]:
    """Every host of a SLURM host list: `a,b`, `n[1-3]`, `n[01-02,7]`, `rack[1-2]-n[1-2]`.

    >>> expand_hostlist("linux[1,2]")
    ['linux1', 'linux2']
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        parts = re.split(r"(\[[^\]]*\])", item)
        choices = [_expand_range(p[1:-1]) if p.startswith("[") else [p] for p in parts if p]
        if not choices:
            continue
        hosts.extend("".join(combo) for combo in product(*choices))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    if depth != 0:
        raise ValueError(f"SLURM host list {text!r} has an unclosed bracket")
    return [i for i in items if i]


def _expand_range(spec: str) -> list[str]:
    out = []
    for part in spec.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                raise ValueError(f"SLURM host list range [{spec}] is not lo-hi with lo <= hi")
            out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]  # n[001-010] keeps width
        elif part:
            out.append(part)
    return out


def first_host(env: Mapping[str, str]) -> str:
    """The step's (else the job's) first node: where rank 0 runs under srun's block placement.
    `scontrol show hostnames` expands the list when it is on PATH, else unison's own parser does."""
    hostlist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not hostlist:
        raise ValueError(
            "SLURM task without SLURM_JOB_NODELIST: cannot tell where rank 0 runs; set MASTER_ADDR"
        )
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", hostlist], capture_output=True, text=True, timeout=10
            )
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass  # a broken scontrol (a container without the daemon's config): parse it ourselves
    return expand_hostlist(hostlist)[0]


def job_port(env: Mapping[str, str]) -> int:
    """A rendezvous port every task of the job derives alike from `SLURM_JOB_ID`.

    >>> job_port({"SLURM_JOB_ID": "4242"})
    19242
    """
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "0"
    return PORT_BASE + int(job) % PORT_SPAN


def tasks_on_this_node(env: Mapping[str, str]) -> int | None:
    """This node's task count from `SLURM_STEP_TASKS_PER_NODE` ("2(x3),1": 2 on nodes 0-2, 1 on node 3)."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = env.get("SLURM_NODEID")
    if not spec or node is None:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[int(node)] if int(node) < len(counts) else None


def rendezvous(env: Mapping[str, str]) -> tuple[str, int]:
    """`(master_addr, master_port)` of an srun step: the job's `MASTER_ADDR` / `MASTER_PORT` where
    exported, else the first node and the job's port."""
    port = env.get("MASTER_PORT")
    return env.get("MASTER_ADDR") or first_host(env), int(port) if port else job_port(env)


def srun_layout(env: Mapping[str, str]) -> tuple[int, int, int, int, str, int]:
    """`(rank, world_size, local_rank, local_world_size, master_addr, master_port)` of an srun
    task (see `is_srun_task`)."""
    world = int(env["SLURM_STEP_NUM_TASKS"])
    local = int(env.get("SLURM_LOCALID", "0"))
    return (int(env["SLURM_PROCID"]), world, local, tasks_on_this_node(env) or world, *rendezvous(env))


def launcher_layout(env: Mapping[str, str]) -> tuple[int, int, str, int] | None:
    """`(nnodes, node_rank, master_addr, master_port)` for one `unison launch` per node started by
    srun (`srun --ntasks-per-node=1 unison launch --nproc-per-node 2 train.py`); None when this
    launcher is not an srun task. A step with more tasks than nodes is refused naming both.

    >>> launcher_layout({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2",
    ...                  "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7"})
    (2, 1, 'n1', 15007)
    """
    if not is_srun_task(env):
        return None
    tasks = int(env["SLURM_STEP_NUM_TASKS"])
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or tasks)
    if tasks != nodes:
        raise ValueError(
            f"srun started {tasks} tasks on {nodes} nodes, but unison launch runs one per node and "
            "starts the processes itself: use srun --ntasks-per-node=1 (or run the script with srun "
            "directly, without unison launch)"
        )
    return nodes, int(env.get("SLURM_NODEID", "0")), *rendezvous(env)


def task_threads(env: Mapping[str, str], share: int, cores: int) -> int | None:
    """torch's intra-op threads for an srun task, as `unison launch` gives its workers; None when
    `OMP_NUM_THREADS` is set (torch applied it at start: the user's choice stands).

    `SLURM_CPUS_PER_TASK` (`srun -c N`: the CPUs SLURM gave each task, at most the usable cores),
    else `share`: the usable cores shared among this node's tasks. Without it every task took
    every core (torch's default: 2 tasks x 2 threads on 2 cores).

    >>> task_threads({"SLURM_CPUS_PER_TASK": "4"}, share=8, cores=16)
    4
    >>> task_threads({}, share=8, cores=16), task_threads({"OMP_NUM_THREADS": "2"}, share=8, cores=16)
    (8, None)
    """
    if env.get("OMP_NUM_THREADS"):
        return None
    per_task = env.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit() and int(per_task) > 0:
        return min(int(per_task), cores)
    return share


def job_to_requeue(env: Mapping[str, str]) -> str | None:
    """The id `scontrol requeue` takes for this job: `<array job>_<task>` in an array job, else the job id.

    >>> job_to_requeue({"SLURM_JOB_ID": "1207", "SLURM_ARRAY_JOB_ID": "1200", "SLURM_ARRAY_TASK_ID": "7"})
    '1200_7'
    """
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None


def requeue(env: Mapping[str, str]) -> str:
    """Run `scontrol requeue <job>` (see `job_to_requeue`); return one line saying what happened.
    Never raises: outside SLURM, without `scontrol` (a container), or when it fails, the line says
    so and names what to do instead. Called by rank 0 once a preempted run's checkpoint is written.

    >>> requeue({})
    'requeue asked, but this is not a SLURM job (no SLURM_JOB_ID): resubmit it yourself'
    """
    job = job_to_requeue(env)
    if job is None:
        return "requeue asked, but this is not a SLURM job (no SLURM_JOB_ID): resubmit it yourself"
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol is None:
        return (
            f"requeue asked, but scontrol is not on PATH (a container without SLURM's tools?): job {job} "
            f"was not requeued; resubmit it, or make scontrol reachable in the container"
        )
    try:
        done = subprocess.run(
            [scontrol, "requeue", job], capture_output=True, text=True, timeout=30, env=dict(env)
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol requeue {job} failed ({type(exc).__name__}: {exc}): resubmit the job yourself"
    if done.returncode == -signal.SIGTERM:
        # SLURM's requeue stops the job's processes at once, scontrol too if it has not exited yet
        # (under load it often has not): the request reached slurmctld, the answer did not reach us.
        return (
            f"job {job} requeue asked (scontrol requeue {job}); SLURM then stopped this job's processes, "
            f"scontrol among them, as a requeue does: `sacct -j {job}` shows whether it was requeued"
        )
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        why = said[-1] if said else f"exit status {done.returncode}"
        return f"scontrol requeue {job} failed ({why}): resubmit the job yourself (sbatch --requeue lets it)"
    return f"job {job} requeued (scontrol requeue {job})"
