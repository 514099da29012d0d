"""Faults of a remote environment, each one error that names the server and the fix, within a bound of
time: down at start (before any work), gone mid-episode (reconnect and replay, or fail), back with
another environment (replay differs), slow, malformed JSON, a huge observation, an unknown action
schema."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, WebSocket, WebSocketDisconnect

import envs
from envs.wire.client import (
    ActionSchemaError,
    NondeterministicServerError,
    ObservationTooLargeError,
    ProtocolError,
    RemoteEnv,
    ServerLostError,
    ServerTimeoutError,
    ServerUnreachableError,
)
from envs.wire.server import ServeLimits, ServerThread, create_app, running
from ragen_core.config import load_config
from ragen_core.env_groups import EnvGroups, EnvGroupsConfig, RemoteEnvConfig
from ragen_core.protocol import ProtocolConfig
from ragen_core.run.preflight import remote_env_problems

ROOT = Path(__file__).resolve().parents[2]
FIRST = "Guess."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_server_down_at_start_is_one_error_before_any_work() -> None:
    url = f"ws://127.0.0.1:{_free_port()}"
    cfg = load_config(
        ROOT / "configs/frozenlake-tiny.yaml",
        [f"train.remote={{FrozenLake: {{url: '{url}'}}}}"],
    )
    problems = remote_env_problems(cfg)
    assert len(problems) == 1, problems
    port = url.rsplit(":", 1)[1]
    assert problems[0].startswith("train.remote.FrozenLake: no OpenEnv server answers at http://127.0.0.1:")
    assert f"ragen env serve FrozenLake --port {port}" in problems[0]
    with pytest.raises(ServerUnreachableError, match="no OpenEnv server answers"):
        EnvGroups(cfg.train, cfg.agent)


def test_the_action_schema_and_the_settings_are_checked_before_any_work() -> None:
    with running(create_app("FrozenLake")) as server:
        cfg = load_config(
            ROOT / "configs/frozenlake-tiny.yaml",
            [f"train.remote={{FrozenLake: {{url: '{server.url}', action_field: command}}}}"],
        )
        (problem,) = remote_env_problems(cfg)
        assert "action schema has the fields ['message', 'metadata'], not 'command'" in problem
        cfg = load_config(
            ROOT / "configs/frozenlake-tiny.yaml", [f"val.remote={{FrozenLake: {{url: '{server.url}'}}}}"]
        )
        (problem,) = remote_env_problems(cfg)
        assert problem.startswith("val.remote.FrozenLake: ") and "--set is_slippery=false" in problem


def test_a_server_restarted_mid_episode_is_replayed_and_play_goes_on() -> None:
    port = _free_port()
    local = envs.make("FrozenLake")
    server = ServerThread(create_app("FrozenLake"), port=port).start()
    remote = RemoteEnv(server.url, retries=3)
    assert remote.reset(11) == local.reset(11)
    for move in ["Down", "Right", "Down"]:
        assert remote.step(move) == local.step(move)
    server.stop()
    server = ServerThread(create_app("FrozenLake"), port=port).start()
    try:
        # the new session is reset to seed 11 and given the three moves again, then this one
        assert remote.step("Right") == local.step("Right")
        assert remote.render() == local.render()
    finally:
        remote.close()
        server.stop()


def test_a_server_back_with_another_environment_is_refused_not_trusted() -> None:
    port = _free_port()
    server = ServerThread(create_app("FrozenLake"), port=port).start()
    remote = RemoteEnv(server.url, retries=2)
    remote.reset(11)
    remote.step("Down")
    server.stop()
    server = ServerThread(create_app("FrozenLake", {"size": 6}), port=port).start()
    try:
        with pytest.raises(NondeterministicServerError, match="not deterministic"):
            remote.step("Right")
    finally:
        server.stop()


def test_a_server_gone_mid_episode_fails_after_bounded_retries() -> None:
    server = ServerThread(create_app("FrozenLake")).start()
    remote = RemoteEnv(server.url, retries=2)
    remote.reset(5)
    remote.step("Down")
    url = server.url
    server.stop()
    t0 = time.monotonic()
    with pytest.raises(ServerLostError) as lost:
        remote.step("Right")
    took = time.monotonic() - t0
    assert took < 5, f"two retries took {took:.1f} s"
    text = str(lost.value)
    assert url in text and "seed 5" in text and "2 reconnects failed" in text
    assert "is the server still running" in text


def test_a_rollout_whose_server_dies_fails_with_that_error() -> None:
    """The error reaches the rollout's caller (so the stage fails and writes nothing)."""
    server = ServerThread(create_app("FrozenLake")).start()
    cfg = EnvGroupsConfig(
        tags=["FrozenLake"],
        n_groups=[2],
        group_size=2,
        remote={"FrozenLake": RemoteEnvConfig(url=server.url, retries=1)},
    )
    groups = EnvGroups(cfg, ProtocolConfig(enable_think=False))
    groups.reset(0)
    server.stop()
    with pytest.raises(ServerLostError):
        groups.step({i: "<answer>Down</answer>" for i in groups.env_ids})


