"""A run directory and the run index: paths, atomic writes with recorded digests, names and lookup.

The run directory is the single source of truth (full map: docs/architecture.md, "Run directory"):
every stage reads its inputs from it and writes its outputs into it, so any stage of any iteration
can be rerun from disk, and a run killed at any point resumes from its last completed iteration.
Iterations are numbered from 1; step 0 is the policy before training (its validation, if
configured). Nothing here touches torch or Ray.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from ragen_core.config import ConfigError, RagenConfig, config_hash, dump_config, flatten, load_config
from ragen_core.errors import RagenError
from ragen_core.integrity import record, verify
from ragen_core.state_folder import (
    index_entry,
    indexed_run,
    locate_run,
    read_run_index,
    run_index_path,
    run_not_found,
    runs_dir,
)
from ragen_core.storage import write_error, write_text_whole


class RunFileError(RagenError, ValueError):
    """A file of a run directory that cannot be read (not JSON, not a config); names the file and the fix."""


class RunDir:
    """Paths of one run; nothing here touches torch or Ray."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    # identity and config
    @property
    def config_path(self) -> Path:
        return self.root / "config.yaml"

    @property
    def info_path(self) -> Path:
        return self.root / "run.json"

    @property
    def init_policy(self) -> Path:
        return self.root / "init_policy"

    def info(self) -> dict[str, Any]:
        return self.read_json(self.info_path) if self.info_path.exists() else {}

    def read_json(self, path: str | os.PathLike[str]) -> Any:
        """A JSON file of this run, checked against the digest recorded when it was written; a
        corrupt or unparsable file raises ``CorruptFileError`` / ``RunFileError`` naming it."""
        path = Path(path)
        fix = self._repair(path)
        verify(path, fix=fix)
        try:
            return json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise RunFileError(f"{path}: missing. {fix}") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RunFileError(f"{path}: not valid JSON ({exc}). {fix}") from exc

    def _repair(self, path: Path) -> str:
        """What a user can do about a damaged file of this run (said in the error). Files of an
        iteration are recomputed by resuming from before it: its stages replay what is damaged
        (``stage_record``) and reuse what is intact."""
        if path == self.info_path:
            return (
                "Restore it from a copy; it holds the run's identity (run_id, config_hash, mlflow_run_id), "
                "which cannot be recomputed"
            )
        if path == self.config_path:
            return "Restore it from a copy (the run's MLflow artifacts hold config.yaml), or start a new run"
        top = path.relative_to(self.root).parts[0] if path.is_relative_to(self.root) else ""
        k = int(top[5:]) if top.startswith("iter_") and top[5:].isdigit() else None
        if path.parent == self.root / "eval" and path.stem.startswith("step_") and path.stem[5:].isdigit():
            k = int(path.stem[5:]) or None  # step 0 (before training) belongs to no iteration
            if k is None:
                return (
                    f"Restore it from a copy, or recompute it into {self.root / 'reruns'} with "
                    f"`ragen rerun {self.root} --iteration 0 --stage evaluate`"
                )
        if k is not None:
            return (
                f"Restore it from a copy, or delete {self.done_file(k)} and resume the run "
                f"(`ragen train --resume`): iteration {k} is recomputed from its intact inputs"
            )
        return "Restore it from a copy"

    def update_info(self, **values: Any) -> dict[str, Any]:
        info = {**self.info(), **values}
        atomic_write_text(self.info_path, json.dumps(info, indent=2, sort_keys=True))
        return info

    def config(self) -> RagenConfig:
        """The run's config, checked against its recorded digest; a damaged file names itself."""
        if not self.config_path.is_file():
            raise RunFileError(f"{self.config_path}: missing; {self.root} is not a complete run directory")
        verify(self.config_path, fix=self._repair(self.config_path))
        try:
            return load_config(self.config_path, stored=True)  # may come from an earlier version
        except ConfigError as exc:  # its message names the file already; the fix differs for a run's copy
            raise RunFileError(
                f"{' '.join(str(exc).split())}. It is this run's stored config: "
                f"{self._repair(self.config_path)}"
            ) from exc
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise RunFileError(
                f"{self.config_path}: not valid YAML ({' '.join(str(exc).split())}). "
                f"{self._repair(self.config_path)}"
            ) from exc

    # per iteration
    def iter_dir(self, k: int) -> Path:
        return self.root / f"iter_{k:04d}"

    def rollouts(self, k: int) -> Path:
        return self.iter_dir(k) / "rollouts.parquet"

    def filter_file(self, k: int) -> Path:
        return self.iter_dir(k) / "filter.json"

    def checkpoint(self, k: int) -> Path:
        """Learner state after ``k`` iterations (``k = 0``: the fresh learner, saved once per run)."""
        return self.root / "init_checkpoint" if k == 0 else self.iter_dir(k) / "checkpoint"

    def policy_after(self, k: int) -> Path:
        """The policy weights after ``k`` iterations (``init_policy`` for 0)."""
        return self.init_policy if k == 0 else self.checkpoint(k) / "policy"

    def metrics_file(self, k: int) -> Path:
        return self.iter_dir(k) / "metrics.json"

    def done_file(self, k: int) -> Path:
        return self.iter_dir(k) / "DONE"

    def eval_file(self, step: int) -> Path:
        return self.root / "eval" / f"step_{step:04d}.parquet"

    def eval_metrics_file(self, step: int) -> Path:
        return self.root / "eval" / f"step_{step:04d}.json"

    def stage_record(self, stage: str, k: int) -> Path:
        """What stage ``stage`` of iteration ``k`` (``evaluate``: step ``k``) made, and from what."""
        folder = self.root / "eval" if stage == "evaluate" else self.iter_dir(k)
        return folder / "stages" / (f"step_{k:04d}.json" if stage == "evaluate" else f"{stage}.json")

    def last_complete(self) -> int:
        """The last iteration whose DONE mark exists and all before it too (0 if none)."""
        k = 0
        while self.done_file(k + 1).exists():
            k += 1
        return k

    # Echo-Trap rollbacks: an append-only log beside the iterations, which it never rewrites, so
    # every stored iteration stays rerunnable bitwise.
    def rollback_file(self, k: int) -> Path:
        """The rollback decided after iteration ``k`` (``{"after", "to", "signals", "at"}``), if any."""
        return self.root / "rollbacks" / f"after_{k:04d}.json"

    def rolled_back_to(self, k: int) -> int | None:
        """Where the rollback after iteration ``k`` went back to (None: there was none)."""
        f = self.rollback_file(k)
        return int(self.read_json(f)["to"]) if k > 0 and f.exists() else None

    def start_of(self, k: int) -> int:
        """The iteration whose state iteration ``k`` starts from: ``k - 1``, or the earlier iteration
        that a rollback after ``k - 1`` went back to."""
        to = self.rolled_back_to(k - 1)
        return k - 1 if to is None else to

    def best_step(self, last: int) -> int | None:
        """The validated step up to ``last`` with the highest validation success (the earliest of
        equals; None: none validated)."""
        best, best_value = None, -1.0
        for step in range(0, last + 1):
            f = self.eval_metrics_file(step)
            if f.exists():
                value = self.read_json(f).get("val-env/success", -1.0)
                if value > best_value:
                    best, best_value = step, value
        return best


