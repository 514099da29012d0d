"""One writer per run directory: a lock held for as long as a process trains the run.

Two ``ragen train --resume RUN`` at once would both write the same iterations and log every MLflow
step twice. The lock is ``<run>/LOCK``, held with ``flock``: the kernel drops it when its process
ends, however it ends (a SIGKILL too), so a stale lock of a dead process is simply taken over. The
file's text says who holds it (PID, host, start time, command), for the refusal message.

Once a process holds the lock, no other process writes in the run directory, so the temporary
files that a killed writer left behind (``.metrics.json.tmp-PID``, ``checkpoint.tmp-PID``, ...)
are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ragen_core.errors import RagenError
from ragen_core.processes import process_alive


class RunLockedError(RagenError, RuntimeError):
    """Another live process is training this run."""


#: Names of the temporary files and folders the project's atomic writers use (``tmp-PID`` suffixes,
#: ``mkstemp``'s ``.NAME.XXXX.tmp``, and a checkpoint's ``.old-PID`` kept while it is replaced).
_TEMP_MARKERS = (".tmp-", ".old-")


#: The runs this process has locked, in order (the CLI's Ctrl-C message names the run to resume).
_LOCKED_HERE: list[Path] = []


def runs_locked_here() -> list[Path]:
    """The run folders this process has held the lock of (released or not), oldest first."""
    return list(_LOCKED_HERE)


class RunLock:
    """``with RunLock(run_root):`` holds the run's lock, or raises :class:`RunLockedError`.

    ``what`` names the folder's owner in the refusal (``run``; a sweep's state folder is locked the
    same way, as ``sweep``, by each ``ragen sweep run`` for as long as it runs its members) and
    ``again`` the command to run once the holder is gone.
    """

    def __init__(self, root: str | os.PathLike[str], what: str = "run", again: str = "resume") -> None:
        self.root = Path(root)
        self.path = self.root / "LOCK"
        self.what, self.again = what, again
        self._fd: int | None = None

    def holder(self) -> dict[str, Any]:
        """Who holds (or last held) the lock, as written in the file."""
        try:
            info: dict[str, Any] = json.loads(self.path.read_text() or "{}")
            return info
        except (OSError, json.JSONDecodeError):
            return {}

    def acquire(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            h = self.holder()
            since = (
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"])) if "started" in h else "?"
            )
            raise RunLockedError(
                f"{self.root}: {self.what} is in use by process {h.get('pid', '?')} on {h.get('host', '?')} "
                f"(since {since}: {h.get('command', '?')}); wait for it to finish or stop it, then {self.again}"
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "command": " ".join(sys.argv)[:300],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        if self.what == "run" and self.root not in _LOCKED_HERE:
            _LOCKED_HERE.append(self.root)
        remove_stale_temp_files(self.root)
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def remove_stale_temp_files(root: Path) -> list[Path]:
    """Delete the atomic writers' leftovers under ``root`` (call only while holding its lock)."""
    stale = [p for p in root.rglob("*") if _is_temp(p.name)]  # pathlib's "*" matches dot-files too
    removed = []
    for p in sorted(stale, key=lambda p: len(p.parts)):
        if not p.exists() and not p.is_symlink():
            continue  # inside a folder removed just before
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def _is_temp(name: str) -> bool:
    if any(m in name for m in _TEMP_MARKERS):
        return True
    return name.startswith(".") and name.endswith(".tmp")


def dead_holder(root: str | os.PathLike[str], since: float) -> dict[str, Any] | None:
    """The lock's last holder when it took the lock at or after ``since`` (a Unix time) and has ended
    without finishing, as far as this host can tell; else ``None``.

    A sweep uses it to tell a member whose worker died (its flow run stays RUNNING on the Prefect
    server) from one still training. Only a holder on this host can be checked (its PID); a holder
    that took the lock before ``since`` is an earlier attempt's, not the process being watched."""
    h = RunLock(root).holder()
    pid, host, started = h.get("pid"), h.get("host"), h.get("started")
    if not isinstance(pid, int) or host != socket.gethostname() or not isinstance(started, int | float):
        return None
    if started < since:
        return None
    return None if process_alive(pid) else h
