"""One real Prefect server per test process, for the CLI runs of the end-to-end tests.

Without ``PREFECT_API_URL`` every ``ragen`` command starts an ephemeral Prefect server and stops it
at exit: about 11 of the 40 seconds of a tiny training run on 2 cores, paid by some 50 runs of the
suite. The CLI tests therefore point their runs at this server (a real ``prefect server start`` on
loopback, started on first use, stopped when the test process exits, and killed with it by the
kernel when the process is killed). The tests about the ephemeral server itself (its listeners, what a
killed run leaves behind: ``tests/reliability``) keep using it, as a user's first run does.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.process_env import child_env

_url: str | None = None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGTERM this process when the test process dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def api_url(timeout: float = 180) -> str:
    """The API URL of this process's shared server (``http://127.0.0.1:PORT/api``), started if needed."""
    global _url
    if _url is not None:
        return _url
    home = Path(tempfile.mkdtemp(prefix="ragen-prefect-server-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(home / "server.log", "w")  # noqa: SIM115 - open for the server's lifetime
    prefect = str(Path(sys.executable).with_name("prefect"))
    proc = subprocess.Popen(
        # the API as a real server runs it (services on), without the UI
        [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"],
        env=child_env(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false"),
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=_die_with_parent,  # the child has started no threads before exec
    )

    def stop() -> None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        proc.kill()
        log.close()
        shutil.rmtree(home, ignore_errors=True)

    atexit.register(stop)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the shared Prefect server exited: {(home / 'server.log').read_text()[-2000:]}"
            )
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            if r.status == 200:
                _url = url
                return url
        time.sleep(0.5)
    raise RuntimeError(f"the shared Prefect server was not healthy after {timeout:.0f} s")


def shared_server_env() -> dict[str, str]:
    """What a CLI child needs to use the shared server (``RAGEN_TEST_EPHEMERAL_PREFECT=1``: none)."""
    if os.environ.get("RAGEN_TEST_EPHEMERAL_PREFECT") == "1":
        return {}
    return {"PREFECT_API_URL": api_url()}


def prefect_api(path: str, body: dict[str, Any] | None = None) -> Any:
    """POST ``body`` to (or GET) ``path`` of the shared server's REST API, where the CLI runs report."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"{api_url()}{path}",
        data=data,
        headers={"Content-Type": "application/json"},
        method="POST" if data else "GET",
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())
