"""What a user watching a run sees: a line per iteration (success, score, valid answers, time, ETA) in
the terminal and in the flow run's Prefect logs, and at the end where to look next.

The CLI keeps Prefect's own INFO chatter off the terminal (``PREFECT_LOGGING_LEVEL=WARNING``, set by
``flows.settings``); these lines go through a child of the run logger whose own level is INFO. Python
logging hands a propagated record to every ancestor's handlers whatever the ancestors' levels, so
they reach Prefect's API handler (the flow run's logs in the UI) and the console handler alike.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping

from prefect import get_run_logger


def progress_logger() -> logging.LoggerAdapter:
    """The current flow or task run's logger, one level below it and at INFO; outside a run (a flow's
    ``.fn`` called directly) the ``ragen.flows`` logger."""
    from prefect.exceptions import MissingContextError

    try:
        base = get_run_logger()
    except MissingContextError:
        return logging.LoggerAdapter(logging.getLogger("ragen.flows"), {})
    child = base.logger.getChild("ragen")
    child.setLevel(logging.INFO)
    return type(base)(child, base.extra)


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
    """``iteration 3/10 | train success 0.62 score +0.41 valid 0.95 | val success 0.88 | 41s | ETA 4m47s``."""
    parts = [f"iteration {k}/{total}"]
    train = [f"success {metrics['train/success']:.2f}"] if "train/success" in metrics else []
    score, valid = _tag_mean(metrics, "train", "score"), _tag_mean(metrics, "train", "action_is_valid")
    if score is not None:
        train.append(f"score {score:+.2f}")
    if valid is not None:
        train.append(f"valid {valid:.2f}")
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
        self.total, self.times = total, []
        self._t0 = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        self.times.append(now - self._t0)
        self._t0 = now
        return self.times[-1]

    def eta(self, k: int) -> float | None:
        return (self.total - k) * sum(self.times) / len(self.times) if self.times else None