# a scripted OpenEnv server for the faults a good one never makes ------------------------------------
def scripted(on_step: Callable[[WebSocket], Any], action_fields: tuple[str, ...] = ("message",)) -> FastAPI:
    """An OpenEnv server whose reset is fine and whose step answer is ``on_step``'s doing."""
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "healthy"}

    @app.get("/schema")
    def schema() -> dict[str, Any]:
        props = {f: {"type": "string"} for f in action_fields}
        return {"action": {"properties": props}, "observation": {}, "state": {}}

    @app.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            while True:
                message = json.loads(await websocket.receive_text())
                if message["type"] == "reset":
                    data = {"observation": {"text": FIRST}, "reward": None, "done": False}
                    await websocket.send_text(json.dumps({"type": "observation", "data": data}))
                else:
                    await on_step(websocket)
        except WebSocketDisconnect:
            pass

    return app


@pytest.fixture
def serve_scripted() -> Iterator[Callable[..., ServerThread]]:
    servers: list[ServerThread] = []

    def start(on_step: Callable[[WebSocket], Any], **kw: Any) -> ServerThread:
        servers.append(
            ServerThread(scripted(on_step, **kw), limits=ServeLimits(max_message_bytes=8 << 20)).start()
        )
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def test_a_slow_server_times_out_as_the_config_says(serve_scripted: Callable[..., ServerThread]) -> None:
    async def slow(ws: WebSocket) -> None:
        await asyncio.sleep(3)

    server = serve_scripted(slow)
    remote = RemoteEnv(server.url, timeout_s=0.3, retries=1)
    assert remote.reset(0) == FIRST
    t0 = time.monotonic()
    with pytest.raises(ServerTimeoutError) as slow_error:
        remote.step("x")
    took = time.monotonic() - t0
    # two tries of 0.3 s and one pause of 0.2 s, with the replays' resets
    assert took < 2.0, f"timed out after {took:.1f} s"
    assert "timeout_s=0.3" in str(slow_error.value) and server.url in str(slow_error.value)


def test_malformed_json_is_a_protocol_error(serve_scripted: Callable[..., ServerThread]) -> None:
    async def garbled(ws: WebSocket) -> None:
        await ws.send_text('{"type": "observation", "data": {"observ')

    remote = RemoteEnv(serve_scripted(garbled).url)
    remote.reset(0)
    with pytest.raises(ProtocolError, match="malformed JSON"):
        remote.step("x")


def test_an_answer_that_is_no_openenv_message_is_a_protocol_error(
    serve_scripted: Callable[..., ServerThread],
) -> None:
    async def odd(ws: WebSocket) -> None:
        await ws.send_text(json.dumps({"type": "observation", "data": {"observation": {"txt": "?"}}}))

    remote = RemoteEnv(serve_scripted(odd).url)
    remote.reset(0)
    with pytest.raises(ProtocolError, match=r"no text field 'text' \(fields: \['txt'\]\)"):
        remote.step("x")


def test_a_huge_observation_is_refused_within_the_bound(serve_scripted: Callable[..., ServerThread]) -> None:
    async def huge(ws: WebSocket) -> None:
        data = {"observation": {"text": "x" * (5 << 20)}, "reward": 0.0, "done": False}
        await ws.send_text(json.dumps({"type": "observation", "data": data}))

    remote = RemoteEnv(serve_scripted(huge).url, max_observation_bytes=1 << 20)
    remote.reset(0)
    with pytest.raises(ObservationTooLargeError, match="max_observation_bytes=1048576"):
        remote.step("x")
    # our own server refuses to send one instead (the message names its flag)
    limits = ServeLimits(max_observation_bytes=300)
    with (
        running(create_app("FrozenLake", {"size": 8}, limits), limits) as ours,
        pytest.raises(ObservationTooLargeError, match="--max-observation-bytes"),
    ):
        RemoteEnv(ours.url).reset(0)


def test_an_unknown_action_schema_is_named(serve_scripted: Callable[..., ServerThread]) -> None:
    async def never(ws: WebSocket) -> None:
        raise AssertionError("no step should be sent")

    server = serve_scripted(never, action_fields=("command", "target"))
    with pytest.raises(ActionSchemaError) as unknown:
        RemoteEnv(server.url)
    assert "['command', 'target'], not 'message'" in str(unknown.value) and "action_field" in str(
        unknown.value
    )
    # a server that takes the field but refuses the action at step time (our own, with a wrong field)
    with running(create_app("FrozenLake")) as ours:
        remote = RemoteEnv(ours.url)
        remote.action_field = "command"
        remote.reset(0)
        with pytest.raises(ActionSchemaError, match="refused our action"):
            remote.step("Down")
