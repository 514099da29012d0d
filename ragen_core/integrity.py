"""sha256 digests of a run's stored files: recorded when a file is written, verified when it is read.

A folder that holds artifacts keeps a ``SHA256SUMS`` file in the format of coreutils' ``sha256sum``
(``<hex>  <name>`` per line, names relative to the folder), so ``sha256sum -c SHA256SUMS`` checks it
by hand too. A stored file whose bytes no longer match its recorded digest (a flipped bit, a
truncated copy, an edit) raises :class:`CorruptFileError` naming the file, instead of being trained
on or blamed on reproducibility. Files without a record (runs written before digests existed, a
user's own Parquet file) read as before: there is nothing to check them against.

Digests are memoised per process by ``(device, inode, size, mtime, ctime)``, so a file hashed when it
was written is not hashed again when the same process reads it back; a rewrite changes the key (up
to the file system's timestamp granularity, a few ms: a same-size rewrite within it in the same
process would be missed, which writing through the project's own functions never does).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ragen_core.errors import RagenError
from ragen_core.storage import write_text_whole

SUMS_NAME = "SHA256SUMS"
_CHUNK = 4 * 2**20
_MEMO: dict[tuple[str, int, int, int, int, int], str] = {}


class CorruptFileError(RagenError, ValueError):
    """A stored file is missing or does not match the digest recorded when it was written."""


def file_key(path: str | os.PathLike[str]) -> tuple[str, int, int, int, int, int]:
    """What tells, without reading it, that a file is still the one seen before: its resolved path,
    device, inode, size, mtime and ctime (a file replaced by rename has a new inode; one edited in
    place a new mtime, except within one clock tick on kernels with coarse file timestamps, before
    Linux 6.13's multigrain timestamps). Raises ``OSError`` when it is gone."""
    path = Path(path)
    st = path.stat()
    return (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes (hex), memoised while the file is unchanged (:func:`file_key`)."""
    path = Path(path)
    key = file_key(path)
    if key in _MEMO:
        return _MEMO[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    _MEMO[key] = digest = h.hexdigest()
    return digest


def _sums_file(folder: Path) -> Path:
    return folder / SUMS_NAME


def read_sums(folder: str | os.PathLike[str]) -> dict[str, str]:
    """``{relative name: sha256}`` of a folder's ``SHA256SUMS`` (empty if it has none)."""
    sums = _sums_file(Path(folder))
    if not sums.is_file():
        return {}
    out: dict[str, str] = {}
    for n, line in enumerate(sums.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            raise CorruptFileError(
                f"{sums}: line {n} is not '<sha256>  <name>'; the digest file is corrupt. "
                "Delete it to read the folder unchecked, or restore the folder"
            )
        out[name.removeprefix("*")] = digest
    return out


def _write_sums(folder: Path, sums: dict[str, str]) -> None:
    write_text_whole(
        _sums_file(folder), "".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items()))
    )


def record(path: str | os.PathLike[str]) -> str:
    """Hash ``path`` and record it in its folder's ``SHA256SUMS``; returns the digest."""
    path = Path(path)
    digest = sha256_file(path)
    sums = read_sums(path.parent)
    if sums.get(path.name) != digest:
        sums[path.name] = digest
        _write_sums(path.parent, sums)
    return digest


def record_tree(folder: str | os.PathLike[str]) -> dict[str, str]:
    """Hash every file under ``folder`` and write its ``SHA256SUMS`` (relative posix paths)."""
    folder = Path(folder)
    sums = {
        p.relative_to(folder).as_posix(): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != SUMS_NAME
    }
    _write_sums(folder, sums)
    return sums


def recorded(path: str | os.PathLike[str]) -> str | None:
    """The digest recorded for ``path`` in its folder's ``SHA256SUMS``, or None."""
    path = Path(path)
    return read_sums(path.parent).get(path.name)


def _mismatch(path: Path, expected: str, actual: str, sums: Path, fix: str) -> CorruptFileError:
    return CorruptFileError(
        f"{path}: corrupt file: its sha256 {actual[:12]}... differs from {expected[:12]}... recorded in {sums} "
        f"when it was written. {fix}"
    )


def verify(
    path: str | os.PathLike[str], fix: str = "Restore it from a copy, or rerun the stage that wrote it"
) -> bool:
    """Check ``path`` against its recorded digest: True if it matches, False if nothing was recorded.

    Raises :class:`CorruptFileError` (naming the file and ``fix``) when it is missing while recorded,
    or when its bytes differ from the record.
    """
    path = Path(path)
    expected = recorded(path)
    if expected is None:
        return False
    if not path.is_file():
        raise CorruptFileError(f"{path}: missing, although {_sums_file(path.parent)} records it. {fix}")
    actual = sha256_file(path)
    if actual != expected:
        raise _mismatch(path, expected, actual, _sums_file(path.parent), fix)
    return True


def verify_tree(
    folder: str | os.PathLike[str], fix: str = "Restore it from a copy, or rerun the stage that wrote it"
) -> bool:
    """Check every file a folder's ``SHA256SUMS`` lists: True if all match, False if it has none."""
    folder = Path(folder)
    sums = read_sums(folder)
    if not sums:
        return False
    for name, expected in sums.items():
        p = folder / name
        if not p.is_file():
            raise CorruptFileError(f"{p}: missing, although {_sums_file(folder)} records it. {fix}")
        actual = sha256_file(p)
        if actual != expected:
            raise _mismatch(p, expected, actual, _sums_file(folder), fix)
    return True


def intact(path: str | os.PathLike[str]) -> bool:
    """True only if ``path`` (a file, or a folder with its own ``SHA256SUMS``) exists and matches its
    record. What a cache may trust: an unrecorded, missing or corrupt output is not reused."""
    path = Path(path)
    try:
        if path.is_dir():
            return verify_tree(path)
        return path.is_file() and verify(path)
    except (CorruptFileError, OSError):
        return False
