"""How often torch's gloo teardown deadlock hangs a launched DDP script (pytorch/pytorch#56297).

pytorch/examples' `multigpu_torchrun.py` (examples/ddp_tutorial) calls `destroy_process_group()`
while its DDP model is alive and frees the model after. When DDP's Reducer holds the group's last
reference, torch's gloo destructor runs there holding the GIL and joins a gloo thread that waits
for the GIL (docs/faults.md, "Process exit"). Loading FSDP before the group makes it likely. This
runs the tutorial N times under a launcher, each bounded by --limit seconds, and counts the
launches that hung after every rank printed its weights:

    python benchmarks/exit_deadlock.py --runs 15                          # unison launch, warm
    python benchmarks/exit_deadlock.py --runs 15 --cold --import-first torch.distributed.fsdp
    python benchmarks/exit_deadlock.py --runs 15 --launcher torchrun --import-first torch.distributed.fsdp

Every launched worker keeps its default group (unison.launch.group_keeper), so under
`unison launch` the count is 0; under torchrun the script can hang.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "examples" / "ddp_tutorial"
WRAPPER = """
import importlib, runpy, sys
for name in {modules!r}:
    importlib.import_module(name)  # loaded before the script makes its group
sys.argv = ["multigpu_torchrun.py", *sys.argv[1:]]
sys.path.insert(0, {folder!r})
runpy.run_path({script!r}, run_name="__main__")
"""


def one_launch(cmd: list[str], env: dict[str, str], folder: Path, limit: float) -> str:
    """'ok', 'hung' (every rank printed its weights, then the launch outlived `limit`) or 'failed'."""
    (folder / "snapshot.pt").unlink(missing_ok=True)
    proc = subprocess.Popen(
        cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "hung" if out.decode(errors="replace").count(" weights ") >= 2 else "failed"
    return "ok" if proc.returncode == 0 else "failed"


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--limit", type=float, default=40.0, help="seconds a launch may take")
    parser.add_argument("--launcher", choices=["unison", "torchrun"], default="unison")
    parser.add_argument("--cold", action="store_true", help="UNISON_WARM_START=0: new interpreters")
    parser.add_argument("--import-first", nargs="*", default=[], help="modules the wrapper imports first")
    opts = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="unison-exit-deadlock-"))
    try:
        for item in TUTORIAL.iterdir():
            if item.suffix == ".py":
                shutil.copy(item, folder / item.name)
        wrapper = folder / "wrapper.py"
        script = str(folder / "multigpu_torchrun.py")
        wrapper.write_text(WRAPPER.format(modules=opts.import_first, folder=str(folder), script=script))
        launcher = ["-m", "unison.launch"] if opts.launcher == "unison" else ["-m", "torch.distributed.run"]
        cmd = [sys.executable, *launcher, "--standalone", "--nproc_per_node=2", str(wrapper), "3", "1"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
        if opts.cold:
            env["UNISON_WARM_START"] = "0"
        counts = {"ok": 0, "hung": 0, "failed": 0}
        start = time.monotonic()
        for _ in range(opts.runs):
            counts[one_launch(cmd, env, folder, opts.limit)] += 1
        how = f"{opts.launcher}{' cold' if opts.cold else ''}"
        first = ", ".join(opts.import_first) or "nothing"
        print(
            f"{how}, {first} imported first: {counts['hung']} hung in {opts.runs} launches "
            f"({counts['ok']} ok, {counts['failed']} failed otherwise; {time.monotonic() - start:.0f} s)"
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