def atomic_write_text(path: Path, text: str, *, record_digest: bool = True) -> None:
    """Write ``text`` atomically (temp file, fsync, rename) and record its sha256 in the folder's
    ``SHA256SUMS`` (``record_digest=False``: a mark whose existence is its content, like DONE).

    An ``OSError`` (full disk, read-only folder) is raised as ``StorageWriteError`` naming ``path``.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_whole(path, text)
        if record_digest:
            record(path)
    except OSError as exc:
        raise write_error(path, exc) from exc


#: files at least this large are identified by (size, mtime_ns), not hashed: a 0.5B-parameter
#: checkpoint (policy + critic + optimiser, ~12 GB in float32) would take tens of seconds to hash at
#: every cache-key lookup. Rewriting a file changes its mtime, so a change still misses the cache.
DIGEST_BY_STAT_BYTES = 64 * 2**20


_DIGESTS: dict[str, tuple[tuple[int, int, int], str]] = {}


def _one_digest(p: Path) -> str:
    st = p.stat()
    ident = (st.st_ino, st.st_size, st.st_mtime_ns)
    cached = _DIGESTS.get(str(p))
    if cached is not None and cached[0] == ident:
        return cached[1]  # unchanged since last hashed in this process
    if st.st_size >= DIGEST_BY_STAT_BYTES:
        digest = f"stat:{st.st_size}:{st.st_mtime_ns}"
    else:
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
    _DIGESTS[str(p)] = (ident, digest)
    return digest


def file_digest(path: Path) -> str:
    """Digest of a file, or of a directory's files (names and per-file digests, sorted).

    Per file: sha256 of its bytes, or ``(size, mtime_ns)`` for files of
    :data:`DIGEST_BY_STAT_BYTES` or more; memoised per process while the file is unchanged.
    """
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        if path.is_dir():
            h.update(str(p.relative_to(path)).encode())
        h.update(_one_digest(p).encode())
    return h.hexdigest()


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "tokenizer.model",
)


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Make a checkpoint's policy folder a complete Hugging Face model (weights + tokenizer)."""
    import shutil

    for name in _TOKENIZER_FILES:
        if (src / name).exists() and dst.is_dir():
            shutil.copy2(src / name, dst / name)


def _index_path() -> Path:
    return run_index_path()


#: A run name: letters, digits, ``-``, ``_`` and ``.``, starting with a letter or digit, so that it is
#: one folder name under the run root (no ``..``, no ``/``, no absolute path) and fits in an MLflow
#: run name with the hash and random suffix that ``create_run`` appends.
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class RunNameError(RagenError, ValueError):
    """A run name that is not one safe folder name."""


