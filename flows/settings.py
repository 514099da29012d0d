"""Process environment for ragen-flow's services, set before Prefect, MLflow or Ray are imported.

Embedded defaults (README's main job): Prefect starts an ephemeral local server with its state in
``.state/prefect``; MLflow writes a local SQLite store in ``.state``; no telemetry anywhere; no
downloads. Anything already set in the environment wins (e.g. ``PREFECT_API_URL`` or
``MLFLOW_TRACKING_URI`` pointing at real servers). Ray's settings (loopback, token auth) are made
where the cluster starts, in ``ragen_core.learner.actors.init_ray``.

``configure_environment`` also starts a watchdog (Linux): the child servers of this process (the
ephemeral Prefect server, Ray's GCS, raylet, agents and workers, a vLLM engine, ``ragen ui``'s
servers) die with it, even when it is SIGKILLed and cannot clean up.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ragen_core.priority import lower_priority, nice_increment
from ragen_core.run.service_watch import LAST_WORDS_VAR, SAY_FD_VAR
from ragen_core.state_folder import check_state_dir, state_dir

STATE_DIR = state_dir()

#: The watchdog of this process, once started (kept so that it is not collected while running).
_watchdog: subprocess.Popen[bytes] | None = None

# Runs in a bare interpreter (-I -S: no site, no venv imports; ~20 ms, ~8 MB). It waits until its
# parent is gone (re-parented: polling getppid is immune to what the parent does with its fds and
# threads), then stops every process whose environment carries the marker, which every descendant
# inherits however it was started (Prefect's uvicorn, Ray's daemons that Ray re-parents or puts in
# sessions of their own). SIGTERM first, SIGKILL after a second, and again for processes started
# while the tree was going down (a raylet starting a worker).
# It is also the one voice of the parent's service watch (ragen_core.run.service_watch): a line the
# parent sends on the watchdog's stdin is said at once (and the parent's last-words file removed, which
# tells the parent it was said); if the parent ends without sending one, the line of a watched service
# that is dead by now is said from that file (a normal exit takes the file back). Said once either way.
_WATCHDOG = r"""
import json, os, select, signal, sys, time
parent, needle, words = int(sys.argv[1]), sys.argv[2].encode() + b"=", sys.argv[3]
signal.signal(signal.SIGINT, signal.SIG_IGN)
said, listening = False, True
while os.getppid() == parent:
    if not listening:
        time.sleep(0.2)
        continue
    if not select.select([0], [], [], 0.2)[0]:
        continue
    line = os.read(0, 65536).split(b"\n")[0]
    if not line:  # the parent's end closed: it is ending
        listening = False
        continue
    if not said:
        os.write(2, line + b"\n")
        said = True
    try:
        os.unlink(words)
    except OSError:
        pass
def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
try:
    with open(words) as f:
        lines = json.load(f)
    os.unlink(words)
except (OSError, ValueError):
    lines = {}
wait = time.monotonic() + 1.0  # a service killed as its parent ended can take a moment to be gone
while True:
    dead = [line for pid, line in lines.items() if not alive(int(pid))]
    if dead or said or not lines or time.monotonic() > wait:
        break
    time.sleep(0.05)
if dead and not said:
    os.write(2, dead[0].encode() + b"\n")
me = os.getpid()
def tree():
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                with open("/proc/" + name + "/environ", "rb") as f:
                    if any(e.startswith(needle) for e in f.read().split(b"\0")):
                        pids.append(int(name))
            except OSError:
                pass
    return pids
