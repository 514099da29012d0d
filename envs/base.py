"""The environment contract shared by every ragen-flow environment.

An environment is a small, seedable text game: ``reset(seed)`` returns the rendered initial state
(the same seed gives the same state in any process), ``step(action)`` applies one primitive action
given as text and returns a :class:`StepResult`. Discrete-action environments expose their action
vocabulary in ``actions``; free-text environments (Countdown, MathQA) set it to ``None``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class StepResult:
    """What one primitive action did.

    ``info`` always carries ``success``, ``action_is_valid`` and ``action_is_effective`` (bools).
    """

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Env(ABC):
    """Base class of all environments (built-in and plug-in).

    Subclasses set ``actions`` (the action names, or ``None`` for free-text actions) and may set
    ``grid_vocab`` (symbol -> meaning, shown as the legend in the prompt). Both may change at
    ``reset`` (Bandit's arm names do not, Sokoban's vocabulary is fixed per instance).
    """

    #: Registry name of the environment type (``sokoban``, ``frozen_lake``, ...).
    env_type: ClassVar[str] = ""

    actions: list[str] | None = None
    grid_vocab: dict[str, str] | None = None

    @abstractmethod
    def reset(self, seed: int) -> str:
        """Start a new episode from ``seed`` and return the rendered initial state."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one primitive action.

        Discrete envs match ``action`` to ``actions`` case-insensitively after stripping; an unknown
        name changes nothing and returns reward 0 with ``action_is_valid=False``.
        """

    @abstractmethod
    def render(self) -> str:
        """The current state as text."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (most envs hold none)."""

    # Helpers for discrete-action subclasses -------------------------------------------------
    def match_action(self, action: str) -> int | None:
        """Index of ``action`` in ``actions`` (case-insensitive exact name match) or ``None``."""
        if self.actions is None:
            return None
        key = action.strip().lower()
        for i, name in enumerate(self.actions):
            if name.lower() == key:
                return i
        return None


def invalid_step(observation: str) -> StepResult:
    """The result of an action that is not in the vocabulary: nothing happens."""
    return StepResult(
        observation=observation,
        reward=0.0,
        done=False,
        info={"success": False, "action_is_valid": False, "action_is_effective": False},
    )


def format_reward(x: float) -> str:
    """Reward text shown to the model: at most 2 decimals.

    See docs/architecture.md, "Deliberate differences from RAGEN": reward text.

    RAGEN printed the raw float repr (``-0.30000000000000004``); we round to 2 decimals and keep
    Python's float look otherwise (``1.0``, ``-0.3``, ``10.55``). ``-0.0`` prints as ``0.0``.
    Shared by the environments' feedback text and the protocol's ``Reward:`` lines.
    """
    x = float(x)
    if not math.isfinite(x):
        return repr(x)
    r = round(x, 2)
    if r == 0:
        return "0.0"
    s = f"{r:.2f}".rstrip("0")
    return s + "0" if s.endswith(".") else s