def check_run_name(name: str, source: str = "--name") -> str:
    """``name`` if it is a valid run name, else :class:`RunNameError` naming ``source`` and the rule."""
    if not RUN_NAME.fullmatch(name):
        shown = name if len(name) <= 40 else f"{name[:40]}... ({len(name)} characters)"
        raise RunNameError(
            f"{source} {shown!r} is not a valid run name: use 1-64 letters, digits, '-', '_' "
            "or '.', starting with a letter or digit"
        )
    return name


def run_name(
    cfg: RagenConfig, name: str | None = None, config_path: str | os.PathLike[str] | None = None
) -> str:
    """The name of a new run: ``name`` (``--name``), else ``trainer.run_name``, else the config file's
    stem, else ``run``; checked by :func:`check_run_name`."""
    if name:
        return check_run_name(name)
    if cfg.trainer.run_name:
        return check_run_name(cfg.trainer.run_name, "trainer.run_name")
    if config_path is not None:
        stem = to_run_name(Path(config_path).stem)
        if stem:
            return check_run_name(stem, "the config file name")
    return "run"


def to_run_name(text: str) -> str:
    """``text`` made a valid run name (other characters become ``-``, cut to 64), or ``""``: for
    names made from other names (a config file, a sweep member's key)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text).lstrip("-_.")[:64]


def create_run(
    cfg: RagenConfig, name: str | None = None, root: str | os.PathLike[str] | None = None
) -> RunDir:
    """A new run directory with its config; the run id is ``<name>-<config hash>-<random>``.

    ``name`` defaults to ``trainer.run_name`` or ``run`` and must pass :func:`check_run_name`. The id is
    recorded in the state folder's run index, so ``--resume ID`` finds the run wherever its
    ``trainer.run_root`` put it.
    """
    chash = config_hash(cfg)
    name = check_run_name(name) if name else run_name(cfg)
    run_id = f"{name}-{chash[:8]}-{uuid.uuid4().hex[:6]}"
    run = RunDir(runs_dir(root or cfg.trainer.run_root) / run_id)
    read_run_index()  # a damaged index fails before the run folder exists, not after
    try:
        run.root.mkdir(parents=True, exist_ok=False)
    except OSError as exc:
        raise OSError(
            f"cannot create run directory {run.root}: {exc.strerror}; check trainer.run_root "
            "is writable and the disk has space"
        ) from exc
    record(dump_config(cfg, run.config_path))
    # the hash and keys a resume compares config.yaml with (ragen_core.run.resume)
    run.update_info(run_id=run_id, config_hash=chash, config_keys=flatten(cfg), created=time.time())
    _index_add(run_id, run.root.resolve())
    return run


def _index_add(run_id: str | None, root: Path | None) -> dict[str, str]:
    """Add a run to the state folder's index (None: add none); a lock beside it keeps concurrent new
    runs' entries. Entries that point into the folder this one was copied or moved from are recorded
    as this folder's own at the same time (:func:`~ragen_core.state_folder.indexed_run`). Returns the
    entries so rewritten (``{run id: old entry}``)."""
    import fcntl

    _index_path().parent.mkdir(parents=True, exist_ok=True)
    with open(_index_path().with_name(".runs.json.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        index = read_run_index()
        rewritten = {}
        for known, entry in index.items():
            own = index_entry(indexed_run(entry))
            if own != entry and not Path(own).is_absolute():  # a run outside the folder keeps its entry
                index[known], rewritten[known] = own, entry
        if run_id is not None and root is not None:
            index[run_id] = index_entry(root)
        if run_id is not None or rewritten:
            text = json.dumps(index, indent=1, sort_keys=True)
            atomic_write_text(_index_path(), text, record_digest=False)
        return rewritten


def relocate_index() -> dict[str, str]:
    """Record the run index's entries relative to this state folder where they point into the folder
    it was copied or moved from (``ragen doctor --fix``); returns them (``{run id: old entry}``)."""
    return _index_add(None, None)


def find_run(run_id_or_path: str, run_root: str | os.PathLike[str] | None = None) -> RunDir:
    """A run by directory, by id (the state folder's run index), or by id under ``run_root``."""
    root = locate_run(run_id_or_path, run_root)
    if root is None:
        raise FileNotFoundError(run_not_found(run_id_or_path, run_root))
    link = linked_part(Path(root))
    if link is not None:
        raise RunFileError(
            f"{link} is a symbolic link (to {os.readlink(link)}): a run writes its files only inside its own "
            f"folder, never through a link to another place; replace the link by a copy of what it points to "
            f"(cp -a --remove-destination $(readlink -f {link}) {link}) and run the command again"
        )
    return RunDir(root)


def linked_part(root: Path) -> Path | None:
    """The first folder of run ``root`` (``eval``, ``iter_0003``, ``iter_0003/checkpoint``, ...) that is a
    symbolic link: writing through it would change files outside the run, maybe another run's."""
    try:
        children = sorted(root.iterdir())
    except OSError:
        return None  # what cannot be listed is named by whatever reads it
    for child in children:
        if child.is_symlink():
            return child
        if child.name.startswith("iter_") and child.is_dir():
            for part in sorted(child.iterdir()):
                if part.is_symlink():
                    return part
    return None
