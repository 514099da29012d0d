"""The run's own Prefect server, watched: when the ephemeral server that records this flow dies
mid-run (killed, out of memory), the command ends within seconds with one line naming it and how to
go on, instead of Prefect's client retrying its events and state updates against it for minutes
(more than 5 minutes measured, with a screen of ``EventsWorker`` errors).

Ending the process at once is safe: an iteration counts as done only once its ``DONE`` mark is
written, each file is written whole or not at all, and a resume logs what MLflow lacks, exactly as
after a SIGKILL; the watchdog (``flows.settings.start_watchdog``) stops the process's children. The
watch stops before Prefect's own exit hook stops the server at a normal exit.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

from ragen_core.processes import process_alive

#: How often the server's process is looked at (seconds).
POLL_S = 1.0
_watched: set[int] = set()


def _resume_hint() -> str:
    from ragen_core.run.run_lock import runs_locked_here

    runs = runs_locked_here()
    if not runs:
        return "no run folder was made yet; run the command again"
    return f"nothing is lost: resume with `ragen train --resume {runs[-1].name}`"  # as after a Ctrl-C


def watch_prefect_server(pids: list[int]) -> threading.Event | None:
    """End this process (exit code 1, one line on stderr) when one of ``pids`` (this process's
    ephemeral Prefect server) dies; returns the event that stops the watch (set at exit)."""
    pids = [pid for pid in pids if pid not in _watched]  # a second flow of this process: watched already
    if not pids:
        return None
    _watched.update(pids)
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(POLL_S):
            dead = [pid for pid in pids if not process_alive(pid)]
            if dead and not stop.is_set():
                sys.stderr.write(
                    f"the run's Prefect server (pid {dead[0]}) exited mid-run; {_resume_hint()}\n"
                )
                sys.stderr.flush()
                os._exit(1)

    atexit.register(stop.set)  # after this one's registration: runs before Prefect stops the server
    threading.Thread(target=watch, name="prefect-server-watch", daemon=True).start()
    return stop
