"""Serve a registered environment tag as an OpenEnv server (``ragen env serve TAG``).

One WebSocket connection on ``/ws`` is one session with an environment instance of its own, so
concurrent sessions share nothing. Every session is bounded (:class:`ServeLimits`): the number of
sessions, the steps of an episode, the size of an observation and of an incoming message, and the
time a session may sit idle. The HTTP routes are openenv-core's: ``/health``, ``/schema``,
``/metadata``, ``/state`` and the session-less ``POST /reset`` and ``POST /step`` (a fresh environment
per request), plus ``/ragen/spec``, the tag's catalogue entry, which our client reads to build the
prompt and to check that the server plays the settings its config expects.

The server listens on the loopback interface unless told otherwise; any other address needs a token,
which every route but ``/health`` then asks for (``Authorization: Bearer <token>``).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import secrets
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import uvicorn
from fastapi import Body, Depends, FastAPI, HTTPException, Request, WebSocket, WebSocketDisconnect
from starlette.concurrency import run_in_threadpool

import envs
from envs.base import Env, StepResult
from envs.registry import EnvSpec
from envs.wire import messages as m

__all__ = ["ServeLimits", "ServerThread", "create_app", "is_loopback", "serve"]


@dataclass(frozen=True)
class ServeLimits:
    """What one server and each of its sessions may use."""

    #: concurrent WebSocket sessions (a rollout opens one per environment instance: P x N)
    max_sessions: int = 1024
    #: steps of one episode; a reset starts the count again
    max_episode_steps: int = 10_000
    #: bytes of one observation message; a larger one is an error, never sent
    max_observation_bytes: int = 1_000_000
    #: bytes of one incoming message (an action is a short text)
    max_message_bytes: int = 65_536
    #: seconds a session may wait for its next message before the server closes it
    idle_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_episode_steps", "max_observation_bytes", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeLimits.{name} must be >= 1, got {getattr(self, name)}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"ServeLimits.idle_timeout_s must be > 0, got {self.idle_timeout_s}")


class _ActionSchemaError(ValueError):
    pass


@dataclass
class _Session:
    env: Env
    seed: int | None = None
    episode_id: str | None = None
    step_count: int = 0
    #: an episode was cut (step limit, oversized observation): only a reset goes on
    broken: str | None = None
    created_at: float = field(default_factory=time.time)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost`` included)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _action_text(data: Any) -> str:
    """The primitive action of a step's ``data`` (``{"message": str}``, ``metadata`` allowed)."""
    if not isinstance(data, dict) or not isinstance(data.get(m.ACTION_FIELD), str):
        fields = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise _ActionSchemaError(
            f'this environment\'s action is {{"{m.ACTION_FIELD}": "<action text>"}} (see GET /schema); '
            f"got {fields}"
        )
    extra = set(data) - {m.ACTION_FIELD, "metadata"}
    if extra:
        raise _ActionSchemaError(
            f"unknown action fields {sorted(extra)}; the action is {{{m.ACTION_FIELD!r}}}"
        )
    return str(data[m.ACTION_FIELD])


def _observation(
    env: Env, text: str, reward: float | None, done: bool, info: Mapping[str, Any]
) -> dict[str, Any]:
    return {
        "observation": {
            m.OBSERVATION_FIELD: text,
            "rendered": env.render(),
            "legal_actions": list(env.actions) if env.actions is not None else None,
            "grid_vocab": dict(env.grid_vocab) if env.grid_vocab else None,
            "info": m.json_safe(dict(info)),
        },
        "reward": m.json_safe(reward),
        "done": bool(done),
    }


def _reset(env: Env, seed: int) -> dict[str, Any]:
    return _observation(env, env.reset(seed), None, False, {})


def _step(env: Env, action: str) -> dict[str, Any]:
    result: StepResult = env.step(action)
    return _observation(env, result.observation, float(result.reward), result.done, result.info)


def _seed_of(data: Any) -> int:
    """The reset's seed (``None`` or missing: a random one, as a seedless OpenEnv reset asks for)."""
    seed = data.get("seed") if isinstance(data, dict) else None
    if seed is None:
        return secrets.randbelow(2**31)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise _ActionSchemaError(f"reset's seed must be a non-negative integer, got {seed!r}")
    return seed


def _schemas() -> dict[str, Any]:
    action = {
        "title": "RagenAction",
        "type": "object",
        "properties": {
            m.ACTION_FIELD: {"type": "string", "description": "one primitive action, as text"},
            "metadata": {"type": "object"},
        },
        "required": [m.ACTION_FIELD],
        "additionalProperties": False,
    }
    observation = {
        "title": "RagenObservation",
        "type": "object",
        "properties": {
            m.OBSERVATION_FIELD: {"type": "string", "description": "what the action returned"},
            "rendered": {"type": "string", "description": "the state as text after the action"},
            "legal_actions": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
            "grid_vocab": {"anyOf": [{"type": "object"}, {"type": "null"}]},
            "info": {"type": "object"},
            "done": {"type": "boolean"},
            "reward": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        },
    }
    state = {
        "title": "RagenState",
        "type": "object",
        "properties": {
            "episode_id": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "step_count": {"type": "integer"},
            "seed": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "tag": {"type": "string"},
        },
    }
    return {"action": action, "observation": observation, "state": state}


