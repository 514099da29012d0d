"""Environments over the wire: the OpenEnv protocol (HTTP ``/reset``, ``/step``, ``/state``, ``/health``,
``/schema``, ``/metadata`` and one session per WebSocket connection on ``/ws``).

:mod:`envs.wire.server` serves any registered tag (``ragen env serve TAG``); :mod:`envs.wire.client`
is :class:`~envs.base.Env` over a WebSocket session, so rollouts play a remote environment as a local
one. The message shapes both sides share are in :mod:`envs.wire.messages` (standard library only); the
server needs FastAPI and uvicorn, the client ``websockets`` (all three come with the pinned stack).
"""