def send(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
deadline = time.monotonic() + 20
quiet = 0
while quiet < 2 and time.monotonic() < deadline:
    pids = tree()
    if not pids:
        quiet += 1
        time.sleep(0.3)
        continue
    quiet = 0
    send(pids, signal.SIGTERM)
    t = time.monotonic() + 1.0
    while time.monotonic() < t and tree():
        time.sleep(0.1)
    send(tree(), signal.SIGKILL)
"""


def start_watchdog() -> str | None:
    """Tie this process's descendants to its life (once per process); returns the marker variable.

    Every process started after this call inherits ``RAGEN_TREE_<id>=1``; when this process ends,
    however it ends, the watchdog stops the ones still running. Linux only (it reads /proc).
    """
    global _watchdog
    if not sys.platform.startswith("linux") or not Path("/proc/self/environ").exists():
        return None
    mine = f"RAGEN_TREE_{os.getpid()}_"  # a forked child has a marker of its own, not its parent's
    if _watchdog is not None and _watchdog.poll() is None:
        return next((k for k in os.environ if k.startswith(mine)), None)
    name = mine + uuid.uuid4().hex[:8]
    env = {k: v for k, v in os.environ.items() if k != name}  # the watchdog itself is no target
    words = Path(tempfile.gettempdir()) / f"ragen-last-words-{os.getpid()}-{name[-8:]}.json"
    try:
        _watchdog = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), name, str(words)],
            env=env,
            stdin=subprocess.PIPE,  # the service watch's lines (its end is not inherited by children)
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError:  # no watchdog: the run itself still works, as before
        return None
    os.environ[name] = "1"
    os.environ[LAST_WORDS_VAR.format(pid=os.getpid())] = str(words)
    assert _watchdog.stdin is not None
    os.environ[SAY_FD_VAR.format(pid=os.getpid())] = str(_watchdog.stdin.fileno())
    return name


def configure_environment(state_dir: str | os.PathLike[str] | None = None) -> Path:
    state = Path(state_dir or STATE_DIR).resolve()
    check_state_dir(state)  # before anything is made in it or beside it
    state.mkdir(parents=True, exist_ok=True)
    defaults = {
        "PREFECT_HOME": str(state / "prefect"),
        "PREFECT_LOCAL_STORAGE_PATH": str(state / "prefect" / "results"),
        # No telemetry and no notice about it: DO_NOT_TRACK is the cross-tool opt-out that
        # Prefect's client reads ("1"; without it an interactive terminal gets Prefect's telemetry
        # notice), the server's analytics have their own switch, and MLflow reads DO_NOT_TRACK only
        # when it is "true", hence MLFLOW_DISABLE_TELEMETRY as well.
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
        # Stored results are read back on a cache hit; pickles would run whatever a crafted file holds.
        "PREFECT_RESULTS_DEFAULT_SERIALIZER": "json",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        # The server records task runs from the client's state events; one database write per event
        # (Prefect's default) cost ~50 ms of server CPU per task run on a 2-core machine, taken from
        # training. Batched (up to 100 events, at least every 2 s) it is ~8 ms; the UI shows a task
        # run at most 2 s late, and a server that stops flushes what it holds.
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "2",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # Ray's processes retitle themselves ("ray::DashboardAgent", "ray::IDLE"); by default its
        # setproctitle zeroes /proc/<pid>/environ to make room, and then the watchdog cannot find them.
        "SPT_NOENV": "1",
        "RAGEN_STATE_DIR": str(state),
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    start_watchdog()
    serve_ephemeral_server_in_own_session()
    return state


#: Prefect's module that starts the ephemeral server (``SubprocessASGIServer``).
_SERVER_MODULE = "prefect.server.api.server"


class _OwnSessionPopen(subprocess.Popen):  # type: ignore[type-arg]
    """``subprocess.Popen`` that starts its process in a session of its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("start_new_session", True)
        super().__init__(*args, **kwargs)


class _OwnSessionSubprocess(ModuleType):
    """Prefect's server module's view of ``subprocess``: the same, but its Popen starts a new session."""

    Popen = _OwnSessionPopen

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


def _patch_server_module(module: ModuleType) -> None:
    module.subprocess = _OwnSessionSubprocess("subprocess")  # type: ignore[attr-defined]


class _ServerModuleFinder(importlib.abc.MetaPathFinder):
    """Patches Prefect's server module as it is imported (importing it costs ~3 s, paid only where
    Prefect starts an ephemeral server anyway)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _SERVER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            _patch_server_module(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def serve_ephemeral_server_in_own_session() -> None:
    """Start Prefect's ephemeral server (when Prefect starts one) in a session of its own.

    In the terminal's foreground process group, Ctrl-C (or ``timeout``'s group SIGTERM) stopped the
    server first; the flow, unwinding, then spent minutes retrying its final state updates against
    it and ended on a connection error. Out of the group, the server outlives the flow's unwinding
    and Prefect's exit hook stops it; the watchdog stops it when this process is SIGKILLed.
    """
    if _SERVER_MODULE in sys.modules:
        _patch_server_module(sys.modules[_SERVER_MODULE])
    elif not any(isinstance(f, _ServerModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _ServerModuleFinder())


#: How much lower than training the ephemeral Prefect server runs (``nice`` increment, 0 to 19; 0
#: keeps it level). The server records task runs from the client's events after the fact (about 40
#: ms of CPU per task run on a 2-core machine); at equal priority that work takes cores from the
#: rollout and learner threads exactly when they need them, while nothing in the loop waits for it.
EPHEMERAL_SERVER_NICE = "RAGEN_PREFECT_SERVER_NICE"


def deprioritise_ephemeral_server() -> list[int]:
    """Lower the CPU priority of this process's ephemeral Prefect server (Linux; a server named by
    ``PREFECT_API_URL`` is not our child and is left alone). Returns the pids changed. Idempotent."""
    nice = nice_increment(EPHEMERAL_SERVER_NICE)
    if nice <= 0:
        return []
    return [pid for pid in ephemeral_server_pids() if lower_priority(pid, nice)]


def ephemeral_server_pids() -> list[int]:
    """The ephemeral Prefect servers this process started (its children serving Prefect's API; Linux)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    me, found = os.getpid(), []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) != me:
                continue
            if b"prefect.server.api.server:create_app" not in (d / "cmdline").read_bytes():
                continue
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        found.append(int(d.name))
    return found
