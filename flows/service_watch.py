"""The run's own Prefect server, watched (``ragen_core.run.service_watch`` says why and how): when the
ephemeral server that records this flow dies mid-run, the command ends within a second with one line
naming it and how to go on. The watch stops before Prefect's own exit hook stops the server at a
normal exit."""

from __future__ import annotations

import atexit
import threading

from ragen_core.run.service_watch import watch_services


def watch_prefect_server(pids: list[int]) -> threading.Event | None:
    """End this process (exit code 1, one line on stderr) when one of ``pids`` (this process's
    ephemeral Prefect server) dies; returns the event that stops the watch (set at exit)."""
    stop = watch_services(dict.fromkeys(pids, "Prefect server"))
    if stop is not None:
        atexit.register(stop.set)  # after this one's registration: runs before Prefect stops the server
    return stop
