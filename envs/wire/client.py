"""An environment played over the wire: :class:`RemoteEnv` is the :class:`~envs.base.Env` contract on an
OpenEnv WebSocket session, so that rollouts, Parquet, filtering and traces treat it as a local one.

Each instance holds one session (one WebSocket connection, hence one environment on the server). It
remembers its episode's seed and actions; when the connection is lost mid-episode it reconnects (at
most ``retries`` times, with a growing pause), resets to the seed and plays the actions again, and goes
on only if the server answers exactly as before, which a deterministic environment does. Every other
fault is one error that names the server and what to do: :class:`ServerUnreachableError` (down at
start), :class:`ServerLostError` (gone mid-episode, retries spent), :class:`ServerTimeoutError` (slower
than ``timeout_s``), :class:`ProtocolError` (malformed JSON or an unexpected shape),
:class:`ObservationTooLargeError` (over ``max_observation_bytes``), :class:`ActionSchemaError` (the
server's actions are not a text field we can fill), :class:`NondeterministicServerError` (a replay
differed) and :class:`SettingsMismatchError` (our server plays other settings than the config's).
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from websockets.exceptions import ConnectionClosed, InvalidHandshake, PayloadTooBig, WebSocketException
from websockets.sync.client import ClientConnection, connect

from envs.base import Env, StepResult
from envs.registry import EnvSpec
from envs.wire import messages as m

__all__ = [
    "ActionSchemaError",
    "NondeterministicServerError",
    "ObservationTooLargeError",
    "ProtocolError",
    "RemoteEnv",
    "RemoteEnvError",
    "ServerInfo",
    "ServerLostError",
    "ServerTimeoutError",
    "ServerUnreachableError",
    "SettingsMismatchError",
    "check_action_field",
    "check_settings",
    "probe",
]


class RemoteEnvError(RuntimeError):
    """A remote environment failed; the message names the server and the fix."""

    user_error = True  # ragen_core.errors: the CLI prints the message, not a traceback


class ServerUnreachableError(RemoteEnvError):
    pass


class ServerLostError(RemoteEnvError):
    pass


class ServerTimeoutError(RemoteEnvError):
    pass


class ProtocolError(RemoteEnvError):
    pass


class ObservationTooLargeError(RemoteEnvError):
    pass


class ActionSchemaError(RemoteEnvError):
    pass


class NondeterministicServerError(RemoteEnvError):
    pass


class SettingsMismatchError(RemoteEnvError):
    pass


class _Lost(Exception):
    """The connection went away (or timed out): a reconnect and replay may still save the episode."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def http_url(url: str) -> str:
    """The server's HTTP base for a ``ws://``, ``wss://``, ``http://`` or ``https://`` URL."""
    url = url.rstrip("/").removesuffix("/ws")
    for ws, http in (("ws://", "http://"), ("wss://", "https://")):
        if url.startswith(ws):
            return http + url[len(ws) :]
    return url


def ws_url(url: str) -> str:
    base = http_url(url)
    for http, ws in (("http://", "ws://"), ("https://", "wss://")):
        if base.startswith(http):
            return ws + base[len(http) :] + "/ws"
    raise ValueError(f"remote environment URL {url!r} must start with ws://, wss://, http:// or https://")


@dataclass(frozen=True)
class ServerInfo:
    """What a server says about itself: its action fields, and its tag's spec when it is ours."""

    url: str
    action_fields: tuple[str, ...]
    spec: EnvSpec | None


def _get_json(url: str, token: str | None, timeout_s: float) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as r:
        return json.loads(r.read(1 << 20))


