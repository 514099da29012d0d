"""The local SQLite MLflow store: created under a lock, from a cached empty template.

A fresh SQLite store is created under an exclusive ``flock`` on ``<db>.lock``: MLflow builds the
schema without one, and two runs starting at once in a new state folder would race (``table ...
already exists``). Building it runs MLflow's whole chain of schema migrations (seconds on 2 cores, in
every new state folder), so the first store made with an MLflow version is kept, emptied, in the user
cache (:func:`store_template`) and later new stores start as a copy of it.

A store's artifacts live beside it, in ``<folder of the store>/mlartifacts/<experiment>``
(:func:`experiment_artifacts`), so that a state folder can be copied or moved whole. MLflow, though,
records every artifact location as an absolute ``file://`` URI (it resolves a relative one against
the working directory): a copied store would read, and a resumed run write, the original folder's
artifacts. So whenever ragen opens a store (:func:`relocate_store`), the locations of the experiments
it made that point into another folder's ``mlartifacts`` are moved to this folder's, with everything
under them (runs, logged models, model versions, traces).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ragen_core.state_folder import cache_dir
from ragen_core.tracking.keys import metric_key

if TYPE_CHECKING:  # pragma: no cover
    from mlflow.tracking import MlflowClient

_log = logging.getLogger(__name__)


@contextlib.contextmanager
def store_lock(db: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<db>.lock`` (beside the SQLite file), across processes.

    MLflow's SQLite tracking store creates and migrates its schema on first use without any lock,
    so two processes opening a fresh store at once both run the migrations and one fails (``table
    ... already exists``, ``duplicate column name``). The lock file is never deleted: removing it
    while another process waits on it would let a third one lock a new file."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock (MLflow's own behaviour)
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def store_template() -> Path:
    """The cached empty SQLite store of this MLflow version (``$XDG_CACHE_HOME/ragen-flow``): the schema
    at MLflow's head revision, without the default experiment (MLflow adds it, with its artifact
    location, when it opens the copy)."""
    import mlflow

    return cache_dir() / f"mlflow-{mlflow.__version__}-empty-store.db"


def _from_template(db: Path) -> bool:
    """Start the new store ``db`` as a copy of the cached template; False when there is none, or when
    it is not an intact SQLite store with a schema revision (it is then dropped, to be made anew)."""
    import sqlite3

    template = store_template()
    if db.exists() or not template.is_file():
        return False
    tmp = db.with_name(f"{db.name}.tmp-{os.getpid()}")
    try:
        shutil.copyfile(template, tmp)
        with contextlib.closing(sqlite3.connect(tmp)) as con:
            intact = con.execute("PRAGMA quick_check").fetchone() == ("ok",)
            revision = con.execute("SELECT version_num FROM alembic_version").fetchall()
        if not intact or len(revision) != 1:
            raise sqlite3.DatabaseError("no single schema revision")
    except (OSError, sqlite3.Error) as e:
        _log.warning("dropping the cached empty MLflow store %s (%s)", template, e)
        tmp.unlink(missing_ok=True)
        template.unlink(missing_ok=True)
        return False
    os.replace(tmp, db)
    return True


def _keep_template(db: Path) -> None:
    """Keep the store MLflow just created, less its default experiment, as the template of later ones.
    A cache: when it cannot be written, every new store is simply built by MLflow."""
    import sqlite3

    template = store_template()
    tmp = template.with_name(f"{template.name}.tmp-{os.getpid()}")
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(db, tmp)
        with contextlib.closing(sqlite3.connect(tmp)) as con, con:
            con.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
            con.execute("DELETE FROM experiments WHERE experiment_id = 0")
        os.replace(tmp, template)
    except (OSError, sqlite3.Error) as e:
        _log.debug("no MLflow store template kept (%s)", e)
        tmp.unlink(missing_ok=True)


#: The folder of a store's artifacts, beside the store.
ARTIFACTS_FOLDER = "mlartifacts"

#: The columns that hold artifact locations (table, column, a condition on the row): each
#: experiment's, each run's, each LoggedModel's, each model version's copy of its model's, and each
#: trace's (a trace tag).
_LOCATION_COLUMNS = (
    ("experiments", "artifact_location", ""),
    ("runs", "artifact_uri", ""),
    ("logged_models", "artifact_location", ""),
    ("model_versions", "storage_location", ""),
    ("model_versions", "source", ""),
    ("trace_tags", "value", "key = 'mlflow.artifactLocation'"),
)


def experiment_artifacts(db: Path, experiment: str) -> str:
    """Where the experiment ``experiment`` of the store ``db`` keeps its artifacts:
    ``<folder of db>/mlartifacts/<experiment as a folder name>``, as the ``file://`` URI MLflow records."""
    name = metric_key(experiment).replace("/", "_")
    return (db.resolve().parent / ARTIFACTS_FOLDER / name).as_uri()


