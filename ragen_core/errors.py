"""User errors versus internal errors: which exceptions the CLI reports as one clear line.

A *user error* is something the person running ``ragen`` can fix (a config key, a file, a folder,
a run id); its message names the cause, the file or key, and the fix, and the CLI prints just that
line. Anything else is an *internal error*: the CLI prints its type and message on one line and
the traceback only with ``--debug`` (or ``RAGEN_DEBUG=1``).

The convention: an exception class with a true ``user_error`` attribute is a user error.
:class:`RagenError` carries it; the project's own error classes subclass it (or set the attribute),
so this module needs no list of them. The older classes that predate it are recognised by name in
:data:`KNOWN_USER_ERRORS` (looked up in ``sys.modules`` only: an exception of a class whose module
was never imported cannot exist, so classifying never imports torch or Ray).
"""

from __future__ import annotations

import errno
import os
import re
import sys

__all__ = [
    "KNOWN_USER_ERRORS",
    "RAY_ACTOR_LOST",
    "RagenError",
    "describe",
    "is_debug",
    "is_user_error",
    "ray_actor_lost",
    "root_cause",
]


class RagenError(Exception):
    """Base of ragen-flow's user errors: the message names the cause, the file or key, and the fix."""

    user_error = True


#: (module, class name) of user-error classes that do not subclass :class:`RagenError` (yet).
KNOWN_USER_ERRORS: tuple[tuple[str, str], ...] = (
    ("ragen_core.config", "ConfigError"),
    ("ragen_core.run.preflight", "PreflightError"),
    ("ragen_core.trajectory", "TrajectoryFileError"),
    ("ragen_core.learner.checkpoint", "CheckpointError"),
    ("ragen_core.tracking.offline", "TrackingError"),
    ("ragen_core.sweep.spec", "SweepError"),
    ("ragen_core.config.model", "ModelNotFoundError"),
    ("ragen_core.rollout.vllm_engine", "VLLMUnavailableError"),
    ("ragen_core.rollout.engine", "PromptTooLongError"),
    ("envs.registry", "UnknownEnvError"),
)

#: Ray's exceptions for an actor (or the node, or the worker process under it) that is gone: what a
#: retry on a rebuilt actor can help with. By name, so that classifying never imports Ray.
RAY_ACTOR_LOST = frozenset(
    {"RayActorError", "ActorDiedError", "WorkerCrashedError", "ActorUnavailableError", "NodeDiedError"}
)


def ray_actor_lost(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from, says a Ray actor or node was lost."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if any(cls.__name__ in RAY_ACTOR_LOST for cls in type(current).__mro__):
            return True
        current = current.__cause__ or current.__context__
    return False


# OSError numbers that mean "this path cannot be used": the user picks another folder or frees space.
_PATH_ERRNOS = {
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.ENOSPC,
    errno.EDQUOT,
    errno.ENOENT,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EEXIST,
}

_FIXES = {
    errno.EACCES: "make it writable or set RAGEN_STATE_DIR (state) / trainer.run_root (runs) to a writable folder",
    errno.EPERM: "make it writable or set RAGEN_STATE_DIR (state) / trainer.run_root (runs) to a writable folder",
    errno.EROFS: "it is on a read-only file system; set RAGEN_STATE_DIR (state) / trainer.run_root (runs) "
    "to a writable folder",
    errno.ENOSPC: "the disk is full; free space or set RAGEN_STATE_DIR / trainer.run_root to another disk",
    errno.EDQUOT: "the disk quota is exhausted; free space or set RAGEN_STATE_DIR / trainer.run_root elsewhere",
}


def is_debug() -> bool:
    """``--debug`` on the command line (which sets it) or ``RAGEN_DEBUG=1`` in the environment."""
    return os.environ.get("RAGEN_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def root_cause(exc: BaseException) -> BaseException:
    """The exception to report: Ray wraps a remote exception in ``RayTaskError`` (whose text carries
    the remote traceback); its ``cause`` is the original."""
    seen = 0
    while seen < 8:
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException) or cause is exc:
            break
        exc, seen = cause, seen + 1
    return exc


def _known(exc: BaseException) -> bool:
    for module, name in KNOWN_USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return True
    return False


def _path_error(exc: BaseException) -> bool:
    if not isinstance(exc, OSError):
        return False
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        return True  # a run lookup, a config file, a folder: the message names the path
    if exc.filename is not None or exc.errno in _PATH_ERRNOS:
        return True
    # a project message wrapping such an error (``raise OSError("cannot create ...") from exc``)
    return isinstance(exc.__cause__, OSError) and _path_error(exc.__cause__)


def is_user_error(exc: BaseException) -> bool:
    exc = root_cause(exc)
    return bool(getattr(type(exc), "user_error", False)) or _known(exc) or _path_error(exc)


def _os_message(exc: OSError) -> str:
    if exc.filename is None or exc.strerror is None:
        return str(exc)  # the project's own wording
    where = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 else "")
    fix = _FIXES.get(exc.errno or 0)
    return f"{where}: {exc.strerror}" + (f"; {fix}" if fix else "")


#: Terminal escape sequences (colours, cursor moves, titles): Ray colours the remote traceback and the
#: actor name it puts in an error's text, which then reached the user as raw ``\x1b[36m``.
_ESCAPES = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)?|[@-Z\\-_])")


def plain(text: str) -> str:
    """``text`` without terminal escape sequences."""
    return _ESCAPES.sub("", text)


def describe(exc: BaseException) -> str:
    """What the CLI prints: the user error's own message, or one ``internal error`` line (either
    without terminal escape sequences: an error relayed from a Ray actor carries Ray's colours)."""
    exc = root_cause(exc)
    if is_user_error(exc):
        if isinstance(exc, OSError) and not _known(exc) and not getattr(type(exc), "user_error", False):
            return plain(_os_message(exc))
        return plain(str(exc)) or type(exc).__name__
    text = " ".join(plain(str(exc)).split())
    if len(text) > 500:
        text = text[:500] + " ..."
    return f"internal error: {type(exc).__name__}: {text} (rerun with --debug for the traceback)"
