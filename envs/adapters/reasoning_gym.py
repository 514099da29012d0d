"""reasoning-gym's procedural datasets as single-answer environments (free text, one turn).

A tag names a dataset (``dataset: basic_arithmetic``) and its generator settings (``config``, the
dataset's own config fields). The puzzle of episode ``seed`` is item ``seed mod size`` of the dataset
built with ``dataset_seed``: reasoning-gym generates item ``i`` from ``Random(dataset_seed + i)``, so the
same seed gives the same puzzle in any process, and training and validation seeds (disjoint ranges)
give different puzzles.

Reward: the dataset's own ``score_answer(answer, entry)`` (1.0 for a right answer; some datasets give
partial credit), unchanged. Two guards run before it, for answers that are not worth scoring: one over
:data:`MAX_ANSWER_CHARS` characters, and a scorer that raises (a library bug on odd input must not end a
rollout); both score 0 with ``action_is_valid`` false. ``success`` = the score is 1.0 (full credit);
``action_is_valid`` = the answer is non-empty and was scored.

The oracle answers the dataset's reference ``answer``, so the warm start can demonstrate any dataset.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from envs.adapters import import_library
from envs.base import Env, StepResult, format_reward

MAX_ANSWER_CHARS = 4000
"""Longest answer passed to the scorer (a 4x4 Sudoku needs ~40 characters, a 9x9 one ~170)."""


class ReasoningGymEnv(Env):
    """One reasoning-gym item per episode; the single action is the answer."""

    env_type: ClassVar[str] = "reasoning_gym"
    success_means: ClassVar[str] = "the dataset's own scorer gives the answer full credit (1.0)."
    requires: ClassVar[str | None] = "reasoning_gym"

    def __init__(
        self,
        dataset: str,
        config: dict[str, Any] | None = None,
        dataset_seed: int = 0,
        size: int = 100_000,
    ) -> None:
        rg = import_library("reasoning_gym", "reasoning-gym", self.env_type)
        if size < 1:
            raise ValueError(f"reasoning_gym: size must be >= 1, got {size}")
        settings = dict(config or {})
        for key in ("seed", "size"):
            if key in settings:
                raise ValueError(
                    f"reasoning_gym: set {key!r} with the env_config key "
                    f"{'dataset_seed' if key == 'seed' else 'size'!r}, not inside config"
                )
        try:
            self.data = rg.create_dataset(dataset, seed=int(dataset_seed), size=int(size), **settings)
        except (ValueError, TypeError, AssertionError) as exc:
            raise ValueError(f"reasoning_gym dataset {dataset!r} with config {settings}: {exc}") from exc
        self.dataset = dataset
        self.size = int(size)
        self.actions = None
        self.entry: dict[str, Any] | None = None
        self._observation: str | None = None
        self._done = False

    def reset(self, seed: int) -> str:
        """The question of item ``seed mod size``."""
        self.entry = self.data[int(seed) % self.size]
        self._done = False
        self._observation = str(self.entry["question"])
        return self._observation

    def score(self, answer: str) -> tuple[float, bool]:
        """``(reward, scored)``: the library's score, or 0 where a guard refused the answer."""
        if self.entry is None:
            raise RuntimeError("ReasoningGymEnv.score() before reset(seed)")
        if not isinstance(answer, str) or not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
            return 0.0, False
        try:
            value = float(self.data.score_answer(answer, self.entry))
        except Exception:  # any scorer failure is a wrong answer, not a dead rollout
            return 0.0, False
        if not math.isfinite(value):
            return 0.0, False
        return value, True

    def step(self, action: str) -> StepResult:
        """Score the answer; the episode ends whatever it scored."""
        if self._observation is None:
            raise RuntimeError("ReasoningGymEnv.step() before reset(seed)")
        if self._done:  # one answer per item: a second one changes nothing
            info = {"success": False, "action_is_valid": False, "action_is_effective": False}
            return StepResult(self._observation, 0.0, True, info)
        reward, scored = self.score(action)
        self._done = True
        self._observation = f"Your answer get {format_reward(reward)} points."
        info = {"success": scored and reward >= 1.0, "action_is_valid": scored, "action_is_effective": scored}
        return StepResult(self._observation, reward, True, info)

    def render(self) -> str:
        """The question before the answer, the grading message after it."""
        if self._observation is None:
            raise RuntimeError("ReasoningGymEnv.render() before reset(seed)")
        return self._observation

    def oracle_actions(self, actions_left: int, max_actions: int, turns_left: int) -> list[str]:
        """The dataset's reference answer."""
        if self.entry is None:
            raise RuntimeError("ReasoningGymEnv.oracle_actions() before reset(seed)")
        answer = self.entry.get("answer")
        return [str(answer)] if answer is not None else []
