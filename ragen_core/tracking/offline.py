"""A tracking store that is down: MLflow's HTTP client on a short leash, a remote server probed before
a run starts, and an MLflow failure read as "unreachable" (the tracker goes offline) or not.

Failures cost seconds, not minutes, and never stop training. For our client, MLflow's HTTP
settings default to a short leash (``HTTP_DEFAULTS``: 2 retries, 4 s timeout, backoff factor 1;
the environment wins): a server that is down costs about 3 s, one that hangs about 15 s. The first
store call that fails during a run takes the Tracker *offline*: ``tracker.offline`` holds one line
naming the store and the failing call, a warning is logged, and every later call (metrics, tags,
artifacts, ``end``) returns at once without touching the network or raising. Nothing is lost: the
pipeline writes each iteration's ``metrics.json`` into the run directory *before* logging, and
``log_iteration`` skips the steps a run already has, so once the store is back a resumed run (same
``run_id``) re-logs exactly the missing iterations; ``offline_message`` says so to the user.
Starting a run still fails fast with ``TrackingError`` (nothing has been trained yet).
"""

from __future__ import annotations

import os
import socket
import ssl
import urllib.error
import urllib.request
from typing import Any

#: MLflow's HTTP client settings for our runs, unless the environment sets them. MLflow's own
#: defaults (7 retries, backoff factor 2, 120 s timeout) make one call to a dead server block for
#: about 4 minutes; these give up after about 3 s (refused: attempts at 0, 0 and ~2.5 s) and, for a
#: server that accepts but never answers, after 3 x 4 s + ~2.5 s, about 15 s. Idempotent retries
#: are safe: a re-sent metric has the same timestamp, and MLflow ignores exact duplicates.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "4",
}


class TrackingError(RuntimeError):
    """The tracking store cannot be reached or refused a write; the message names the store and the fix."""


def cut_text(value: str, limit: int) -> str:
    """``value`` cut to ``limit`` characters, ending in "..." when cut (MLflow's length limits)."""
    return value if len(value) <= limit else value[: limit - 3] + "..."


def probe_http(uri: str, timeout_s: float) -> None:
    """Raise ``TrackingError`` unless an HTTP server answers at ``uri`` within ``timeout_s``."""
    url = uri.rstrip("/") + "/health"
    fix = (
        "start it (`MLFLOW_DISABLE_TELEMETRY=true mlflow server --workers 1 --host 127.0.0.1 --port <port>`), "
        "or unset MLFLOW_TRACKING_URI / tracking.tracking_uri to use the local store in the state folder"
    )
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return
    except urllib.error.HTTPError:
        return  # the server answered (auth, proxy prefix, ...): reachable; MLflow reports the rest
    except urllib.error.URLError as e:
        reason: Any = e.reason
    except OSError as e:  # timeouts, resets (TimeoutError, ConnectionError are OSErrors)
        reason = e
    if isinstance(reason, ssl.SSLError):
        return  # something answered TLS; certificate policy (MLFLOW_TRACKING_INSECURE_TLS, ...) is MLflow's call
    if isinstance(reason, ConnectionRefusedError):
        why = "connection refused"
    elif isinstance(reason, TimeoutError):  # socket.timeout is TimeoutError
        why = f"no answer within {timeout_s:g} s"
    elif isinstance(reason, socket.gaierror):
        why = "host name not found"
    else:
        why = str(reason)
    raise TrackingError(f"MLflow tracking server {uri} unreachable ({why}); {fix}")


def deleted_run_message(uri: str, run_id: str) -> str:
    """How to go on with a run whose MLflow run was deleted (MLflow's trash): restore it, then resume."""
    return (
        f"MLflow run {run_id} of this run was deleted from {uri} (it is in MLflow's trash until "
        f"`mlflow gc` purges it); restore it with `MLFLOW_TRACKING_URI={uri} mlflow runs restore "
        f"--run-id {run_id}`, then resume again"
    )


def failure_reason(e: BaseException) -> tuple[bool, str]:
    """(is the store unreachable, a short one-line reason) for an exception of an MLflow call."""
    text = " ".join(f"{type(x).__name__}: {x}" for x in _chain(e))
    timeout = os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", HTTP_DEFAULTS["MLFLOW_HTTP_REQUEST_TIMEOUT"])
    retries = os.environ.get(
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES", HTTP_DEFAULTS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
    )
    if "Connection refused" in text or any(isinstance(x, ConnectionRefusedError) for x in _chain(e)):
        return True, f"connection refused, {retries} retries"
    if "timed out" in text or "Timeout" in text:
        return True, f"no answer within {timeout} s, {retries} retries"
    if any(
        w in text
        for w in (
            "Connection reset",
            "Connection aborted",
            "RemoteDisconnected",
            "Max retries exceeded",
            "Failed to establish",
        )
    ):
        return True, "connection lost"
    first = " ".join(f"{type(e).__name__}: {e}".split())
    return isinstance(e, ConnectionError | TimeoutError), cut_text(first, 300)


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and x not in out and len(out) < 10:
        out.append(x)
        x = x.__cause__ or x.__context__
    return out
