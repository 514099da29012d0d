"""The environment contract shared by every ragen-flow environment.

An environment is a small, seedable text game: ``reset(seed)`` returns the rendered initial state
(the same seed gives the same state in any process), ``step(action)`` applies one primitive action
given as text and returns a :class:`StepResult`. Discrete-action environments expose their action
vocabulary in ``actions``; free-text environments (Countdown, MathQA) set it to ``None``.

Everything else the project needs to know about an environment is a hook on the class itself, so that
adding one (built-in or plug-in) means writing one class and registering it, never editing a switch
elsewhere: :meth:`Env.oracle_actions` (what a good player does next: the warm start's demonstrations,
``ragen demo``, the tests), :meth:`Env.think_text` (the demonstrations' think sentence),
:meth:`Env.random_answer` (the demonstrations' noise) and :attr:`Env.success_means` (what a success
is, shown by ``ragen demo``, ``ragen show`` and ``ragen evaluate``).
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

#: A free-text slot inside an answer action (WebShop's ``search[<content>]``): constrained decoding
#: spells the text around it and samples the slot freely (ragen_core/rollout/constrained.py).
ANSWER_SLOT = "<content>"


class NoOracleError(NotImplementedError):
    """The environment has no oracle (it does not override :meth:`Env.oracle_actions`)."""


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
    #: What a successful episode is, in one sentence (``info["success"]`` of the final step); shown by
    #: ``ragen demo``, ``ragen show`` and ``ragen evaluate`` next to the success it explains.
    success_means: ClassVar[str] = "the environment ends the episode reporting success."
    #: A module the environment needs beyond ragen-flow's own dependencies (a library adapter's
    #: library), or None; :func:`envs.registry.available` checks it without importing it.
    requires: ClassVar[str | None] = None

    actions: list[str] | None = None
    grid_vocab: dict[str, str] | None = None
    #: The valid actions change with the state although ``actions`` is ``None`` (WebShop's clickables):
    #: constrained decoding then spells :meth:`answer_actions` of each turn's state.
    state_actions: ClassVar[bool] = False

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

    # Hooks of the warm start and the demo ------------------------------------------------------
    def oracle_actions(self, actions_left: int, max_actions: int, turns_left: int) -> list[str]:
        """The actions a good player takes next turn (at most ``max_actions`` and ``actions_left``).

        ``turns_left`` counts this turn, so an oracle can spread its budget over the turns.
        Return ``[]`` when no way to succeed is known (e.g. an unsolvable position) and one answer
        string for free-text environments. Without an override there is no oracle: the warm start
        cannot demonstrate the environment, hence the error rather than a guess.
        """
        kind = type(self).env_type or type(self).__name__
        raise NoOracleError(f"environment type {kind!r} has no oracle; define oracle_actions() on it")

    def think_text(self, actions: Sequence[str]) -> str:
        """The demonstration's think sentence for taking ``actions`` in the current state.

        Deterministic, short, and about the state, so that the imitated reasoning matches what is on
        screen; the default only restates the answer.
        """
        first = actions[0] if actions else ""
        return f"The answer is {first}."

    def random_answer(self, plan: list[str], cap: int, rng: random.Random) -> list[str]:
        """A deliberately non-oracle answer for the demonstrations' noise turns (``cap`` >= 1 actions).

        Discrete actions: as many as the oracle's ``plan`` (1..min(3, cap) without a plan), each
        uniform over the vocabulary. Free text: the plan's number moved by -3..3 (not 0), the plan
        itself when it is no number, a number in 0..100 without a plan. Draws only from ``rng``, in a
        fixed order, so the demonstrations are reproducible.
        """
        if self.actions:
            k = len(plan) if plan else rng.randint(1, max(1, min(3, cap)))
            return [rng.choice(self.actions) for _ in range(min(k, cap))]
        if plan:
            try:
                value = float(plan[0])
            except ValueError:
                return list(plan)
            delta = rng.choice([-3, -2, -1, 1, 2, 3])
            return [str(int(value) + delta) if value == int(value) else str(value + delta)]
        return [str(rng.randint(0, 100))]

    def answer_actions(self) -> list[str] | None:
        """The actions a constrained answer may spell in the current state (``agent.action_decoding:
        constrained``): ``actions``. An environment with :attr:`state_actions` returns the current state's
        (WebShop: the shown page's clickables and ``search[<content>]``, whose :data:`ANSWER_SLOT` is free
        text), or ``None`` where this state takes only free text, which leaves that turn's answer free."""
        return self.actions

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


def cell_label(index: int, ncol: int) -> str:
    """A grid cell as ``(row,col)`` (0-based) from its flat index: how think sentences name cells."""
    r, c = divmod(int(index), int(ncol))
    return f"({r},{c})"


def cell_separator_setting(separator: Any) -> str:
    """``separator`` checked as a grid env's ``cell_separator`` setting (:func:`separate_cells`)."""
    if not isinstance(separator, str) or "\n" in separator:
        raise ValueError(f"cell_separator must be a string without newlines, got {separator!r}")
    return separator


def moves_between(cell: int, other: int, ncol: int) -> str:
    """``2 Down, 1 Left``: how many moves along each axis lead from grid cell ``cell`` to ``other`` (flat
    indices, ``ncol`` columns); the rows first, as the grid envs' ``directions`` lines give them."""
    (r, c), (r2, c2) = divmod(int(cell), int(ncol)), divmod(int(other), int(ncol))
    parts = [f"{abs(r2 - r)} {'Down' if r2 > r else 'Up'}"] if r2 != r else []
    parts += [f"{abs(c2 - c)} {'Right' if c2 > c else 'Left'}"] if c2 != c else []
    return ", ".join(parts)


def observation_flag(name: str, value: Any) -> bool:
    """``value`` checked as an on/off observation setting: only ``true`` or ``false``, so that a quoted
    ``"false"`` (a true string) cannot turn a setting on unnoticed."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def separate_cells(grid: str, separator: str) -> str:
    """``grid`` (rows joined by newlines) with ``separator`` between the cells of each row.

    A BPE tokenizer merges runs of grid symbols (SmolLM2 reads ``GP__`` as ``GP`` + ``__``), so the
    model cannot tell which column a symbol is in; ``"_ _ O G"`` is one token per cell. ``""``
    keeps RAGEN's rendering (docs/environments.md, "Using one").
    """
    if not separator:
        return grid
    return "\n".join(separator.join(row) for row in grid.split("\n"))


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
