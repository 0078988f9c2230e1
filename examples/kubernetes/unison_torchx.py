"""A TorchX component that runs `unison launch train.py` on every replica (Kubernetes or any scheduler).

    torchx run -s kubernetes -cfg queue=default,namespace=default \\
        examples/kubernetes/unison_torchx.py:ddp --image REGISTRY/unison-train:latest -j 2x1 \\
        --script examples/train_digits.py -- --bs 32
    torchx run -s kubernetes examples/kubernetes/unison_torchx.py:ddp -j 1:2x1 --max_restarts 3 ...  # elastic

TorchX's own `dist.ddp` runs `torchrun` with its options on the command line; a unison script runs
unchanged under it too (unison reads torchrun's variables). This component runs `unison launch`
instead (per-rank output, one failure summary, the checks before anything starts), with the job
described the way Kubeflow describes it: torchrun's `PET_*` variables. Each replica's command is

    PET_NNODES=2 PET_NPROC_PER_NODE=1 PET_RDZV_BACKEND=c10d PET_RDZV_ID=<app id> PET_MAX_RESTARTS=0 \\
    PET_RDZV_ENDPOINT=${<rank 0 host variable>:=localhost}:29500 exec unison launch train.py ARGS

where the rank-0 host variable is the one the scheduler sets (TorchX's `macros.rank0_env`: for
example `TORCHX_RANK0_HOST` on rank 0 of the local and LSF schedulers, `VC_<ROLE>_0_HOSTS` on
Kubernetes with Volcano). `launch_command` builds that line without TorchX (the tests run it in two
network namespaces); `ddp` wraps it in TorchX's `AppDef` and needs `pip install torchx`.
"""

# No `from __future__ import annotations`: TorchX reads the component's annotations as types.
import shlex

try:
    from torchx import specs
except ImportError:  # launch_command needs no TorchX (the tests use it); ddp() does

    class specs:  # noqa: N801  (a stand-in, so that the annotation `specs.AppDef` below still reads)
        AppDef = None


RDZV_PORT = 29500  # TorchX dist.ddp's rendezvous port


def parse_j(j: str) -> tuple[str, int]:
    """`-j NNODESxNPROC` (NNODES may be MIN:MAX) as `(nnodes, nproc)`.

    >>> parse_j("1:2x4")
    ('1:2', 4)
    """
    nodes, sep, nproc = j.partition("x")
    if not sep or not nproc.isdigit() or not all(p.isdigit() for p in nodes.split(":")):
        raise ValueError(f"-j {j}: expected NNODESxNPROC_PER_NODE, e.g. 2x1 or 1:4x2")
    return nodes, int(nproc)


def launch_command(
    script: str,
    script_args: list[str] | tuple[str, ...] = (),
    j: str = "2x1",
    rdzv_id: str = "unison",
    rank0_env: str = "TORCHX_RANK0_HOST",
    max_restarts: int = 0,
    rdzv_port: int = RDZV_PORT,
    launcher: str = "unison launch",
) -> str:
    """The shell line every replica runs: the job in `PET_*` variables, then `unison launch script`.

    >>> launch_command("train.py", ["--bs", "32"], j="2x1", rdzv_id="app7")  # doctest: +NORMALIZE_WHITESPACE
    'PET_NNODES=2 PET_NPROC_PER_NODE=1 PET_RDZV_BACKEND=c10d PET_RDZV_ID=app7 PET_MAX_RESTARTS=0
     PET_RDZV_ENDPOINT=${TORCHX_RANK0_HOST:=localhost}:29500 exec unison launch train.py --bs 32'
    """
    nnodes, nproc = parse_j(j)
    job = {
        "PET_NNODES": nnodes,
        "PET_NPROC_PER_NODE": str(nproc),
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ID": rdzv_id,
        "PET_MAX_RESTARTS": str(max_restarts),
    }
    assigned = " ".join(f"{name}={shlex.quote(value)}" for name, value in job.items())
    endpoint = f"PET_RDZV_ENDPOINT=${{{rank0_env}:=localhost}}:{rdzv_port}"  # expanded by bash on the replica
    command = " ".join(shlex.quote(part) for part in (*shlex.split(launcher), script, *script_args))
    return f"{assigned} {endpoint} exec {command}"


def ddp(
    *script_args: str,
    script: str,
    image: str,
    j: str = "2x1",
    max_restarts: int = 0,
    cpu: int = 2,
    memMB: int = 4096,  # noqa: N803  (TorchX's spelling)
    gpu: int = 0,
    name: str = "unison-train",
) -> specs.AppDef:
    """TorchX component: `j` replicas (NNODES, or MIN:MAX for an elastic job) of `unison launch script`.

    Args:
        script_args: arguments for the training script
        script: the training script, a path inside the image
        image: the container image (with unison and the script)
        j: NNODESxNPROC_PER_NODE, e.g. 2x1 or 1:4x1
        max_restarts: restarts of the workers (torch's agent) before the job fails
        cpu: CPUs per replica
        memMB: memory per replica, in MB
        gpu: GPUs per replica
        name: the job's name
    """
    if specs.AppDef is None:
        raise ImportError("the TorchX component needs TorchX: pip install torchx")
    nnodes, _ = parse_j(j)
    replicas = int(nnodes.split(":")[-1])
    line = launch_command(
        script, script_args, j, rdzv_id=specs.macros.app_id, rank0_env=specs.macros.rank0_env,
        max_restarts=max_restarts,
    )  # fmt: skip
    role = specs.Role(
        name="trainer",
        image=image,
        entrypoint="bash",
        args=["-c", line],
        num_replicas=replicas,
        min_replicas=int(nnodes.split(":")[0]),
        resource=specs.Resource(cpu=cpu, gpu=gpu, memMB=memMB),
        port_map={"c10d": RDZV_PORT},
        max_retries=max_restarts,
    )
    return specs.AppDef(name=name, roles=[role])
