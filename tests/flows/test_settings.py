"""The process environment of the flows: the ephemeral Prefect server runs below training's priority."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from flows.settings import EPHEMERAL_SERVER_NICE, deprioritise_ephemeral_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")

SLEEP = "import time; time.sleep(60)"


@pytest.fixture
def children() -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """A child whose command line is the ephemeral server's (Prefect starts it as
    ``python -m uvicorn ... prefect.server.api.server:create_app``) and an unrelated child."""
    server = subprocess.Popen(
        [sys.executable, "-c", SLEEP, "--factory", "prefect.server.api.server:create_app"]
    )
    other = subprocess.Popen([sys.executable, "-c", SLEEP, "uvicorn"])
    yield server, other
    for p in (server, other):
        p.kill()
        p.wait()


def test_the_ephemeral_server_child_gets_a_lower_priority_and_nothing_else_does(
    children: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, other = children
    monkeypatch.delenv(EPHEMERAL_SERVER_NICE, raising=False)
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert deprioritise_ephemeral_server() == [server.pid]
    assert os.getpriority(os.PRIO_PROCESS, server.pid) == min(mine + 10, 19)
    assert os.getpriority(os.PRIO_PROCESS, other.pid) == mine
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine, "this process keeps its own priority"
    assert deprioritise_ephemeral_server() == [server.pid], "a second call changes nothing more"
    assert os.getpriority(os.PRIO_PROCESS, server.pid) == min(mine + 10, 19)


def test_the_priority_change_can_be_turned_off_and_a_bad_value_is_named(
    children: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = children
    monkeypatch.setenv(EPHEMERAL_SERVER_NICE, "0")
    assert deprioritise_ephemeral_server() == []
    assert os.getpriority(os.PRIO_PROCESS, server.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    monkeypatch.setenv(EPHEMERAL_SERVER_NICE, "ten")
    with pytest.raises(ValueError, match=f"{EPHEMERAL_SERVER_NICE}='ten'.*0 \\(off\\) to 19"):
        deprioritise_ephemeral_server()
