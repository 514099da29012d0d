"""Interoperability with openenv-core itself (its own venv, ``make openenv``: its dependencies, gradio,
fastmcp and openai among them, stay out of the training venv): our server driven by its client, and our
client playing an environment its server serves."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import envs
from envs.wire.client import RemoteEnv
from envs.wire.server import ServerThread, create_app, running
from ragen_core.env_groups import EnvGroups, EnvGroupsConfig, RemoteEnvConfig
from ragen_core.protocol import ProtocolConfig

ROOT = Path(__file__).resolve().parents[2]
SIDE = Path(__file__).with_name("openenv_side")
#: the fast tier (`make test-fast`) leaves these out; `make test` builds the venv and requires them
pytestmark = pytest.mark.openenv

DEFAULT_VENV = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ragen-flow/openenv-core-0.3.0"
)


def openenv_python() -> Path:
    """openenv-core's interpreter: ``$RAGEN_OPENENV_PYTHON``, else the ``make openenv`` venv's."""
    return Path(os.environ.get("RAGEN_OPENENV_PYTHON") or DEFAULT_VENV / "bin/python")


@pytest.fixture(scope="module")
def openenv() -> Path:
    python = openenv_python()
    if python.exists():
        probe = subprocess.run(
            [str(python), "-c", "import openenv.core"], capture_output=True, text=True, timeout=120
        )
        if probe.returncode == 0:
            return python
    msg = f"no openenv-core at {python} (build its venv with `make openenv`, or set RAGEN_OPENENV_PYTHON)"
    if os.environ.get("RAGEN_REQUIRE_OPENENV") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def lake() -> Iterator[ServerThread]:
    with running(create_app("FrozenLake")) as server:
        yield server


def test_openenv_core_client_plays_our_server(openenv: Path, lake: ServerThread) -> None:
    moves = ["Down", "Right", "Jump", "Right", "Down", "Down", "Right"]
    out = subprocess.run(
        [str(openenv), str(SIDE / "play_with_openenv_client.py"), lake.http_url, "17", *moves],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    local = envs.make("FrozenLake")
    first = lines[0]
    assert first["observation"]["text"] == local.reset(17)
    assert first["observation"]["legal_actions"] == local.actions
    assert (first["reward"], first["done"]) == (None, False)
    played = 0
    for move, seen in zip(moves, lines[1:-1], strict=True):
        want = local.step(move)
        assert seen["observation"]["text"] == want.observation
        assert seen["observation"]["info"] == want.info
        assert (seen["reward"], seen["done"]) == (want.reward, want.done)
        played += 1
    assert lines[-1]["state"]["step_count"] == played == len(moves)
    assert lines[-1]["state"]["seed"] == 17


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def guess_server(openenv: Path) -> Iterator[str]:
    """The guessing game of openenv_side/serve_with_openenv_server.py on openenv-core's own server."""
    port = _free_port()
    proc = subprocess.Popen(
        [str(openenv), str(SIDE / "serve_with_openenv_server.py"), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).close()
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "openenv-core's server did not answer in 120 s"
                time.sleep(0.2)
        yield f"ws://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_our_client_plays_an_environment_served_by_openenv_core(guess_server: str) -> None:
    env = RemoteEnv(guess_server, tag="Guess")
    try:
        assert env.server.spec is None and env.spec.env_type == "openenv"  # not our server: no spec
        assert env.reset(4) == "Guess a number from 0 to 9."
        assert env.actions is None  # free text: the server lists no actions
        lo, hi, found = 0, 9, None
        for _ in range(5):  # bisection finds any 0..9 in at most 4 guesses
            mid = (lo + hi) // 2
            result = env.step(str(mid))
            if result.done:
                found = result
                break
            if result.observation.endswith("higher."):
                lo = mid + 1
            else:
                hi = mid - 1
        assert found is not None and found.reward == 1.0 and found.info["success"] is True
        assert env.render() == "Right!"
        # a seed replays the same target (the server's environment draws it from the seed)
        env.reset(4)
        assert env.step(str(mid)).done
        bad = env.step("many")
        assert (bad.reward, bad.done, bad.info["success"]) == (0.0, False, False)
    finally:
        env.close()


def test_env_groups_play_a_tag_only_the_openenv_server_knows(guess_server: str) -> None:
    cfg = EnvGroupsConfig(
        tags=["Guess"], n_groups=[3], group_size=2, remote={"Guess": RemoteEnvConfig(url=guess_server)}
    )
    groups = EnvGroups(cfg, ProtocolConfig(max_turn=3, enable_think=False), mode="val")
    try:
        groups.reset()
        out = groups.step({i: "<answer>5</answer>" for i in groups.env_ids})
        assert {o.actions[0] for o in out.values()} == {"5"}
        # members of a group share the seed, so their answers match
        texts = [groups.history(i)[-1].state for i in groups.env_ids]
        assert texts[0] == texts[1] and texts[2] == texts[3] and texts[4] == texts[5]
    finally:
        for i in groups.env_ids:
            groups.env(i).close()
