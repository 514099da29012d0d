"""``ragen env serve``'s server: the OpenEnv protocol over a real loopback server, its sessions' isolation,
its limits, its answers to bad input and its token."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

import envs
from envs.wire.server import ServeLimits, ServerThread, create_app, running

ROOT = Path(__file__).resolve().parents[2]
NO_SLIP = {"is_slippery": False}


@pytest.fixture(scope="module")
def lake() -> Iterator[ServerThread]:
    with running(create_app("FrozenLake")) as server:
        yield server


def ask(ws: ClientConnection, message: dict[str, Any] | str) -> dict[str, Any]:
    ws.send(message if isinstance(message, str) else json.dumps(message))
    reply = json.loads(ws.recv(timeout=10))
    assert isinstance(reply, dict)
    return reply


def get(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
        return dict(json.loads(r.read()))


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return dict(json.loads(r.read()))


def test_a_session_plays_what_the_local_environment_plays(lake: ServerThread) -> None:
    local = envs.make("FrozenLake")
    moves = ["Down", "Right", "Right", "Up", "Left", "Down", "Jump", "Down"]
    with connect(lake.url + "/ws") as ws:
        for seed in (0, 7, 12345):
            reply = ask(ws, {"type": "reset", "data": {"seed": seed}})
            assert reply["type"] == "observation"
            obs = reply["data"]["observation"]
            assert obs["text"] == local.reset(seed) == obs["rendered"]
            assert obs["legal_actions"] == local.actions
            assert obs["grid_vocab"] == local.grid_vocab
            for move in moves:
                data = ask(ws, {"type": "step", "data": {"message": move}})["data"]
                want = local.step(move)
                assert (data["observation"]["text"], data["reward"], data["done"]) == (
                    want.observation,
                    want.reward,
                    want.done,
                )
                assert data["observation"]["info"] == want.info
                assert data["observation"]["rendered"] == local.render()
        state = ask(ws, {"type": "state"})
        assert state == {
            "type": "state",
            "data": {
                "episode_id": state["data"]["episode_id"],
                "step_count": len(moves),
                "seed": 12345,
                "tag": "FrozenLake",
            },
        }


def test_concurrent_sessions_are_isolated(lake: ServerThread) -> None:
    """Two sessions interleaved: each sees only its own episode (its own env instance)."""
    a_local, b_local = envs.make("FrozenLake"), envs.make("FrozenLake")
    with connect(lake.url + "/ws") as a, connect(lake.url + "/ws") as b:
        assert ask(a, {"type": "reset", "data": {"seed": 1}})["data"]["observation"]["text"] == a_local.reset(
            1
        )
        assert ask(b, {"type": "reset", "data": {"seed": 2}})["data"]["observation"]["text"] == b_local.reset(
            2
        )
        for move in ["Down", "Right", "Up", "Left"] * 2:
            assert ask(a, {"type": "step", "data": {"message": move}})["data"]["observation"]["text"] == (
                a_local.step(move).observation
            )
            other = "Right" if move != "Right" else "Down"
            assert ask(b, {"type": "step", "data": {"message": other}})["data"]["observation"]["text"] == (
                b_local.step(other).observation
            )


def test_bad_messages_are_answered_with_openenv_error_codes_and_the_session_lives(lake: ServerThread) -> None:
    with connect(lake.url + "/ws") as ws:
        assert ask(ws, {"type": "step", "data": {"message": "Up"}})["data"]["code"] == "EXECUTION_ERROR"
        assert ask(ws, "{not json")["data"]["code"] == "INVALID_JSON"
        assert ask(ws, {"type": "teleport"})["data"]["code"] == "UNKNOWN_TYPE"
        ask(ws, {"type": "reset", "data": {"seed": 3}})
        wrong = ask(ws, {"type": "step", "data": {"action_id": 2}})["data"]
        assert wrong["code"] == "VALIDATION_ERROR" and '"message"' in wrong["message"], wrong
        extra = ask(ws, {"type": "step", "data": {"message": "Up", "force": 9}})["data"]
        assert extra["code"] == "VALIDATION_ERROR" and "force" in extra["message"]
        assert ask(ws, {"type": "reset", "data": {"seed": -1}})["data"]["code"] == "VALIDATION_ERROR"
        assert ask(ws, {"type": "step", "data": {"message": "Up"}})["type"] == "observation"


def test_http_routes_answer_as_openenv_core_does(lake: ServerThread) -> None:
    assert get(lake.http_url + "/health") == {"status": "healthy"}
    schema = get(lake.http_url + "/schema")
    assert set(schema) == {"action", "observation", "state"}
    assert schema["action"]["required"] == ["message"]
    assert get(lake.http_url + "/metadata")["name"] == "FrozenLake"
    spec = get(lake.http_url + "/ragen/spec")
    assert (spec["tag"], spec["env_type"], spec["max_actions_per_traj"]) == ("FrozenLake", "frozen_lake", 10)
    local = envs.make("FrozenLake")
    assert post(lake.http_url + "/reset", {"seed": 4})["observation"]["text"] == local.reset(4)
    # a session-less step: a fresh environment, reset from the request's seed, then the action
    stepped = post(lake.http_url + "/step", {"action": {"message": "Down"}, "seed": 4})
    assert stepped["observation"]["text"] == local.step("Down").observation
    with pytest.raises(urllib.error.HTTPError) as bad:
        post(lake.http_url + "/step", {"action": {"command": "Down"}})
    assert bad.value.code == 422


def test_each_session_limit_is_enforced() -> None:
    limits = ServeLimits(
        max_sessions=1,
        max_episode_steps=3,
        max_observation_bytes=900,
        max_message_bytes=200,
        idle_timeout_s=0.5,
    )
    with (
        running(create_app("FrozenLake", NO_SLIP, limits), limits) as server,
        connect(server.url + "/ws") as ws,
    ):
        ask(ws, {"type": "reset", "data": {"seed": 0}})
        for _ in range(3):
            assert ask(ws, {"type": "step", "data": {"message": "Left"}})["type"] == "observation"
        assert ask(ws, {"type": "step", "data": {"message": "Left"}})["data"]["code"] == "STEP_LIMIT"
        big = ask(ws, {"type": "step", "data": {"message": "x" * 300}})["data"]
        assert big["code"] == "MESSAGE_TOO_LARGE"
        with connect(server.url + "/ws") as second:  # over max_sessions
            assert json.loads(second.recv(timeout=10))["data"]["code"] == "CAPACITY_REACHED"
        # idle: the server says why and closes the session
        time.sleep(0.8)
        assert json.loads(ws.recv(timeout=10))["data"]["code"] == "IDLE_TIMEOUT"
    # an 8x8 map's first observation (grid, actions, legend) is over 300 bytes: refused, never sent
    tight = ServeLimits(max_observation_bytes=300)
    with (
        running(create_app("FrozenLake", {"size": 8}, tight), tight) as server,
        connect(server.url + "/ws") as ws,
    ):
        reply = ask(ws, {"type": "reset", "data": {"seed": 0}})["data"]
        assert reply["code"] == "OBSERVATION_TOO_LARGE", reply
        assert "300" in reply["message"]
        # the cut episode cannot be stepped; a new reset is the way on
        assert ask(ws, {"type": "step", "data": {"message": "Up"}})["data"]["code"] == "EXECUTION_ERROR"


def test_off_loopback_needs_a_token_and_a_token_is_checked() -> None:
    from envs.wire.server import check_bind

    with pytest.raises(ValueError, match="token"):
        check_bind("0.0.0.0", None)
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    with running(create_app("FrozenLake", token="s3cret")) as server:
        assert get(server.http_url + "/health") == {"status": "healthy"}  # probes need no token
        with pytest.raises(urllib.error.HTTPError) as denied:
            get(server.http_url + "/schema")
        assert denied.value.code == 401
        assert "action" in get(server.http_url + "/schema", {"Authorization": "Bearer s3cret"})
        with pytest.raises(InvalidStatus):
            connect(server.url + "/ws", additional_headers={"Authorization": "Bearer wrong"})
        with connect(server.url + "/ws", additional_headers={"Authorization": "Bearer s3cret"}) as ws:
            assert ask(ws, {"type": "reset", "data": {"seed": 1}})["type"] == "observation"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ragen_env_serve_serves_the_tag_with_its_settings() -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "flows.cli", "env", "serve", "FrozenLake", "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--set", "size=6"], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                spec = get(f"http://127.0.0.1:{port}/ragen/spec")
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "ragen env serve did not answer in 60 s"
                time.sleep(0.2)
        assert spec["env_config"]["size"] == 6
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    refused = subprocess.run(
        [*cmd, "--host", "0.0.0.0"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 1
    assert "token" in refused.stderr and "127.0.0.1" in refused.stderr
