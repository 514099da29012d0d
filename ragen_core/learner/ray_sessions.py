"""The Ray clusters a run starts for itself: a start that times out, named (:func:`named_start_failure`),
the caller's SIGTERM handler kept through the start (:func:`keeps_sigterm_handler`), and their session
folders (``/tmp/ray/session_<date>_<pid>``): removed when the process ends, and those of earlier processes that were killed before they could
remove theirs, at the next start. Ray keeps every session's folder (logs, sockets, spilled objects),
so a day of runs left 29 of them.

Only ours: a session folder is ragen's when it holds :data:`OWNER_FILE`, written right after the
cluster started, with the process id and start time of the process that started it. A cluster joined
by address, or started by anyone else, has no such file and is never touched.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from ragen_core.errors import RagenError

_log = logging.getLogger(__name__)

#: The file that marks a session folder as made by a cluster of ours.
OWNER_FILE = "ragen-owner.json"


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot; None: no such process): with the pid,
    it names one process, though pids are reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_alive(session: Path) -> bool:
    try:
        owner = json.loads((session / OWNER_FILE).read_text())
        return bool(_start_time(int(owner["pid"])) == owner["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return True  # unreadable: not ours to judge, keep it


def remove_stale_sessions(temp_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the session folders under ``temp_dir`` (default: Ray's, ``$RAY_TMPDIR/ray`` or
    ``/tmp/ray``) of our clusters whose process is gone; returns the removed."""
    if temp_dir is None:
        from ray._common.utils import get_default_ray_temp_dir

        temp_dir = get_default_ray_temp_dir()
    removed = []
    for session in sorted(Path(temp_dir).glob("session_*")):
        if session.is_symlink() or not (session / OWNER_FILE).is_file() or _owner_alive(session):
            continue
        shutil.rmtree(session, ignore_errors=True)
        removed.append(session)
    _drop_dangling_latest(Path(temp_dir))
    return removed


def _drop_dangling_latest(temp_dir: Path) -> None:
    latest = temp_dir / "session_latest"
    if latest.is_symlink() and not latest.exists():
        latest.unlink(missing_ok=True)


def claim_new_session() -> None:
    """:func:`claim_session` of the cluster ``ray.init`` just started in this process."""
    import ray

    node = ray._private.worker._global_node
    if node is not None:
        claim_session(node.get_session_dir_path())


#: The processes of a local cluster it cannot run without, by Ray's process type: what they are called.
_VITAL = {"raylet": "Ray raylet", "gcs_server": "Ray GCS server"}


def cluster_services() -> dict[int, str]:
    """The pids of the raylet and GCS server of the cluster ``ray.init`` started in this process
    (pid: what it is); empty when it joined one by address."""
    import ray

    node = ray._private.worker._global_node
    if node is None:
        return {}
    return {
        info.process.pid: name
        for kind, name in _VITAL.items()
        for info in node.all_processes.get(kind, [])
        if info.process is not None
    }


def claim_session(session: str | os.PathLike[str]) -> None:
    """Mark ``session`` (the folder of the cluster this process just started) as ours, and remove it
    when this process exits: after Ray's shutdown, which this does first (Ray's own exit hook was
    registered when Ray was imported, so it would run after this one)."""
    path = Path(session)
    start = _start_time(os.getpid())
    try:
        (path / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "start": start}))
    except OSError as exc:  # a courtesy: the run goes on, the folder stays
        _log.debug("could not mark Ray session %s: %s", path, exc)
        return
    atexit.register(_remove_at_exit, path)


def _remove_at_exit(session: Path) -> None:
    import ray

    try:
        ray.shutdown()
    except Exception as exc:  # a cluster that is already gone: its folder can still go
        _log.debug("ray.shutdown at exit: %s", exc)
    shutil.rmtree(session, ignore_errors=True)
    _drop_dangling_latest(session.parent)


class RayStartError(RagenError, RuntimeError):
    """The run's own Ray cluster did not come up on this machine."""


@contextlib.contextmanager
def named_start_failure() -> Iterator[None]:
    """Ray gives its raylet a fixed 30 s to register and then raises a bare ``Exception`` ("The current
    node timed out during startup"); on a machine busy with other work (``make run`` at low priority
    beside a 2-thread training run) that happens. It becomes a :class:`RayStartError` with the fix."""
    try:
        yield
    except Exception as exc:
        if "timed out during startup" not in str(exc):
            raise
        load = os.getloadavg()[0]
        raise RayStartError(
            f"the run's own Ray cluster did not start: its node did not register within Ray's 30 s (load "
            f"average {load:.1f} on {os.cpu_count()} CPUs: the machine is busy). Run it again when the "
            "machine is quieter (a run that got a folder continues with `ragen train --resume RUN_ID`; "
            "`ragen show` lists them), or --set trainer.backend=local to train without Ray"
        ) from exc


@contextlib.contextmanager
def keeps_sigterm_handler() -> Iterator[None]:
    """Put the caller's SIGTERM handler back after ``ray.init()``, which makes a driver's SIGTERM a bare
    ``sys.exit``: under the CLI a SIGTERM (``timeout``, a scheduler, ``kill``) then ended a ray-backend
    run as a Prefect crash, without the line saying how to resume. A default handler stays Ray's."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if callable(previous):
            signal.signal(signal.SIGTERM, previous)
