"""What a Kubernetes operator tells `unison launch` about the job, through the container's environment.

`unison launch train.py`, with no other option, is the whole command of a training container:

- Kubeflow Trainer v2 (TrainJob) and a PyTorchJob with `nprocPerNode` or an `elasticPolicy` set
  torchrun's `PET_*` variables (`PET_NNODES`, `PET_NPROC_PER_NODE`, `PET_NODE_RANK`,
  `PET_MASTER_ADDR`/`PORT`, or `PET_RDZV_ENDPOINT` and `PET_NNODES=MIN:MAX`): `unison launch`
  reads them as torchrun does (`unison.launch.options.pet_defaults`).
- A PyTorchJob (v1) without them sets only `MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE` and `RANK`,
  and there they count pods, not processes: `WORLD_SIZE` is the number of pods and `RANK` this
  pod's index (the Master is 0, Worker i is i+1). Read as a process rank, every pod would train
  alone on its own copy of the data (or wait forever for processes that never come); read here
  as machines, each pod is one node of a static rendezvous hosted by the Master.
- TorchX: `examples/kubernetes/unison_torchx.py` puts its job into `PET_*` variables too.

A launch option on the command line (`--nnodes`, `--node-rank`, `--master-addr`, `--rdzv-endpoint`,
`--standalone`) wins over all of these, as it does over SLURM's.

>>> pytorchjob_layout({"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2"})
(3, 2, 'job-master-0', 23456)
"""

from __future__ import annotations

from collections.abc import Mapping

from unison.distributed.slurm import launcher_layout

__all__ = ["PYTORCHJOB_VARS", "node_layout", "pytorchjob_layout"]

#: The variables a PyTorchJob (v1) sets in every container of a job with a Master replica.
PYTORCHJOB_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
#: torchrun's own description of the nodes: where any of these is set, `PET_*` says it all.
_PET_NODE_VARS = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_RDZV_ENDPOINT")
#: Set inside a process torchrun or `unison launch` started: there RANK is a process's rank.
_WORKER_VARS = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "GROUP_RANK")


def pytorchjob_layout(env: Mapping[str, str]) -> tuple[int, int, str, int] | None:
    """`(nnodes, node_rank, master_addr, master_port)` from a v1 PyTorchJob's pod variables, or None.

    None where they are not all set, where `PET_*` variables describe the nodes (newer operators
    set both, and then `WORLD_SIZE` counts processes), inside a launched worker, or for one pod.
    A `RANK` outside `WORLD_SIZE` or a variable that is not a number is refused in one line.

    >>> pytorchjob_layout({"MASTER_ADDR": "m", "MASTER_PORT": "1", "WORLD_SIZE": "2", "RANK": "0",
    ...                    "PET_NNODES": "2"}) is None
    True
    """
    if any(env.get(name) for name in _PET_NODE_VARS) or any(name in env for name in _WORKER_VARS):
        return None
    if not all(env.get(name) for name in PYTORCHJOB_VARS):
        return None
    try:
        pods, pod, port = int(env["WORLD_SIZE"]), int(env["RANK"]), int(env["MASTER_PORT"])
    except ValueError:
        shown = ", ".join(f"{name}={env[name]!r}" for name in PYTORCHJOB_VARS)
        raise ValueError(f"a PyTorchJob's pod variables must be numbers and a host: {shown}") from None
    if pods <= 1:
        return None  # one pod: nothing to join, a standalone launch
    if not 0 <= pod < pods:
        raise ValueError(
            f"RANK={pod} is outside WORLD_SIZE={pods} (a PyTorchJob's pod index and pod count): "
            "pass --nnodes/--node-rank to say which node this is"
        )
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT={port} is not a port (1..65535)")
    return pods, pod, env["MASTER_ADDR"], port


def node_layout(env: Mapping[str, str]) -> tuple[int, int, str, int] | None:
    """`(nnodes, node_rank, master_addr, master_port)` for this `unison launch` from its scheduler's
    variables: one srun task per node (`unison.distributed.slurm`), or a PyTorchJob (v1) pod.

    >>> node_layout({})  # neither: the command line (or torchrun's PET_* variables) says it
    """
    return launcher_layout(env) or pytorchjob_layout(env)
