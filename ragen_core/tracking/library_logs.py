"""What MLflow, SQLAlchemy and urllib3 log themselves goes to a file in the state folder, not the terminal.

A failing store makes these libraries log at length: a full disk under the SQLite store gave four
SQLAlchemy tracebacks (about 200 lines) for one evaluation, and a tracking server that is down makes
urllib3 warn once per HTTP retry and MLflow's system-metrics thread warn again. The tracker says what
failed in one line, with how to log it later (``Tracker.offline``); the libraries' own records, full
tracebacks included, go to ``<state>/logs/libraries.log`` (:data:`LOG_NAME`), for a bug report.

Installed by every :class:`~ragen_core.tracking.tracker.Tracker` (after MLflow is imported: MLflow
configures its logger on import, replacing its handlers), so the run's logging process routes them
too. ``RAGEN_DEBUG=1`` leaves the terminal as the libraries configure it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

#: The loggers whose records leave the terminal (and their children: ``sqlalchemy.pool.impl.QueuePool``,
#: ``urllib3.connectionpool``, ``mlflow.system_metrics....``).
LIBRARY_LOGGERS = ("mlflow", "sqlalchemy", "alembic", "urllib3")
#: The file in the state folder's ``logs/`` that receives them.
LOG_NAME = "libraries.log"


class _QuietFileHandler(logging.FileHandler):
    """A file handler that fails silently: the disk this file is on may be the one that is full, and
    ``logging``'s own report of a failed write is a traceback on the terminal."""

    def handleError(self, record: logging.LogRecord) -> None:
        return

    def emit(self, record: logging.LogRecord) -> None:
        # ``FileHandler`` opens its file (``delay=True``) outside the guard that calls ``handleError``:
        # a folder that is gone or a disk that refuses the file would raise inside the library's log call
        try:
            super().emit(record)
        except OSError:
            self.handleError(record)


_handler: list[_QuietFileHandler] = []  # the process's one handler (its first state folder's file)


def library_log(state_dir: str | os.PathLike[str]) -> Path:
    """Where the libraries' records of this state folder go."""
    return Path(state_dir) / "logs" / LOG_NAME


def route_library_logs(state_dir: str | os.PathLike[str]) -> Path | None:
    """Send the :data:`LIBRARY_LOGGERS`' records to :func:`library_log` instead of the terminal; the
    file's path (None: left as the libraries configure it, under ``RAGEN_DEBUG``). Idempotent, and again
    after a library configured itself; the first state folder of a process keeps its file."""
    from ragen_core.errors import is_debug

    if is_debug():
        return None
    if not _handler:
        path = library_log(state_dir)
        with contextlib.suppress(OSError):  # a full or read-only disk: the records are dropped, not shown
            path.parent.mkdir(parents=True, exist_ok=True)
        handler = _QuietFileHandler(path, delay=True, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
        _handler.append(handler)
    for name in LIBRARY_LOGGERS:
        log = logging.getLogger(name)
        for h in list(log.handlers):  # MLflow's own, to stderr
            if h is not _handler[0]:
                log.removeHandler(h)
        if _handler[0] not in log.handlers:
            log.addHandler(_handler[0])
        log.propagate = False  # not on to the root logger's console handler (Prefect's)
    return Path(_handler[0].baseFilename)