def probe(url: str, token: str | None = None, timeout_s: float = 5.0, tag: str = "TAG") -> ServerInfo:
    """Ask the server at ``url`` for its health, its schemas and (ours only) its spec.

    Raises :class:`ServerUnreachableError` when nothing answers, naming the URL and how to start one.
    """
    base = http_url(url)
    try:
        _get_json(base + "/health", token, timeout_s)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        port = base.rsplit(":", 1)[-1] if base.count(":") > 1 else "8000"
        raise ServerUnreachableError(
            f"no OpenEnv server answers at {base} ({reason}); start it (ragen env serve {tag} --port {port}) "
            "or correct the config's remote url"
        ) from None
    try:
        schema = _get_json(base + "/schema", token, timeout_s)
        props = schema["action"].get("properties", {})
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise ServerUnreachableError(
                f"{base} refused our token (HTTP 401): set the config's remote token_env to the name of an "
                "environment variable holding the server's token"
            ) from None
        raise ProtocolError(f"{base}/schema answered HTTP {exc.code}; is this an OpenEnv server?") from None
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"{base}/schema is not OpenEnv's schema answer ({exc!r})") from None
    spec = None
    try:
        raw = _get_json(base + "/ragen/spec", token, timeout_s)
        fields = {k: raw[k] for k in EnvSpec.__dataclass_fields__ if k in raw}
        spec = EnvSpec(**fields)
    except urllib.error.HTTPError:
        pass  # another OpenEnv server: the config gives what the prompt needs
    return ServerInfo(url=base, action_fields=tuple(props), spec=spec)


def check_action_field(server: ServerInfo, action_field: str) -> None:
    """The server's action schema must have the text field we fill."""
    if action_field not in server.action_fields:
        raise ActionSchemaError(
            f"{server.url}'s action schema has the fields {list(server.action_fields)}, not "
            f"{action_field!r}: set the config's remote action_field to the text field of its action"
        )


def check_settings(server: ServerInfo, tag: str, expected: Mapping[str, Any]) -> None:
    """On one of our servers (which says what it plays): its settings must be ``expected``'s."""
    if server.spec is None:
        return
    served = server.spec.env_config
    diff = {k: v for k, v in expected.items() if served.get(k) != v}
    if diff:
        have = ", ".join(f"{k}={served.get(k)!r} (config: {v!r})" for k, v in diff.items())
        sets = " ".join(f"--set {k}={json.dumps(v)}" for k, v in diff.items())
        raise SettingsMismatchError(
            f"{server.url} serves {server.spec.tag} with {have}; restart it as "
            f"`ragen env serve {server.spec.tag} {sets}` or change the config's env_overrides for {tag}"
        )


