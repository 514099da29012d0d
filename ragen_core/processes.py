"""Whether a process is alive, in one place: a run lock's holder, a Prefect server we watch, an
import that left a temporary folder behind."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """True while process ``pid`` runs. A zombie (ended, not yet reaped by its parent) has ended; a
    process of another user is alive. Read from ``/proc``; without it, a signal 0 decides."""
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False  # no such process (or it ended while read)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
