"""The OpenEnv wire format, as openenv-core 0.3 speaks it, shared by our server and our client.

WebSocket ``/ws``: the client sends ``{"type": "reset", "data": {"seed": 3}}``,
``{"type": "step", "data": {<action fields>}}``, ``{"type": "state"}`` or ``{"type": "close"}``; the
server answers ``{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}``,
``{"type": "state", "data": {...}}`` or ``{"type": "error", "data": {"message": ..., "code": ...}}``.
HTTP ``POST /reset`` and ``POST /step`` answer the ``data`` object itself (no session: a fresh
environment per request, as openenv-core's server does).

Our environments' action is ``{"message": "<one primitive action>"}`` (the field openenv's text
environments, echo and TextArena, use); their observation is
``{"text", "rendered", "legal_actions", "grid_vocab", "info"}``.
"""

from __future__ import annotations

import json
import math
from typing import Any

#: The action field of our environments' action schema.
ACTION_FIELD = "message"
#: The observation field that holds the environment's text.
OBSERVATION_FIELD = "text"

# openenv-core's WSErrorCode values, and the ones our server adds for its limits
INVALID_JSON = "INVALID_JSON"
UNKNOWN_TYPE = "UNKNOWN_TYPE"
VALIDATION_ERROR = "VALIDATION_ERROR"
EXECUTION_ERROR = "EXECUTION_ERROR"
CAPACITY_REACHED = "CAPACITY_REACHED"
SESSION_ERROR = "SESSION_ERROR"
UNAUTHORIZED = "UNAUTHORIZED"
OBSERVATION_TOO_LARGE = "OBSERVATION_TOO_LARGE"
STEP_LIMIT = "STEP_LIMIT"
IDLE_TIMEOUT = "IDLE_TIMEOUT"
MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"


def json_safe(value: Any) -> Any:
    """``value`` as plain JSON data: numpy scalars and arrays become numbers and lists, a non-finite
    float ``None`` (JSON has no NaN), anything else unknown its ``str``."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    item = getattr(value, "tolist", None)  # numpy scalars and arrays, without importing numpy
    if callable(item):
        return json_safe(item())
    return str(value)


def error(message: str, code: str, **extra: Any) -> dict[str, Any]:
    """A WebSocket error message."""
    return {"type": "error", "data": {"message": message, "code": code, **extra}}


def dumps(message: dict[str, Any]) -> str:
    return json.dumps(message, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