class RemoteEnv(Env):
    """One OpenEnv session as an :class:`~envs.base.Env`.

    ``env_config``: the settings the config expects (its ``env_overrides`` over the catalogue); on one
    of our servers, which say what they play, a difference is a :class:`SettingsMismatchError`.
    ``spec``: the tag's spec where the server does not give one (another OpenEnv server).
    """

    env_type = "openenv"
    success_means = (
        "the remote environment ends the episode reporting success (else: done with a positive reward)."
    )

    def __init__(
        self,
        url: str,
        *,
        tag: str = "remote",
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        retries: int = 2,
        max_observation_bytes: int = 1_000_000,
        action_field: str = m.ACTION_FIELD,
        observation_field: str = m.OBSERVATION_FIELD,
        token: str | None = None,
        env_config: Mapping[str, Any] | None = None,
        spec: EnvSpec | None = None,
        info: ServerInfo | None = None,
    ) -> None:
        self.url, self.ws_url = http_url(url), ws_url(url)
        self.timeout_s, self.connect_timeout_s, self.retries = timeout_s, connect_timeout_s, retries
        self.max_observation_bytes = max_observation_bytes
        self.action_field, self.observation_field, self.token = action_field, observation_field, token
        self.server = info or probe(url, token, connect_timeout_s, tag)
        check_action_field(self.server, action_field)
        if env_config is not None:
            check_settings(self.server, tag, env_config)
        self.tag = tag
        self.spec = spec or self.server.spec or EnvSpec(tag=tag, env_type="openenv")
        self._ws: ClientConnection | None = None
        self._seed: int | None = None
        self._played: list[tuple[str, str]] = []  # (action, text answered) since the reset
        self._first = ""
        self._rendered = ""

    # the wire ------------------------------------------------------------------------------------
    def _connect(self) -> ClientConnection:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        try:
            return connect(
                self.ws_url,
                additional_headers=headers,
                open_timeout=self.connect_timeout_s,
                max_size=self.max_observation_bytes,
                compression=None,
                proxy=None,
                close_timeout=1,
            )
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise _Lost(f"cannot open {self.ws_url}: {exc}") from exc

    def _drop(self, graceful: bool = True) -> None:
        ws = getattr(self, "_ws", None)  # None too when __init__ failed before the first connection
        if ws is not None:
            with contextlib.suppress(Exception):  # the connection is being thrown away either way
                if graceful:
                    ws.close()
                else:
                    # websockets' close() joins its receiving thread, a daemon thread that no longer
                    # runs while the interpreter exits: from a finalizer it hung the exit for good
                    ws.socket.close()
            self._ws = None

    def _exchange(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one message, read its answer's ``data``; :class:`_Lost` when the connection is gone."""
        if self._ws is None:
            self._ws = self._connect()
        try:
            self._ws.send(m.dumps(message))
            raw = self._ws.recv(timeout=self.timeout_s)
        except TimeoutError as exc:
            self._drop()
            raise _Lost(f"no answer in {self.timeout_s:g} s", timed_out=True) from exc
        except PayloadTooBig as exc:
            self._drop()
            raise self._too_large(str(exc)) from None
        except ConnectionClosed as exc:
            self._drop()
            if exc.sent is not None and exc.sent.code == 1009:  # we closed it: the message was too big
                raise self._too_large(exc.sent.reason) from None
            raise _Lost(f"connection closed ({exc})") from exc
        except (OSError, WebSocketException) as exc:
            self._drop()
            raise _Lost(f"{type(exc).__name__}: {exc}") from exc
        return self._parse(raw, message["type"])

    def _too_large(self, detail: str) -> ObservationTooLargeError:
        return ObservationTooLargeError(
            f"{self.url} sent a message over max_observation_bytes={self.max_observation_bytes} ({detail}); "
            "raise the config's remote max_observation_bytes if such observations are meant"
        )

    def _parse(self, raw: str | bytes, kind: str) -> dict[str, Any]:
        try:
            reply = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            self._drop()  # the stream can no longer be trusted to pair answers with questions
            raise ProtocolError(
                f"{self.url} answered a {kind} with malformed JSON: {str(raw)[:120]!r}; the server is broken"
            ) from None
        data = reply.get("data") if isinstance(reply, dict) else None
        if not isinstance(data, dict):
            self._drop()
            raise ProtocolError(
                f"{self.url} answered a {kind} with {str(raw)[:120]!r}, not an OpenEnv message"
            )
        if reply.get("type") == "error":
            self._raise_error(data, kind)
        if reply.get("type") != "observation" or not isinstance(data.get("observation"), dict):
            raise ProtocolError(f"{self.url} answered a {kind} with a {reply.get('type')!r} message")
        return data

    def _raise_error(self, data: dict[str, Any], kind: str) -> None:
        code, text = data.get("code"), data.get("message")
        if code == m.IDLE_TIMEOUT:
            self._drop()
            raise _Lost(f"the server closed the idle session ({text})")
        if code == m.OBSERVATION_TOO_LARGE:
            raise ObservationTooLargeError(
                f"{self.url}: {text}; raise the server's --max-observation-bytes if such observations are meant"
            )
        if code == m.VALIDATION_ERROR and kind == "step":
            raise ActionSchemaError(
                f"{self.url} refused our action {{{self.action_field!r}: ...}}: {text}; set the config's remote "
                "action_field to the text field of its action (GET /schema shows it)"
            )
        raise RemoteEnvError(f"{self.url} answered a {kind} with an error ({code}): {text}")

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        """:meth:`_exchange`, reconnecting and replaying the episode when the connection is lost."""
        try:
            return self._exchange(message)
        except _Lost as exc:
            last = exc
        for attempt in range(1, self.retries + 1):
            time.sleep(min(0.2 * 2 ** (attempt - 1), 2.0))
            try:
                self._replay()
                return self._exchange(message)
            except _Lost as exc:
                last = exc
        where = "at a reset" if self._seed is None else f"in the episode of seed {self._seed}"
        if last.timed_out:
            raise ServerTimeoutError(
                f"{self.ws_url} did not answer a {message['type']} {where} within timeout_s={self.timeout_s:g} s, "
                f"{self.retries + 1} times; raise the config's remote timeout_s if the environment is that slow"
            )
        raise ServerLostError(
            f"lost {self.ws_url} {where} after {len(self._played)} steps, and {self.retries} reconnects "
            f"failed (last: {last}); is the server still running? Nothing of this rollout was stored"
        )

    def _replay(self) -> None:
        """Play the episode so far again on a new session; the answers must be what they were."""
        if self._seed is None:
            return
        first = self._text(self._exchange({"type": "reset", "data": {"seed": self._seed}}))
        steps = [(a, self._text(self._exchange(self._step_message(a)))) for a, _ in self._played]
        if first != self._first or steps != self._played:
            raise NondeterministicServerError(
                f"{self.url} answered a replay of seed {self._seed} differently after a reconnect: the "
                "environment is not deterministic, so a lost session cannot be restored"
            )

    # the Env contract ----------------------------------------------------------------------------
    def _step_message(self, action: str) -> dict[str, Any]:
        return {"type": "step", "data": {self.action_field: action}}

    def _text(self, data: dict[str, Any]) -> str:
        obs = data["observation"]
        text = obs.get(self.observation_field)
        if not isinstance(text, str):
            raise ProtocolError(
                f"{self.url}'s observation has no text field {self.observation_field!r} (fields: "
                f"{sorted(obs)}); set the config's remote observation_field"
            )
        return text

    def _take(self, data: dict[str, Any]) -> str:
        obs = data["observation"]
        text = self._text(data)
        rendered = obs.get("rendered")
        self._rendered = rendered if isinstance(rendered, str) else text
        if "legal_actions" in obs:
            legal = obs["legal_actions"]
            self.actions = [str(a) for a in legal] if isinstance(legal, list) else None
        if isinstance(obs.get("grid_vocab"), dict):
            self.grid_vocab = {str(k): str(v) for k, v in obs["grid_vocab"].items()}
        return text

    def reset(self, seed: int) -> str:
        self._seed, self._played = None, []
        data = self._call({"type": "reset", "data": {"seed": int(seed)}})
        self._seed = int(seed)
        self._first = self._take(data)
        return self._first

    def step(self, action: str) -> StepResult:
        if self._seed is None:
            raise RuntimeError(f"RemoteEnv.step() before reset(seed) ({self.url})")
        data = self._call(self._step_message(action))
        text = self._take(data)
        self._played.append((action, text))
        reward = data.get("reward")
        reward = float(reward) if isinstance(reward, int | float) and not isinstance(reward, bool) else 0.0
        done = bool(data.get("done", False))
        info = dict(data["observation"].get("info") or {})
        info.setdefault("success", done and reward > 0)
        info.setdefault("action_is_valid", True)
        info.setdefault("action_is_effective", True)
        return StepResult(text, reward, done, info)

    def render(self) -> str:
        if self._seed is None:
            raise RuntimeError(f"RemoteEnv.render() before reset(seed) ({self.url})")
        return self._rendered

    def close(self) -> None:
        if self._ws is not None:
            with contextlib.suppress(Exception):  # closing a connection that is already gone
                self._ws.send(m.dumps({"type": "close"}))
        self._drop()

    def __del__(self) -> None:
        self._drop(graceful=False)
