"""ragen-flow environments: Bandit, Sokoban, FrozenLake, Countdown, MathQA, and plug-ins.

``envs.make(tag, **overrides)`` builds an environment from the tag catalogue (``catalogue.yaml``).
This package depends on the standard library and numpy only (never torch).
"""

from envs.base import Env, StepResult
from envs.registry import (
    EnvSpec,
    UnknownEnvError,
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
    "catalogue_tags",
    "make",
    "register_tag",
    "register_type",
    "spec",
    "tags",
]
