"""One clear error for a run artifact that cannot be written (full disk, quota, read-only folder).

A bare ``OSError(ENOSPC)`` from deep inside ``fsync`` or a safetensors writer names no file and no
fix; every writer of a run artifact re-raises it as :class:`StorageWriteError`, which does both and
is still an ``OSError`` (callers that catch ``OSError`` keep working).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class StorageWriteError(OSError):
    """A run artifact could not be written; the message names the file and the fix."""

    user_error = True

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 28]" prefix
        return str(self.strerror)


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
