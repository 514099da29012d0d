"""ragen-flow environments: Bandit, Sokoban, FrozenLake, Countdown, MathQA, WebShop, library adapters
(reasoning-gym, textarena; the ``envlibs`` extra) and plug-ins.

``envs.make(tag, **overrides)`` builds an environment from the tag catalogue (``catalogue.yaml``).
The environments depend on the standard library and numpy only (never torch); WebShop's search adds
bm25s, and ``envs.wire`` (environments served and played over OpenEnv's protocol) websockets,
FastAPI and uvicorn, imported only when a server or a remote tag is used.
"""

from envs.base import Env, StepResult
from envs.registry import (
    EnvSpec,
    UnknownEnvError,
    available,
    catalogue_tags,
    make,
    register_tag,
    register_type,
    spec,
    tags,
)

__all__ = [
    "Env",
    "EnvSpec",
    "StepResult",
    "UnknownEnvError",
    "available",
    "catalogue_tags",
    "make",
    "register_tag",
    "register_type",
    "spec",
    "tags",
]
