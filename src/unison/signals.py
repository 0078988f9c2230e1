"""Which signals mean "preempted", for `unison launch` and its workers, and the status that says so.

Read without torch (the launcher checks its options before torch loads). `unison launch` handles
`LAUNCHER_SIGNALS` unless told otherwise (`--signals-to-handle`, `PET_SIGNALS_TO_HANDLE`,
`TORCHELASTIC_SIGNALS_TO_HANDLE`): torch's agent forwards the one it gets to every worker, and
exports the list to them, where `unison.callbacks.preemption` reads it (`preempt_signals`).

>>> [s.name for s in parse_signals("SIGTERM, usr1, 12")]
['SIGTERM', 'SIGUSR1', 'SIGUSR2']
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence

from unison.env_names import SIGNALS_ENV, TORCHELASTIC_SIGNALS_ENV

#: The exit status of a job every rank of which stopped on a preemption signal after its checkpoint
#: was written: "preempted, resume me". sysexits.h's EX_TEMPFAIL ("temporary failure, try again"),
#: distinct from 143 (SIGTERM, nothing saved) and from a crash.
PREEMPTED_EXIT = 75
#: What a worker treats as preemption when nothing says otherwise.
WORKER_SIGNALS = "SIGTERM,SIGUSR1"
#: What `unison launch` handles (forwards to its workers) by default: torch's four, and SIGUSR1,
#: which `sbatch --signal=USR1@90` sends ahead of the end (torch's agent would die of it).
LAUNCHER_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def parse_signals(spec: str | Sequence[str | int | signal.Signals]) -> tuple[signal.Signals, ...]:
    """Signals from "SIGTERM,USR1,12" (or a list of names, numbers, `signal.Signals`); a one-line
    ValueError names an unknown one, or one no process can handle.

    >>> parse_signals("SIGKILL")
    Traceback (most recent call last):
    ValueError: SIGKILL cannot be handled: no process can catch it
    """
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    found: list[signal.Signals] = []
    for item in items:
        if isinstance(item, str):
            word = item.strip().upper()
            if not word:
                continue
            if word.isdigit():
                item = int(word)
            else:
                name = word if word.startswith("SIG") else f"SIG{word}"
                if not isinstance(getattr(signal, name, None), signal.Signals):
                    raise ValueError(f"unknown signal {item.strip()!r} (expected names like SIGTERM,SIGUSR1)")
                item = getattr(signal, name)
        try:
            sig = signal.Signals(item)
        except ValueError:
            raise ValueError(f"unknown signal number {item!r}") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{sig.name} cannot be handled: no process can catch it")
        if sig not in found:
            found.append(sig)
    return tuple(found)


def preempt_signals(environ: Mapping[str, str] | None = None) -> tuple[signal.Signals, ...]:
    """A worker's preemption signals: `UNISON_PREEMPT_SIGNALS`, else the launcher's list
    (`TORCHELASTIC_SIGNALS_TO_HANDLE`) without SIGINT (Ctrl-C stays an interrupt), else SIGTERM, SIGUSR1.

    >>> [s.name for s in preempt_signals({"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGUSR2"})]
    ['SIGTERM', 'SIGUSR2']
    """
    env = os.environ if environ is None else environ
    if env.get(SIGNALS_ENV):
        return parse_signals(env[SIGNALS_ENV])
    if env.get(TORCHELASTIC_SIGNALS_ENV):
        return tuple(s for s in parse_signals(env[TORCHELASTIC_SIGNALS_ENV]) if s != signal.SIGINT)
    return parse_signals(WORKER_SIGNALS)


def launcher_signals(given: str | None, environ: Mapping[str, str] | None = None) -> str:
    """What `unison launch` hands torch's agent as `signals_to_handle`, in torch's spelling: the
    option (or `PET_SIGNALS_TO_HANDLE`), else `TORCHELASTIC_SIGNALS_TO_HANDLE`, else `LAUNCHER_SIGNALS`.

    >>> launcher_signals("term,usr1")
    'SIGTERM,SIGUSR1'
    """
    env = os.environ if environ is None else environ
    spec = given or env.get(TORCHELASTIC_SIGNALS_ENV) or LAUNCHER_SIGNALS
    return ",".join(s.name for s in parse_signals(spec))
