"""Every module of unison imports first, on its own, in a fresh interpreter.

Unpickling imports a class's module before anything else: Ray Train's workers (and any spawn-based
pool) unpickle a training function whose closure names `unison.checkpoint.callback.Checkpoint`, and
that import failed on a package-level circle (`unison.callbacks` re-exported `Checkpoint`, whose
module imported this package). The layout test checks module imports; this checks what an
interpreter does with them, package `__init__`s included.
"""

import subprocess
import sys

import pytest

CODE = """
import importlib, pkgutil, sys
import unison
names = [m.name for m in pkgutil.walk_packages(unison.__path__, "unison.") if not m.name.endswith("__main__")]
failed = []
for name in names:
    for loaded in [k for k in sys.modules if k == "unison" or k.startswith("unison.")]:
        del sys.modules[loaded]  # torch and the rest stay loaded: only unison's order is tested
    try:
        importlib.import_module(name)
    except ImportError as exc:
        if "partially initialized" in str(exc) or "circular" in str(exc):
            failed.append(f"{name}: {exc}")
print(len(names))
print("\\n".join(failed))
"""


@pytest.mark.procs
def test_every_module_imports_first() -> None:
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    count, *failed = done.stdout.strip().split("\n")
    assert int(count) > 40
    assert [line for line in failed if line] == []
