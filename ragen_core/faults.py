"""Fault injection for the crash-and-resume tests.

``RAGEN_CRASH_AT=<point>:<iteration>`` makes the process SIGKILL itself when it reaches that point
of that iteration (points: ``rollout`` after generation and before the Parquet write, ``learn``
after the learner step and before the checkpoint, ``checkpoint`` in the middle of writing the
checkpoint). Unset, it costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal


def crash_point(point: str, iteration: int) -> None:
    spec = os.environ.get("RAGEN_CRASH_AT")
    if spec and spec == f"{point}:{iteration}":
        os.kill(os.getpid(), signal.SIGKILL)
