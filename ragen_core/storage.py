"""Writing files: whole or not at all, and one clear error when they cannot be written (full disk,
quota, read-only folder).

A bare ``OSError(ENOSPC)`` from deep inside ``fsync`` or a safetensors writer names no file and no
fix; every writer of a run artifact re-raises it as :class:`StorageWriteError`, which does both and
is still an ``OSError`` (callers that catch ``OSError`` keep working).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class StorageWriteError(OSError):
    """A run artifact could not be written; the message names the file and the fix."""

    user_error = True

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 28]" prefix
        return str(self.strerror)


def write_text_whole(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: into a temporary file beside it (named for this
    process), flushed to disk, then renamed over it, so that a reader, a crash or a kill mid-write finds
    the old file or the new one, never half of one. A failed write removes the temporary file and raises
    its ``OSError`` as it is (callers that write run artifacts wrap it with :func:`write_error`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):  # the write's own error is the one to report
            tmp.unlink(missing_ok=True)
        raise


def write_error(path: str | os.PathLike[str], exc: OSError, what: str = "file") -> StorageWriteError:
    """``exc`` (raised while writing ``path``) as a :class:`StorageWriteError` naming the path and the fix."""
    if isinstance(exc, StorageWriteError):
        return exc
    reason = exc.strerror or str(exc)
    if exc.errno in _NO_SPACE:
        fix = "free disk space or choose another trainer.run_root (--set trainer.run_root=...)"
    else:
        fix = "make its folder writable or choose another trainer.run_root (--set trainer.run_root=...)"
    return StorageWriteError(exc.errno or 0, f"{Path(path)}: cannot write {what}: {reason}; {fix}")


# safetensors' writer reports "I/O error: No space left on device (os error 28)"; torch.save's zip
# writer, after a short write on a full disk, only "[enforce fail at inline_container.cc] unexpected
# pos N vs M". Neither is an OSError, so the run used to end in an "internal error".
_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")
_SHORT_WRITE = "unexpected pos"


def as_os_error(exc: BaseException, path: str | os.PathLike[str]) -> OSError | None:
    """``exc`` if it is an ``OSError``; the ``OSError`` a library's write error stands for (the errno it
    names, or a short write on the disk of ``path`` when that disk is nearly full); else None."""
    if isinstance(exc, OSError):
        return exc
    text = str(exc)
    found = _OS_ERROR_IN_TEXT.search(text)
    if found:
        code = int(found.group(1))
        return OSError(code, os.strerror(code))
    if _SHORT_WRITE in text and shutil.disk_usage(existing_ancestor(path)).free < 256 * 2**20:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def existing_ancestor(path: str | os.PathLike[str]) -> Path:
    """``path`` itself if it exists, else its nearest existing parent folder (the disk it will be on)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe
