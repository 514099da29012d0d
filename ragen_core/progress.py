"""Progress of the library's long loops (rollouts of a real model take minutes) as log lines of the
``ragen.progress`` logger, shown on stderr by :func:`show_progress_lines`.

The CLI calls it and sets ``PROGRESS_ENV``; Ray workers inherit the variable and their rollout workers
call it too (Ray forwards an actor's stderr to the driver's terminal). Library users who configure
logging themselves see the lines at INFO.
"""

from __future__ import annotations

import logging

PROGRESS_ENV = "RAGEN_PROGRESS"
progress_log = logging.getLogger("ragen.progress")


def show_progress_lines() -> None:
    """Print ``ragen.progress`` lines on stderr in this process (once, however often called)."""
    if not any(getattr(h, "_ragen_progress", False) for h in progress_log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s | %(message)s", "%H:%M:%S"))
        handler._ragen_progress = True  # type: ignore[attr-defined]
        progress_log.addHandler(handler)
    progress_log.setLevel(logging.INFO)
    progress_log.propagate = False
