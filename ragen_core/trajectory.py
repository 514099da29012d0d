"""The trajectory table: one row per multi-turn trajectory, stored as versioned, zstd Parquet.

The table is the hand-off between the rollout stage and the learner (docs/architecture.md, "Trajectory
schema"). Files are written atomically (temporary file in the same folder, fsync, rename) so that a
crash never leaves a half-written file in place of a good one, and they carry their schema version
in the Parquet key-value metadata. Reading checks both and names the file in every error.

Each written file's sha256 goes into its folder's ``SHA256SUMS`` (``ragen_core.integrity``), and
reading verifies it: a flipped byte inside a column that Parquet would still decode is reported as a
corrupt file, not trained on nor blamed on reproducibility. Column types are checked against
:data:`SCHEMA`, so a foreign file with, say, a text ``score`` is refused naming the column.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ragen_core.integrity import CorruptFileError, file_key, record, recorded, verify
from ragen_core.storage import write_error

#: v2 numbers the ``iteration`` column as the folders and MLflow steps do: iteration ``k``'s train rows
#: carry ``k``, validation rows the number of iterations their policy trained. v1 files (the same
#: columns) held the 0-based seed round there instead (``k - 1``; 0 for validation); they stay readable.
SCHEMA_VERSION = "2"
READABLE_VERSIONS = ("1", "2")
SCHEMA_VERSION_KEY = b"ragen.trajectory_schema_version"

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])

SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("iteration", pa.int32()),
        ("split", pa.string()),
        ("env_tag", pa.string()),
        ("group_id", pa.int32()),
        ("env_id", pa.int32()),
        ("seed", pa.int64()),
        ("turn_count", pa.int16()),
        ("success", pa.bool_()),
        ("truncated", pa.bool_()),
        ("reward", pa.float32()),
        ("format_penalty", pa.float32()),
        ("score", pa.float32()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("turn_index", pa.list_(pa.int16())),
        ("rollout_logprobs", pa.list_(pa.float32())),
        ("messages", pa.list_(MESSAGE)),
        ("actions", pa.list_(pa.list_(pa.string()))),
        ("turn_rewards", pa.list_(pa.float32())),
        ("info", pa.string()),
    ],
    metadata={SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode()},
)

TOKEN_COLUMNS = ("input_ids", "loss_mask", "turn_index", "rollout_logprobs")


class TrajectoryFileError(ValueError):
    """A trajectory file that cannot be used: missing, truncated, corrupt, or of another schema."""

    user_error = True


def _repair(path: Path) -> str:
    """What to do about a damaged trajectory file: a run's rollouts are recomputed by resuming the
    run from before their iteration (the rollout stage replays a damaged output, deterministically)."""
    folder = path.parent.name
    if path.name == "rollouts.parquet" and folder.startswith("iter_") and folder[5:].isdigit():
        return (
            f"Restore it from a copy, or delete {path.parent / 'DONE'} and resume the run "
            f"(`ragen train --resume`): iteration {int(folder[5:])} is recomputed from its intact inputs"
        )
    return "Restore it from a copy, or rerun the stage that wrote it"


@dataclass
class Trajectory:
    """One row of the table, as the rollout runner produces it."""

    run_id: str
    iteration: int
    split: str
    env_tag: str
    group_id: int
    env_id: int
    seed: int
    turn_count: int
    success: bool
    truncated: bool
    reward: float
    format_penalty: float
    score: float
    input_ids: list[int]
    loss_mask: list[int]
    turn_index: list[int]
    rollout_logprobs: list[float]
    messages: list[dict[str, str]]
    actions: list[list[str]]
    turn_rewards: list[float]
    info: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        n = len(self.input_ids)
        lengths = {c: len(getattr(self, c)) for c in TOKEN_COLUMNS}
        if any(v != n for v in lengths.values()):
            raise ValueError(f"trajectory env_id={self.env_id}: token columns differ in length: {lengths}")


def to_table(trajectories: Iterable[Trajectory]) -> pa.Table:
    """Build the Arrow table (schema-checked) from trajectories."""
    rows: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    for t in trajectories:
        t.check()
        for name in SCHEMA.names:
            value = getattr(t, name)
            rows[name].append(json.dumps(value, sort_keys=True, default=str) if name == "info" else value)
    return pa.Table.from_pydict(rows, schema=SCHEMA)


class _RecentTables:
    """The tables this process wrote or read (and checked) last, by path: an iteration's filter and
    learn stages read the rollouts its rollout stage has just written, the logging process reads them
    for the transcripts page and for the traces (about 6 ms of hashing and Parquet decoding each on a
    tiny config). A table is served only while its file is the one written or checked
    (:func:`~ragen_core.integrity.file_key`, as the digest memo decides) and its recorded digest is
    the one recorded then; anything else reads the file."""

    def __init__(self, capacity: int = 2) -> None:
        self.capacity = capacity
        self._tables: OrderedDict[str, tuple[tuple[str, int, int, int, int, int], str, pa.Table]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()  # the logging thread reads rollouts too

    def put(self, path: Path, digest: str, table: pa.Table) -> None:
        key = file_key(path)
        with self._lock:
            self._tables[key[0]] = (key, digest, table)
            self._tables.move_to_end(key[0])
            while len(self._tables) > self.capacity:
                self._tables.popitem(last=False)

    def get(self, path: Path) -> pa.Table | None:
        try:
            key = file_key(path)
        except OSError:
            return None
        with self._lock:
            entry = self._tables.get(key[0])
        if entry is None or entry[0] != key or recorded(path) != entry[1]:
            return None
        return entry[2]


_RECENT = _RecentTables()
_READ_SCHEMA: list[pa.Schema] = []


def _read_schema(path: Path) -> pa.Schema:
    """The schema a read of a file written here gives (Parquet names list items "element" where Arrow
    says "item"): the same for every file of this schema version, so read from the first one only."""
    if not _READ_SCHEMA:
        _READ_SCHEMA.append(pq.read_schema(path))
    return _READ_SCHEMA[0]


def write_table(table: pa.Table, path: str | os.PathLike[str]) -> Path:
    """Write ``table`` to ``path`` atomically (temp file + fsync + rename), zstd compressed, and
    record its sha256 in the folder's ``SHA256SUMS``.

    An ``OSError`` (full disk, read-only folder) is raised as ``StorageWriteError`` naming ``path``.
    """
    path = Path(path)
    if table.schema.remove_metadata() != SCHEMA.remove_metadata():
        raise ValueError(f"{path}: table does not match the trajectory schema v{SCHEMA_VERSION}")
    table = table.replace_schema_metadata({SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode()})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise write_error(path, exc, "trajectories") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            pq.write_table(table, f, compression="zstd")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        digest = record(path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise write_error(path, exc, "trajectories") from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _RECENT.put(path, digest, table.cast(_read_schema(path)).select(SCHEMA.names))
    return path


def write_trajectories(trajectories: Iterable[Trajectory], path: str | os.PathLike[str]) -> Path:
    return write_table(to_table(trajectories), path)


def read_table(path: str | os.PathLike[str]) -> pa.Table:
    """Read and validate a trajectory file; every error names the file and what is wrong with it.

    Checks, in order: the sha256 recorded when the file was written (if any), that Parquet can read
    it, its schema version, and every column's presence and type. A file this process has just
    written or read, still unchanged, is served from memory (the same table, already checked).
    """
    path = Path(path)
    if not path.exists():
        raise TrajectoryFileError(f"{path}: no such trajectory file")
    recent = _RECENT.get(path)
    if recent is not None:
        return recent
    try:
        verify(path, fix=_repair(path))
    except CorruptFileError as exc:
        raise TrajectoryFileError(str(exc)) from exc
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise TrajectoryFileError(
            f"{path}: not a readable Parquet file (truncated or corrupt?): {exc}. {_repair(path)}"
        ) from exc
    version = (table.schema.metadata or {}).get(SCHEMA_VERSION_KEY)
    if version is None:
        raise TrajectoryFileError(
            f"{path}: no {SCHEMA_VERSION_KEY.decode()} metadata; not a ragen-flow trajectory file"
        )
    if version.decode() not in READABLE_VERSIONS:
        raise TrajectoryFileError(
            f"{path}: trajectory schema v{version.decode()}, this ragen-flow reads "
            f"{' and '.join('v' + v for v in READABLE_VERSIONS)}; open it with the ragen-flow that wrote it"
        )
    missing = [n for n in SCHEMA.names if n not in table.schema.names]
    if missing:
        raise TrajectoryFileError(f"{path}: missing columns {missing}")
    for expected in SCHEMA:
        actual = table.schema.field(expected.name).type
        if actual != expected.type:  # list types compare by value type, not by the item field's name
            raise TrajectoryFileError(
                f"{path}: column {expected.name!r} has type {actual}, expected {expected.type} "
                f"(trajectory schema v{SCHEMA_VERSION}); not a file this ragen-flow wrote, or it was edited"
            )
    table = table.select(SCHEMA.names)
    digest = recorded(path)
    if digest is not None:  # checked against it above: a second read of the unchanged file is free
        _RECENT.put(path, digest, table)
    return table


def schema_version(path: str | os.PathLike[str]) -> str:
    """The trajectory schema version a (readable) file was written with."""
    metadata: dict[bytes, bytes] = pq.read_schema(path).metadata or {}
    return metadata.get(SCHEMA_VERSION_KEY, b"").decode()


def read_trajectories(path: str | os.PathLike[str]) -> list[Trajectory]:
    return from_table(read_table(path))


def from_table(table: pa.Table) -> list[Trajectory]:
    """The trajectories of a table (of ``read_table``, or rows taken from one), in row order."""
    out = []
    for r in table.to_pylist():
        r["info"] = json.loads(r["info"]) if r["info"] else {}
        out.append(Trajectory(**r))
    return out
