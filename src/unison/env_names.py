"""The environment contract between `unison launch` (or `unison check-exact`, `unison.spawn`) and
its workers: every variable one side sets for the other, named once, here.

A launcher exports these into each worker's environment; the worker's modules read them. Both
sides import the names from this module (it imports nothing), so a rename cannot leave one side
reading a variable the other no longer sets. torch's and the schedulers' own variables (`RANK`,
`WORLD_SIZE`, `SLURM_*`, ...) are read where they are interpreted (`unison.distributed.env`,
`unison.distributed.slurm`); the ones listed under "torch's and CUDA's" are those unison sets or
reads for its own purposes.

>>> from unison.env_names import TIMEOUT_ENV
>>> TIMEOUT_ENV
'UNISON_TIMEOUT'
"""

from __future__ import annotations

# ---- set by `unison launch` for its workers --------------------------------------------------
#: The launcher's pid: a worker whose parent is already gone exits at once (`launch.worker`).
LAUNCHER_PID_ENV = "UNISON_LAUNCHER_PID"
#: The socket of the launch's zygote, which forks warm workers (`launch.zygote`); set for the stubs only.
ZYGOTE_ENV = "UNISON_ZYGOTE"
#: "0": every worker starts cold, a new interpreter (`launch.zygote.warm_start_allowed`).
WARM_START_ENV = "UNISON_WARM_START"
#: The pid of a process that imported the zygote's `PRELOAD` and ran nothing else, under the launch's
#: environment (the test suite's warm runner, tests/warm_runner.py): a launcher that is that process
#: forks its zygote from itself although torch is loaded (`launch.zygote.can_fork`), and
#: `unison check-exact` forks its launches from itself (`check.forked_launch`).
PRELOADED_PID_ENV = "UNISON_PRELOADED_PID"
#: `--timeout`: seconds every collective may take before a missing rank is named (`distributed.group`).
TIMEOUT_ENV = "UNISON_TIMEOUT"
#: "gloo": train on the CPU even where CUDA is available (`distributed.devices`).
BACKEND_ENV = "UNISON_BACKEND"
#: `host:port` of the store the ranks' heartbeats go to (`distributed.watchdog`, `.heartbeat_store`).
HEARTBEAT_ENV = "UNISON_HEARTBEAT_STORE"
#: The signals that mean preemption, e.g. "SIGTERM,SIGUSR1" (`unison.signals`).
SIGNALS_ENV = "UNISON_PREEMPT_SIGNALS"
#: "1": on preemption, also requeue the SLURM job (`callbacks.preemption`).
REQUEUE_ENV = "UNISON_REQUEUE"
#: The torchft lighthouse's address, torchft's own name for it (`distributed.fault_tolerant`).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
#: The replica group's name: a restarted group keeps it (`--replica-id`).
REPLICA_ENV = "UNISON_REPLICA_ID"
#: The thread count `unison launch` gave each worker (`OMP_NUM_THREADS`) when it chose it, the user
#: having set none: a process the worker spawns sees its share is the launcher's, to divide
#: (`distributed.env.threads_for_spawned`).
LAUNCHER_THREADS_ENV = "UNISON_LAUNCHER_THREADS"
#: Where rank 0 sends its progress bars (a datagram socket's path); set only when the launcher draws
#: them (`launch.bar_relay`, `callbacks.progress`).
PROGRESS_SOCKET_ENV = "UNISON_PROGRESS_SOCKET"
#: The launcher terminal's width when it started the workers (their bars are drawn this wide).
PROGRESS_COLUMNS_ENV = "UNISON_PROGRESS_COLUMNS"
#: Set (to anything but "" or "0") to show torchft's INFO logs and its tracebacks (`distributed.ft_logs`).
FT_VERBOSE_ENV = "UNISON_FT_VERBOSE"
#: The launcher a served lighthouse ends with (`launch.lighthouse`).
LIGHTHOUSE_PARENT_ENV = "UNISON_LIGHTHOUSE_PARENT"

# ---- set by `unison check-exact` for the script it probes (`callbacks.exactness_probe`) -------
#: The file rank 0 writes; setting it turns the probe on.
PROBE_ENV = "UNISON_EXACT_PROBE"
#: How many optimizer steps the probed fit takes.
STEPS_ENV = "UNISON_EXACT_STEPS"
#: "1": train in float64.
FLOAT64_ENV = "UNISON_EXACT_FLOAT64"

# ---- torch's and CUDA's, which unison sets or reads for its own purposes ------------------------
#: torch elastic's list of signals its agent forwards (`unison.signals`).
TORCHELASTIC_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
#: Transparent huge pages for torch's CPU allocator (`distributed.env.huge_pages_env`).
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
#: cuBLAS's workspace setting that deterministic algorithms need (`rng.set_seed`).
CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
#: Asks torch to count GPUs through NVML, without initialising CUDA (`distributed.devices`).
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
