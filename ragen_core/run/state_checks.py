"""The state folder's files and the tracking store, checked before a run folder is made or a model
loads: a damaged ``mlflow.db`` or ``runs.json`` otherwise fails after work has started, as an
"internal error" that names no file, and an unreachable tracking server is otherwise named only
after the model has loaded."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from ragen_core.config.tracking import TrackingConfig, resolve_tracking_uri, sqlite_file, uri_scheme_problem
from ragen_core.errors import RagenError
from ragen_core.state_folder import copied_from, read_run_index, run_index_path, state_dir

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


def copied_state_problem() -> str | None:
    """One line when the state folder's records point into the folder it was copied or moved from:
    the run index's absolute entries of runs this folder holds too, and the local MLflow store's
    artifact locations (:func:`ragen_core.tracking.store.moved_locations`); None when none do. ragen
    itself uses this folder's files either way; the line says where the records point and the fix."""
    from ragen_core.tracking.store import moved_from, moved_locations

    parts, origins = [], []
    index = copied_from()
    if index is not None:
        origins.append(str(index[0]))
        parts.append(f"{run_index_path().name} names {len(index[1])} run(s) there by absolute path")
    db = sqlite_file(resolve_tracking_uri(TrackingConfig(), state_dir()))
    moved = moved_locations(db) if db is not None and db.is_file() else {}
    if db is not None and moved:
        origins.append(str(moved_from(moved)))
        parts.append(f"{db.name} keeps the artifacts of {len(moved)} experiment(s) there")
    if not parts:
        return None
    return (
        f"state folder {state_dir().resolve()} was copied or moved from {' and '.join(dict.fromkeys(origins))}: "
        f"{'; '.join(parts)}; ragen uses this folder's own files, and `ragen doctor --fix` points the "
        "records at it"
    )


def relocate_state() -> list[str]:
    """Point the state folder's records at it (``ragen doctor --fix``): the run index's entries and the
    local MLflow store's artifact locations; one line per record changed."""
    from ragen_core.run.run_dir import relocate_index
    from ragen_core.tracking.store import relocate_store, store_lock

    done = [f"{run_index_path().name}: {run_id} was {old}" for run_id, old in relocate_index().items()]
    db = sqlite_file(resolve_tracking_uri(TrackingConfig(), state_dir()))
    if db is not None and db.is_file():
        with store_lock(db):
            done += [f"{db.name}: {old} -> {new}" for old, new in relocate_store(db).items()]
    return done
