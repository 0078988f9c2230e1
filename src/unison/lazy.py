"""Public names that load their module on first use (PEP 562), for the package `__init__`s.

`unison launch` must answer a bad option before torch loads, and a launched worker must not
import FSDP or DTensor for a script that never uses them: the packages export their names
lazily. Type checkers read the real imports each `__init__` keeps under `TYPE_CHECKING`.

>>> __getattr__, __dir__ = lazy_exports("unison", {"Learner": "unison.learner"}, globals())
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, exports: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module `__getattr__` and `__dir__` that import `exports[name]`'s module on first use.

    The value is stored in `namespace` (the package's globals), so later lookups are plain.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
