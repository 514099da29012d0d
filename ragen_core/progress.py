"""Progress of the library's long loops, as log lines: rollouts of a real model take minutes, so the
rollout workers log episodes done through the ``ragen.progress`` logger (shown on stderr by
:func:`show_progress_lines`); a training run logs a line per iteration (:func:`iteration_line`, with
success, score, time and ETA from an :class:`IterationClock`).

The CLI calls it and sets ``PROGRESS_ENV``; Ray workers inherit the variable and their rollout workers
call it too (Ray forwards an actor's stderr to the driver's terminal). Library users who configure
logging themselves see the lines at INFO.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from ragen_core.text_safety import PrintableFormatter

PROGRESS_ENV = "RAGEN_PROGRESS"
progress_log = logging.getLogger("ragen.progress")


def show_progress_lines() -> None:
    """Print ``ragen.progress`` lines on stderr in this process (once, however often called)."""
    if not any(getattr(h, "_ragen_progress", False) for h in progress_log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(PrintableFormatter("%(asctime)s | %(message)s", "%H:%M:%S"))
        handler._ragen_progress = True  # type: ignore[attr-defined]
        progress_log.addHandler(handler)
    progress_log.setLevel(logging.INFO)
    progress_log.propagate = False


class _Prefix(logging.Filter):
    """Puts ``[prefix] `` before a record's message, once (a record passes several handlers)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "_ragen_prefixed", False):
            record.msg, record._ragen_prefixed = f"[{self.prefix}] {record.msg}", True
        return True


@contextmanager
def line_prefix(prefix: str) -> Iterator[None]:
    """While inside, every log line this process shows (its own, Prefect's, the progress lines) starts
    with ``[prefix]``: a sweep's members train one after another in one process, and their lines would
    read alike. Filters on the handlers, not the loggers, since records reach handlers from child loggers."""
    handlers = {h for name in (None, "prefect", progress_log.name) for h in logging.getLogger(name).handlers}
    tag = _Prefix(prefix)
    for h in handlers:
        h.addFilter(tag)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(tag)


def duration(seconds: float) -> str:
    """``75`` -> ``"1m15s"``; ``3725`` -> ``"1h02m"``; ``9`` -> ``"9s"``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _tag_mean(metrics: Mapping[str, float], prefix: str, key: str) -> float | None:
    """Mean over the tags of ``{prefix}/{tag}/{key}`` (NaN-free), or None when no tag has it."""
    values = [
        v
        for k, v in metrics.items()
        if k.startswith(prefix + "/") and k.endswith("/" + key) and k.count("/") == 2 and not math.isnan(v)
    ]
    return sum(values) / len(values) if values else None


def iteration_line(
    k: int, total: int, metrics: Mapping[str, float], seconds: float, eta_s: float | None
) -> str:
    """``iteration 3/10 | train success 0.62 score +0.41 valid answers 0.95 | val success 0.88 | 41s | ETA 4m47s``."""
    parts = [f"iteration {k}/{total}"]
    train = [f"success {metrics['train/success']:.2f}"] if "train/success" in metrics else []
    score, valid = _tag_mean(metrics, "train", "score"), _tag_mean(metrics, "train", "action_is_valid")
    if score is not None:
        train.append(f"score {score:+.2f}")
    if valid is not None:
        train.append(f"valid answers {valid:.2f}")  # beside "val success": say which
    if train:
        parts.append("train " + " ".join(train))
    if "val-env/success" in metrics:
        parts.append(f"val success {metrics['val-env/success']:.2f}")
    parts.append(duration(seconds))
    if eta_s is not None and k < total:
        parts.append(f"ETA {duration(eta_s)}")
    return " | ".join(parts)


class IterationClock:
    """Seconds per iteration of this process (a resumed run's earlier iterations ran elsewhere), and the
    ETA of the rest from their mean."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.times: list[float] = []
        self._t0 = time.perf_counter()

    def restart(self) -> None:
        """Start timing the next iteration now."""
        self._t0 = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        self.times.append(now - self._t0)
        self._t0 = now
        return self.times[-1]

    def eta(self, k: int) -> float | None:
        return (self.total - k) * sum(self.times) / len(self.times) if self.times else None
