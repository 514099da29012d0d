"""CPU priority of the helper processes that serve a run (the ephemeral Prefect server, the MLflow
logging process): lower than training's, by a ``nice`` increment read from an environment variable.

Their work (recording task runs, writing MLflow's store) happens after the fact and nothing in the
loop waits for it, but on a 2-core machine it otherwise takes a core from the rollout and learner
threads exactly when they need it (benchmarks/README.md, "Pipeline overhead")."""

from __future__ import annotations

import os

#: The increment when the variable is unset: well below training, above the idle class (19).
DEFAULT_NICE = 10


def nice_increment(var: str) -> int:
    """The ``nice`` increment that environment variable ``var`` asks for (0: same priority as
    training); a value that is not a number from 0 to 19 raises naming the variable."""
    raw = os.environ.get(var, str(DEFAULT_NICE))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ValueError(f"{var}={raw!r} is not a number from 0 to 19; use 0 (off) to 19 (lowest priority)")
    return value


def lower_priority(pid: int, increment: int) -> bool:
    """Lower process ``pid`` to this process's priority plus ``increment`` (never raises it again, so
    a repeated call changes nothing). False when the process is gone or not ours to change."""
    if increment <= 0:
        return False
    target = min(os.getpriority(os.PRIO_PROCESS, 0) + increment, 19)
    try:
        if os.getpriority(os.PRIO_PROCESS, pid) < target:
            os.setpriority(os.PRIO_PROCESS, pid, target)
    except OSError:
        return False
    return True
