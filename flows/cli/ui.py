"""``ragen ui``: the MLflow UI (on the local store) and a Prefect server on 127.0.0.1, supervised
together: each URL is printed once its server answers, and when one stops the other is stopped too."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from flows.cli.common import console, fail, prepare

if TYPE_CHECKING:
    from rich.console import Console

#: name -> (process, URL, health path) of each server.
Servers = dict[str, tuple[subprocess.Popen[bytes], str, str]]


def _port_in_use(port: int) -> bool:
    """Whether something listens on 127.0.0.1:``port`` (or on every interface), so a server cannot bind it."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as the servers do: TIME_WAIT is no obstacle
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _check_ports(mlflow_port: int, prefect_port: int) -> None:
    """Checked before anything starts: a server that cannot bind dies, and a URL printed for a port
    someone else holds would show that other server (another MLflow store, another Prefect)."""
    if mlflow_port == prefect_port:
        fail(f"--mlflow-port and --prefect-port are both {mlflow_port}; give them different ports")
    for port, what, option in (
        (mlflow_port, "MLflow UI", "--mlflow-port"),
        (prefect_port, "Prefect server", "--prefect-port"),
    ):
        if _port_in_use(port):
            fail(
                f"port {port} on 127.0.0.1 is already in use, so the {what} cannot start on it; stop what "
                f"listens there or pass another port: ragen ui {option} N"
            )


def server_log(state: Path, name: str) -> Path:
    """Where a server's own output goes (banners, access logs): ``<state>/logs/ui-<name>.log``, so the
    terminal shows the two URLs and what goes wrong, not every request."""
    return state / "logs" / f"ui-{name.split()[0].lower()}.log"


def _start_servers(uri: str, state: Path, mlflow_port: int, prefect_port: int) -> Servers:
    """Each server in a process group of its own: stopping it stops the workers it starts, and Ctrl-C
    reaches only this command, which then stops both in order. (A SIGKILLed `ragen ui` leaves them to
    the watchdog of flows.settings.)"""
    bin_dir = Path(sys.executable).parent
    logs = {name: server_log(state, name) for name in ("MLflow UI", "Prefect server")}
    for path in logs.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ}
    env.pop("PREFECT_API_URL", None)
    mlflow = [
        str(bin_dir / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(mlflow_port),
        "--workers",
        "1",
        "--backend-store-uri",
        uri,
        "--artifacts-destination",
        str(state / "mlartifacts"),
    ]
    prefect = [
        str(bin_dir / "prefect"),
        "server",
        "start",
        "--host",
        "127.0.0.1",
        "--port",
        str(prefect_port),
    ]
    # The Prefect UI asks the API at PREFECT_UI_API_URL, which Prefect derives from its settings, not
    # from --port: without these the UI of a server on another port calls 127.0.0.1:4200.
    prefect_env = {**env, "PREFECT_SERVER_API_PORT": str(prefect_port)}
    prefect_env.setdefault("PREFECT_UI_API_URL", f"http://127.0.0.1:{prefect_port}/api")

    def start(cmd: list[str], name: str, process_env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(logs[name], "ab") as out:  # the child keeps its own descriptor
            return subprocess.Popen(
                cmd, env=process_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    return {
        "MLflow UI": (start(mlflow, "MLflow UI", env), f"http://127.0.0.1:{mlflow_port}", "/health"),
        "Prefect server": (
            start(prefect, "Prefect server", prefect_env),
            f"http://127.0.0.1:{prefect_port}",
            "/api/health",
        ),
    }


def _tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def _watch(servers: Servers, waiting: set[str], out: Console) -> tuple[str, int]:
    """Print each URL once its server answers (``waiting``: those that have not yet); return the
    name and exit code of the first server that stops."""
    while True:
        for name, (proc, url, health) in servers.items():
            code = proc.poll()
            if code is not None:
                return name, code
            if name in waiting and _healthy(url + health):
                waiting.discard(name)
                out.print(f"{name + ':':16}{url}")
                if name == "Prefect server":
                    out.print(f"  (use PREFECT_API_URL={url}/api to send flow runs there)")
        time.sleep(0.5)


def _stop_servers(servers: Servers) -> None:
    """SIGTERM to each server's group, up to 10 s to exit, then SIGKILL to what is left of the group."""
    for proc, _, _ in servers.values():
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for proc, _, _ in servers.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        with contextlib.suppress(ProcessLookupError):  # the group: workers outliving their server
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # `kill` stops both servers as Ctrl-C does


def ui(
    mlflow_port: Annotated[
        int | None,
        typer.Option(min=1, max=65535, help="MLflow UI port [default: the last one used here, else 5000]."),
    ] = None,
    prefect_port: Annotated[
        int | None,
        typer.Option(
            min=1, max=65535, help="Prefect server port [default: the last one used here, else 4200]."
        ),
    ] = None,
) -> None:
    """Start the MLflow UI (on the local store) and a Prefect server on 127.0.0.1; Ctrl-C stops both.

    Each URL is printed once its server answers. If either server stops, the other is stopped too
    and the command exits non-zero, naming the one that stopped. The ports are remembered in the state
    folder (ui.json): the links runs write point there, and the next `ragen ui` uses them again.
    """
    from ragen_core.state_folder import remember_ui_ports, state_dir, ui_ports

    last = ui_ports(state_dir())
    mlflow_port = mlflow_port or last["mlflow"]
    prefect_port = prefect_port or last["prefect"]
    _check_ports(mlflow_port, prefect_port)
    state = prepare()
    remember_ui_ports({"mlflow": mlflow_port, "prefect": prefect_port}, state)
    from ragen_core.config.tracking import TrackingConfig, resolve_tracking_uri, sqlite_file
    from ragen_core.tracking.store import relocate_store, store_lock

    uri = resolve_tracking_uri(TrackingConfig(), state)
    db = sqlite_file(uri)
    if db is not None and db.is_file():  # a copied or moved state folder: show its own artifacts
        with store_lock(db):
            relocate_store(db)
    servers = _start_servers(uri, state, mlflow_port, prefect_port)
    out = console()
    out.print(f"starting the MLflow UI (store {uri}) and the Prefect server on 127.0.0.1 ...")
    out.print(f"(their own output: {server_log(state, 'MLflow UI')}, {server_log(state, 'Prefect server')})")
    waiting = set(servers)
    died: tuple[str, int] | None = None
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        died = _watch(servers, waiting, out)
    except KeyboardInterrupt:
        pass
    finally:
        _stop_servers(servers)
    if died is not None:
        name, code = died
        other = next(n for n in servers if n != name)
        log = server_log(state, name)
        tail = _tail(log)
        if tail:
            out.print(f"last lines of {log}:\n{tail}", markup=False, soft_wrap=True)
        fail(
            f"the {name} exited with code {code}{' before it answered' if name in waiting else ''} (its output: "
            f"{log}); stopped the {other} too"
        )
