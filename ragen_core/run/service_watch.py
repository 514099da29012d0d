"""The run's own services, watched: when a process the run started for itself and cannot go on
without (its ephemeral Prefect server, its local Ray cluster's raylet or GCS server) dies mid-run
(killed, out of memory), the command ends within a second with one line naming it and how to go on.

Without the watch the run either waits (Prefect's client retried its events against a dead server
for more than 5 minutes, Ray's driver waits a minute for a lost GCS) or ends saying nothing: Ray's
driver terminates its own process, with exit code 1 and no message, the moment it next touches a
dead raylet's object store.

Ending the process at once is safe: an iteration counts as done only once its ``DONE`` mark is
written, each file is written whole or not at all, and a resume logs what MLflow lacks, exactly as
after a SIGKILL; the watchdog (``flows.settings.start_watchdog``) stops the process's children.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

from ragen_core.processes import process_alive

#: How often the watched processes are looked at (seconds): often, because Ray's driver ends its own
#: process within a fraction of a second of touching a dead raylet, and the line must come first.
POLL_S = 0.1
_watched: set[int] = set()


def resume_hint() -> str:
    """How to go on after this process stops mid-run: resume the run it holds, if any."""
    from ragen_core.run.run_lock import runs_locked_here

    runs = runs_locked_here()
    if not runs:
        return "no run folder was made yet; run the command again"
    return f"nothing is lost: resume with `ragen train --resume {runs[-1].name}`"  # as after a Ctrl-C


def watch_services(
    services: dict[int, str], still_needed: Callable[[], bool] = lambda: True
) -> threading.Event | None:
    """End this process (exit code 1, one line on stderr naming the service) when one of
    ``services`` (pid: what it is) dies while ``still_needed()``; returns the event that stops the
    watch, or None when every pid is watched already."""
    services = {pid: name for pid, name in services.items() if pid not in _watched}
    if not services:
        return None
    _watched.update(services)
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(POLL_S):
            dead = [pid for pid in services if not process_alive(pid)]
            if not dead:
                continue
            if stop.is_set() or not still_needed():  # a normal shutdown stops its services too
                return
            sys.stderr.write(
                f"the run's {services[dead[0]]} (pid {dead[0]}) exited mid-run; {resume_hint()}\n"
            )
            sys.stderr.flush()
            os._exit(1)

    threading.Thread(target=watch, name="service-watch", daemon=True).start()
    return stop