class _App:
    """The routes of one served tag (a class so that the sessions' count has one owner)."""

    def __init__(
        self, tag: str, overrides: Mapping[str, Any], limits: ServeLimits, token: str | None
    ) -> None:
        self.tag, self.overrides, self.limits, self.token = tag, dict(overrides), limits, token
        probe = envs.make(tag, **self.overrides)  # an unknown tag or bad setting fails here, not per session
        self.spec: EnvSpec = probe.spec  # type: ignore[attr-defined]
        probe.close()
        self.sessions = 0

    def make(self) -> Env:
        return envs.make(self.tag, **self.overrides)

    def authorized(self, header: str | None) -> bool:
        if self.token is None:
            return True
        expected = f"Bearer {self.token}"
        return header is not None and hmac.compare_digest(header.encode(), expected.encode())

    def check_http(self, request: Request) -> None:
        if not self.authorized(request.headers.get("authorization")):
            raise HTTPException(status_code=401, detail="missing or wrong 'Authorization: Bearer <token>'")

    def spec_data(self) -> dict[str, Any]:
        return {**asdict(self.spec), "protocol": "openenv", "ragen_wire": 1}

    # the WebSocket session ---------------------------------------------------------------------
    async def session(self, ws: WebSocket) -> None:
        if not self.authorized(ws.headers.get("authorization")):
            await ws.close(code=1008, reason="missing or wrong 'Authorization: Bearer <token>'")
            return
        await ws.accept()
        if self.sessions >= self.limits.max_sessions:
            await self._send(
                ws,
                m.error(
                    f"the server holds {self.sessions} sessions, its limit (--max-sessions)",
                    m.CAPACITY_REACHED,
                ),
            )
            await ws.close()
            return
        self.sessions += 1
        session: _Session | None = None
        try:
            session = _Session(env=await run_in_threadpool(self.make))
            await self._serve(ws, session)
        except WebSocketDisconnect:
            pass
        finally:
            self.sessions -= 1
            if session is not None:
                session.env.close()

    async def _serve(self, ws: WebSocket, session: _Session) -> None:
        while True:
            try:
                raw = await asyncio.wait_for(ws.receive_text(), timeout=self.limits.idle_timeout_s)
            except TimeoutError:
                idle = f"session idle for {self.limits.idle_timeout_s:g} s (--idle-timeout); closed"
                await self._send(ws, m.error(idle, m.IDLE_TIMEOUT))
                await ws.close(code=1000, reason="idle timeout")
                return
            if len(raw.encode()) > self.limits.max_message_bytes:
                big = f"message of {len(raw.encode())} bytes is over the limit of {self.limits.max_message_bytes}"
                await self._send(ws, m.error(big, m.MESSAGE_TOO_LARGE))
                continue
            try:
                message = json.loads(raw)
            except json.JSONDecodeError as exc:
                await self._send(ws, m.error(f"Invalid JSON: {exc}", m.INVALID_JSON))
                continue
            kind = message.get("type", "") if isinstance(message, dict) else ""
            if kind == "close":
                return
            await self._send(ws, await self._answer(session, kind, message))

    async def _answer(self, session: _Session, kind: str, message: dict[str, Any]) -> dict[str, Any]:
        try:
            if kind == "reset":
                seed = _seed_of(message.get("data") or {})
                data = await run_in_threadpool(_reset, session.env, seed)
                session.seed, session.step_count, session.broken = seed, 0, None
                episode = (message.get("data") or {}).get("episode_id")
                session.episode_id = str(episode) if episode is not None else uuid.uuid4().hex
            elif kind == "step":
                if session.seed is None or session.broken:
                    why = session.broken or "no episode yet"
                    return m.error(f"step without an episode ({why}): send a reset first", m.EXECUTION_ERROR)
                if session.step_count >= self.limits.max_episode_steps:
                    session.broken = f"the episode reached {self.limits.max_episode_steps} steps"
                    return m.error(f"{session.broken} (--max-steps); reset to go on", m.STEP_LIMIT)
                action = _action_text(message.get("data"))
                data = await run_in_threadpool(_step, session.env, action)
                session.step_count += 1
            elif kind == "state":
                state = {"episode_id": session.episode_id, "step_count": session.step_count}
                return {"type": "state", "data": {**state, "seed": session.seed, "tag": self.tag}}
            else:
                return m.error(f"Unknown message type: {kind}", m.UNKNOWN_TYPE)
        except _ActionSchemaError as exc:
            return m.error(str(exc), m.VALIDATION_ERROR)
        except Exception as exc:  # the environment's own error goes back to the client, the session lives
            return m.error(f"{type(exc).__name__}: {exc}", m.EXECUTION_ERROR)
        reply = {"type": "observation", "data": data}
        size = len(m.dumps(reply).encode())
        if size > self.limits.max_observation_bytes:
            session.broken = (
                f"an observation of {size} bytes was over the limit of {self.limits.max_observation_bytes}"
            )
            return m.error(f"{session.broken} (--max-observation-bytes); not sent", m.OBSERVATION_TOO_LARGE)
        return reply

    @staticmethod
    async def _send(ws: WebSocket, message: dict[str, Any]) -> None:
        await ws.send_text(m.dumps(message))

    # the session-less HTTP routes --------------------------------------------------------------
    def http_reset(self, body: dict[str, Any]) -> dict[str, Any]:
        env = self.make()
        try:
            return _reset(env, _seed_of(body))
        finally:
            env.close()

    def http_step(self, body: dict[str, Any]) -> dict[str, Any]:
        """openenv-core steps a fresh environment; ours need a reset first, from the request's ``seed``."""
        env = self.make()
        try:
            action = _action_text(body.get("action"))
            env.reset(_seed_of(body))
            return _step(env, action)
        finally:
            env.close()


