"""Bi-arm Bandit: a single-turn, stochastic game about reading meaning into names.

Two arms are offered under symbolic names (``Phoenix`` / ``Dragon``, ``Trader`` / ``Librarian``).
The low-risk arm always pays ``lo_arm_score`` (0.1 as in RAGEN's code; the paper's 0.15 is a config
value away: docs/architecture.md, "Deliberate differences from RAGEN": Bandit low arm). The
high-risk arm pays ``hi_arm_hiscore`` with probability ``hi_arm_hiscore_prob`` and
``hi_arm_loscore`` otherwise, so its expectation (0.25 by default) beats the safe arm. Success means
choosing the high arm, whatever it happened to pay.

Randomness follows RAGEN exactly: ``reset(seed)`` seeds a local ``numpy.random.Generator``
(``default_rng(seed)``, what gymnasium's ``reset(seed=...)`` builds); its first uniform draw decides the
arm order (``< 0.5``: the low arm is listed first) and its second the high arm's payout. All rollouts
of a group share a seed, hence the arm order and the payout, so in-group variance comes only from the
choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from envs.base import Env, StepResult, format_reward, invalid_step

INIT_PROMPT = (
    "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull. \n"
    "Game Rules: \n"
    "1. There are 2 arms, named {name_a} and {name_b}\n"
    "2. Each arm has its own reward distribution, related to their names. \n"
    "3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution might "
    "behave.\n"
    "4. Based on the symbolic meaning of their names, which arm do you think is more likely to give "
    "higher rewards on average? Choose between {name_a} and {name_b}, and output like "
    "<answer> {name_a} </answer> or <answer> {name_b} </answer>.\n"
)
"""RAGEN's prompt, byte for byte: trailing spaces after "pull.", "Rules:" and "names.", final newline."""


class BanditEnv(Env):
    """Two named arms, one low-risk and one high-risk; one pull per episode."""

    env_type: ClassVar[str] = "bandit"
    success_means: ClassVar[str] = "the pulled arm is the high-risk arm, whatever it happened to pay."

    def __init__(
        self,
        lo_arm_name: str = "phoenix",
        hi_arm_name: str = "dragon",
        lo_arm_score: float = 0.1,
        hi_arm_loscore: float = 0.0,
        hi_arm_hiscore: float = 1.0,
        hi_arm_hiscore_prob: float = 0.25,
    ) -> None:
        if lo_arm_name.strip().lower() == hi_arm_name.strip().lower():
            raise ValueError(f"bandit arm names must differ (case-insensitively): {lo_arm_name!r}")
        if not 0.0 <= hi_arm_hiscore_prob <= 1.0:
            raise ValueError(f"hi_arm_hiscore_prob must be in [0, 1], got {hi_arm_hiscore_prob}")
        self.lo_arm_name = lo_arm_name
        self.hi_arm_name = hi_arm_name
        self.lo_arm_score = float(lo_arm_score)
        self.hi_arm_loscore = float(hi_arm_loscore)
        self.hi_arm_hiscore = float(hi_arm_hiscore)
        self.hi_arm_hiscore_prob = float(hi_arm_hiscore_prob)
        #: The arm that counts as success (the high-risk, high-expectation one).
        self.hi_arm: str = hi_arm_name
        #: What the high arm pays in this episode (drawn at reset; RAGEN's second draw).
        self.hi_arm_payout: float | None = None
        self.actions = [lo_arm_name, hi_arm_name]
        self._observation: str | None = None
        self._done = False

    def reset(self, seed: int) -> str:
        """Order the arms and fix the high arm's payout from ``seed``.

        The payout is RAGEN's second draw of the same generator; drawing it here rather than at the
        pull gives the same value (nothing else consumes the stream) and makes it inspectable.
        """
        rng = np.random.default_rng(seed)
        if rng.random() < 0.5:
            self.actions = [self.lo_arm_name, self.hi_arm_name]
        else:
            self.actions = [self.hi_arm_name, self.lo_arm_name]
        hit = rng.random() < self.hi_arm_hiscore_prob
        self.hi_arm_payout = self.hi_arm_hiscore if hit else self.hi_arm_loscore
        self._done = False
        self._observation = INIT_PROMPT.format(name_a=self.actions[0], name_b=self.actions[1])
        return self._observation

    def step(self, action: str) -> StepResult:
        """Pull the named arm: always ends the episode; an unknown name changes nothing."""
        observation = self.render()
        index = self.match_action(action)
        if index is None:
            return invalid_step(observation)
        if self._done:
            # The game is over after one pull: later pulls change nothing and pay nothing.
            info = {"success": False, "action_is_valid": True, "action_is_effective": False}
            return StepResult(observation, 0.0, True, info)
        assert self.actions is not None and self.hi_arm_payout is not None
        arm = self.actions[index]
        is_hi = arm == self.hi_arm_name
        reward = self.hi_arm_payout if is_hi else self.lo_arm_score
        self._done = True
        self._observation = f"{arm}: {format_reward(reward)} points"
        return StepResult(
            self._observation,
            reward,
            True,
            {"success": is_hi, "action_is_valid": True, "action_is_effective": True},
        )

    def render(self) -> str:
        """The prompt before the pull, ``"{arm}: {reward} points"`` after it."""
        if self._observation is None:
            raise RuntimeError("BanditEnv.render() before reset(seed)")
        return self._observation

    def oracle_action(self) -> str:
        """The arm that succeeds: the high arm (also the higher expectation, 0.25 > 0.1, by default)."""
        return self.hi_arm

    def oracle_actions(self, actions_left: int, max_actions: int, turns_left: int) -> list[str]:
        """One pull of the high arm (the episode has one action)."""
        return [self.oracle_action()]

    def think_text(self, actions: Sequence[str]) -> str:
        """A sentence about the arm names that matches the pick: the names are all the model sees."""
        first = actions[0] if actions else ""
        hi, lo = self.hi_arm_name, self.lo_arm_name
        if first.strip().lower() == hi.strip().lower():
            return f"{hi} sounds bold and may pay more than {lo}, so I pick {hi}."
        return f"{lo} sounds safe and steady, so I pick {lo}."

    def close(self) -> None:
        self._observation = None


def solve(env: BanditEnv) -> list[str]:
    """Oracle action sequence for the current episode: pull the high arm (expected 0.25 > 0.1)."""
    return [env.oracle_action()]