def moved_locations(db: Path) -> dict[str, str]:
    """The artifact locations of ``db``'s experiments that point into another folder's ``mlartifacts``
    (the store was copied or moved from there), each mapped to where it is now: ``{old: new}``. Only
    locations that follow :func:`experiment_artifacts`'s rule are moved; a location someone chose is
    left alone. Read-only; ``{}`` for a store that cannot be read (its own check names it)."""
    try:
        with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as con:
            rows = con.execute("SELECT name, artifact_location FROM experiments").fetchall()
    except sqlite3.Error:
        return {}
    moved = {}
    for name, location in rows:
        here = experiment_artifacts(db, name)
        tail = here[here.rindex(f"/{ARTIFACTS_FOLDER}/") :]
        ours = isinstance(location, str) and location.startswith("file:///") and location.endswith(tail)
        if ours and location != here:
            moved[location] = here
    return moved


def moved_from(moved: dict[str, str]) -> str | None:
    """The folder a store's moved locations (:func:`moved_locations`) point into (one of them)."""
    from urllib.parse import unquote, urlparse

    for old in sorted(moved):
        path = Path(unquote(urlparse(old).path))
        return str(path.parent.parent)  # <folder>/mlartifacts/<experiment>
    return None


def relocate_store(db: Path) -> dict[str, str]:
    """Point the artifact locations of a copied or moved store at its own folder
    (:func:`moved_locations`): each moved prefix is replaced in every location column, in one
    transaction, so the store never mixes folders. Returns what was moved. The caller holds
    :func:`store_lock`."""
    moved = moved_locations(db)
    if not moved:
        return {}
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as con, con:
        for old, new in moved.items():
            for table, column, condition in _LOCATION_COLUMNS:
                where = f" AND {condition}" if condition else ""
                con.execute(
                    f"UPDATE {table} SET {column} = ? || substr({column}, ?) "  # the names are this module's
                    f"WHERE ({column} = ? OR substr({column}, 1, ?) = ?){where}",
                    (new, len(old) + 1, old, len(old) + 1, old + "/"),
                )
    _forget_artifact_repos()
    _log.info(
        "MLflow store %s was copied or moved from %s: its artifact locations now point into %s",
        db,
        moved_from(moved),
        db.resolve().parent / ARTIFACTS_FOLDER,
    )
    return moved


def _forget_artifact_repos() -> None:
    """MLflow caches each run's artifact repository (its location) by run id for the whole process:
    a process that logged a run of the original folder would go on writing there for the copy's run
    of the same id. A cache, so emptying it costs one lookup per run."""
    try:
        from mlflow.tracking._tracking_service import utils
    except ImportError:  # pragma: no cover - MLflow moved it: no such cache to empty
        return
    cache = getattr(utils, "_artifact_repos_cache", None)
    if cache is not None:
        cache.clear()


def _own_default_experiment(db: Path) -> None:
    """MLflow makes a new store's ``Default`` experiment with its artifacts in the working directory
    (``./mlruns/0``, made absolute): they go beside the store, as every other experiment's do."""
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as con, con:
        con.execute(
            "UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
            (experiment_artifacts(db, "Default"),),
        )


def open_sqlite_client(uri: str, db: Path) -> MlflowClient:
    """An MlflowClient on the SQLite store ``db``; a new store starts from the template, or is built by
    MLflow and becomes the template; a copied or moved store gets its artifact locations back."""
    from mlflow.tracking import MlflowClient

    with store_lock(db):  # MlflowClient creates and migrates the schema here
        new = not db.exists()
        copied = new and _from_template(db)
        try:
            client = MlflowClient(tracking_uri=uri)
        except Exception:
            if copied:  # nothing half-made stays behind; the next run builds the store itself
                db.unlink(missing_ok=True)
                store_template().unlink(missing_ok=True)
            raise
        if new and not copied and db.exists():
            _keep_template(db)
        if new and db.exists():
            _own_default_experiment(db)
        else:
            relocate_store(db)
        return client
