"""The local SQLite MLflow store: created under a lock, from a cached empty template.

A fresh SQLite store is created under an exclusive ``flock`` on ``<db>.lock``: MLflow builds the
schema without one, and two runs starting at once in a new state folder would race (``table ...
already exists``). Building it runs MLflow's whole chain of schema migrations (seconds on 2 cores, in
every new state folder), so the first store made with an MLflow version is kept, emptied, in the user
cache (:func:`store_template`) and later new stores start as a copy of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ragen_core.state_folder import cache_dir

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


def _open_sqlite_client(uri: str, db: Path) -> MlflowClient:
    """An MlflowClient on the SQLite store ``db``; a new store starts from the template, or is built by
    MLflow and becomes the template."""
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
        return client
