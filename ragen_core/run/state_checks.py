"""The state folder's files and the tracking store, checked before a run folder is made or a model
loads: a damaged ``mlflow.db`` or ``runs.json`` otherwise fails after work has started, as an
"internal error" that names no file, and an unreachable tracking server is otherwise named only
after the model has loaded."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from ragen_core.config.tracking import TrackingConfig, resolve_tracking_uri, sqlite_file, uri_scheme_problem
from ragen_core.errors import RagenError
from ragen_core.state_folder import read_run_index, run_index_path, state_dir

#: The first 16 bytes of every SQLite 3 database file.
SQLITE_HEADER = b"SQLite format 3\x00"

#: How long the pre-work probe of a remote tracking server waits at most (the run's own
#: ``tracking.connect_timeout_s`` when shorter).
PROBE_TIMEOUT_S = 5.0


def sqlite_store_problem(db: Path) -> str | None:
    """``db`` exists and is not an SQLite database (an empty file is one: SQLite fills it in)."""
    try:
        size = db.stat().st_size
        with open(db, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"the MLflow store {db} cannot be read ({exc.strerror or exc}); fix its permissions"
    if size == 0 or head == SQLITE_HEADER:
        return None
    return (
        f"the MLflow store {db} is not an SQLite database (it does not start with 'SQLite format 3'); "
        f"move it aside (mv {db} {db}.broken) and a new empty store is made, or set tracking.tracking_uri"
    )


def run_index_problem() -> str | None:
    """The state folder's run index exists and is not a JSON object."""
    try:
        read_run_index()
    except RagenError as exc:
        return str(exc)
    except OSError as exc:
        return f"the run index {run_index_path()} cannot be read ({exc.strerror or exc}); fix its permissions"
    return None


def tracking_problems(tracking: TrackingConfig) -> list[str]:
    """The store a run would log to: a local SQLite file that is not a database, or a remote server
    that does not answer within :data:`PROBE_TIMEOUT_S`."""
    from ragen_core.tracking.offline import TrackingError, probe_http

    uri = resolve_tracking_uri(tracking, state_dir())
    bad_scheme = uri_scheme_problem(uri)  # MLFLOW_TRACKING_URI (the config's is checked when it loads)
    if bad_scheme:
        return [bad_scheme]
    scheme = urllib.parse.urlparse(uri).scheme
    if scheme == "sqlite":
        db = sqlite_file(uri)
        problem = sqlite_store_problem(db) if db else None
        return [problem] if problem else []
    if scheme in ("http", "https"):
        try:
            probe_http(uri, min(tracking.connect_timeout_s, PROBE_TIMEOUT_S))
        except TrackingError as exc:
            return [str(exc)]
    return []


def state_problems(tracking: TrackingConfig) -> list[str]:
    """Everything of the state folder and the store a command reads before it works."""
    problems = tracking_problems(tracking)
    index = run_index_problem()
    return problems + ([index] if index else [])