def create_app(
    tag: str,
    overrides: Mapping[str, Any] | None = None,
    limits: ServeLimits | None = None,
    token: str | None = None,
) -> FastAPI:
    """The FastAPI app serving ``envs.make(tag, **overrides)``."""
    state = _App(tag, overrides or {}, limits or ServeLimits(), token)
    app = FastAPI(title=f"ragen-flow {tag}", docs_url=None, redoc_url=None)
    auth = [Depends(state.check_http)]

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "healthy"}

    @app.get("/schema", dependencies=auth)
    def schema() -> dict[str, Any]:
        return _schemas()

    @app.get("/metadata", dependencies=auth)
    def metadata() -> dict[str, Any]:
        return {"name": tag, "description": state.spec.env_instruction or tag, "version": None}

    @app.get("/ragen/spec", dependencies=auth)
    def ragen_spec() -> dict[str, Any]:
        return state.spec_data()

    @app.get("/state", dependencies=auth)
    def http_state() -> dict[str, Any]:
        return {"episode_id": None, "step_count": 0, "seed": None, "tag": tag}

    @app.post("/reset", dependencies=auth)
    async def http_reset(body: dict[str, Any] = Body(default_factory=dict)) -> dict[str, Any]:  # noqa: B008
        try:
            return await run_in_threadpool(state.http_reset, body)
        except _ActionSchemaError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from exc

    @app.post("/step", dependencies=auth)
    async def http_step(body: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
        try:
            return await run_in_threadpool(state.http_step, body)
        except _ActionSchemaError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from exc

    @app.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        await state.session(websocket)

    app.state.ragen = state
    return app


def _config(app: FastAPI, host: str, port: int, limits: ServeLimits) -> uvicorn.Config:
    # the incoming message bound is enforced by uvicorn's WebSocket layer too (it drops bigger frames)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        ws_max_size=max(limits.max_message_bytes, 1 << 16),
        lifespan="off",
    )


def check_bind(host: str, token: str | None) -> None:
    """A server on another interface than loopback needs a token (anyone who reaches it can play)."""
    if not is_loopback(host) and not token:
        raise ValueError(
            f"serving on {host} reaches beyond this machine: give a token (--token-env NAME, the token in "
            "that environment variable) or serve on 127.0.0.1"
        )


def serve(
    tag: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    overrides: Mapping[str, Any] | None = None,
    limits: ServeLimits | None = None,
    token: str | None = None,
) -> None:
    """Serve ``tag`` until interrupted."""
    check_bind(host, token)
    limits = limits or ServeLimits()
    uvicorn.Server(_config(create_app(tag, overrides, limits, token), host, port, limits)).run()


class ServerThread:
    """A server in a thread of this process, on a free port (tests and benchmarks)."""

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, limits: ServeLimits | None = None
    ):
        self.server = uvicorn.Server(_config(app, host, port, limits or ServeLimits()))
        self.host = host
        self._thread = threading.Thread(target=self.server.run, name="ragen-env-server", daemon=True)

    @property
    def port(self) -> int:
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"ws://{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the environment server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)


@contextmanager
def running(app: FastAPI, limits: ServeLimits | None = None) -> Iterator[ServerThread]:
    """``app`` served on a free loopback port for the ``with`` block."""
    server = ServerThread(app, limits=limits).start()
    try:
        yield server
    finally:
        server.stop()
