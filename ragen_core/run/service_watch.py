"""The run's own services, watched: when a process the run started for itself and cannot go on
without (its ephemeral Prefect server, its local Ray cluster's raylet or GCS server) dies mid-run
(killed, out of memory), the command ends within a second with one line naming it and how to go on.

Without the watch the run either waits (Prefect's client retried its events against a dead server
for more than 5 minutes, Ray's driver waits a minute for a lost GCS) or ends saying nothing: Ray's
driver terminates its own process, with exit code 1 and no message, the moment it next touches a
dead raylet's object store.

The thread cannot always speak first: Ray's driver ends its own process within milliseconds of
touching a dead raylet's object store, without running any Python, and it can do so between any two
steps of the thread. So where there is a watchdog (``flows.settings.start_watchdog``, a process that
outlives this one) it is the one voice, and the line is said exactly once however the race goes:
- the thread sends the line on the watchdog's stdin (one write), waits (at most a second) until the
  watchdog has said it, then ends the process, so the line comes before the command's end;
- the line of each watched service is also left in a file the watchdog reads when this process is
  gone without having sent one, and says if that service is dead by then. A normal exit removes the
  file, and a service stopped on purpose (``ray.shutdown()``) is taken out of it.
Without a watchdog the thread says the line itself.

Ending the process at once is safe: an iteration counts as done only once its ``DONE`` mark is
written, each file is written whole or not at all, and a resume logs what MLflow lacks, exactly as
after a SIGKILL; the watchdog (``flows.settings.start_watchdog``) stops the process's children.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ragen_core.processes import process_alive
from ragen_core.storage import write_text_whole

#: How often the watched processes are looked at (seconds) where the kernel cannot wake the watch
#: when one ends (no pidfd), and how often a pidfd watch checks whether it was stopped.
POLL_S = 0.1
_watched: set[int] = set()
#: The watched services still needed (pid: what it is), whose lines are left with the watchdog.
_needed: dict[int, str] = {}
#: The variable that names this process's last-words file (set by the watchdog's starter).
LAST_WORDS_VAR = "RAGEN_LAST_WORDS_{pid}"
#: The variable that holds this process's end of the pipe to its watchdog's stdin (set by its starter).
SAY_FD_VAR = "RAGEN_SAY_FD_{pid}"
#: How long the watch waits for the watchdog to say its line before ending the process anyway.
SAY_WAIT_S = 1.0


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
    _needed.update(services)
    _leave_last_words()
    stop = threading.Event()

    def watch() -> None:
        # A pidfd wakes the watch the moment a service ends: Ray's driver ends its own process within
        # milliseconds of touching a dead raylet's object store, and the line must come first.
        fds = _pidfds(services)
        try:
            while not stop.is_set():
                if fds:
                    select.select(list(fds), [], [], 0.5)
                else:
                    stop.wait(POLL_S)
                dead = [pid for pid in services if not process_alive(pid)]
                if not dead:
                    continue
                if stop.is_set() or not still_needed():  # a normal shutdown stops its services too
                    for pid in services:
                        _needed.pop(pid, None)
                    _leave_last_words()
                    return
                line = _line(dead[0], services[dead[0]])
                if not _said_by_watchdog(line):
                    _take_back_last_words()  # said here: the watchdog must not say it again
                    sys.stderr.write(line + "\n")
                    sys.stderr.flush()
                os._exit(1)
        finally:
            for fd in fds:
                os.close(fd)

    threading.Thread(target=watch, name="service-watch", daemon=True).start()
    return stop


def _pidfds(pids: dict[int, str]) -> dict[int, int]:
    """A pidfd per pid (fd: pid), readable once the process ends; empty where the kernel or Python
    has none (the watch then polls)."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except (AttributeError, OSError):  # no pidfd_open (not Linux 5.3+), or the process is gone
            for fd in fds:
                os.close(fd)
            return {}
    return fds


def _said_by_watchdog(line: str) -> bool:
    """Send ``line`` to the watchdog, which says it and then removes the last-words file; True once it
    was sent (the watchdog says it even if this process ends first), False without a watchdog."""
    fd, path = os.environ.get(SAY_FD_VAR.format(pid=os.getpid())), _last_words_file()
    if fd is None or path is None:
        return False
    try:
        os.write(int(fd), line.encode(errors="replace") + b"\n")
    except (OSError, ValueError):  # the watchdog is gone (or the variable is not ours)
        return False
    deadline = time.monotonic() + SAY_WAIT_S
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return True


def _line(pid: int, name: str) -> str:
    return f"the run's {name} (pid {pid}) exited mid-run; {resume_hint()}"


def _last_words_file() -> Path | None:
    path = os.environ.get(LAST_WORDS_VAR.format(pid=os.getpid()))  # a child's own, not its parent's
    return Path(path) if path else None


def _leave_last_words() -> None:
    """Write the lines of the services still needed (with the resume hint as it is now) where the
    watchdog reads them, whole or not at all; taken back at a normal exit."""
    path = _last_words_file()
    if path is None:
        return
    if not _needed:
        _take_back_last_words()
        return
    try:
        write_text_whole(path, json.dumps({str(pid): _line(pid, name) for pid, name in _needed.items()}))
    except OSError:  # a courtesy: the in-process watch still works
        return
    if not _registered:
        _registered.append(True)
        atexit.register(_take_back_last_words)


_registered: list[bool] = []


def _take_back_last_words() -> None:
    path = _last_words_file()
    if path is not None:
        path.unlink(missing_ok=True)
