"""The documented example environment ("guess the number"), run through the real registry and env groups.

The class and :func:`test_the_oracle_always_wins` are docs/environments.md's "Adding an environment"
example; keeping them here makes the example a tested one: change docs/environments.md with this file.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

import envs
from envs import registry
from envs.base import Env, StepResult, invalid_step
from envs.oracles import oracle_actions
from ragen_core.env_groups import EnvGroups, EnvGroupsConfig
from ragen_core.protocol import ProtocolConfig, forced_prefix


class GuessNumberEnv(Env):
    """Guess a secret number in 1..hi; a wrong guess is told whether it was too low or too high."""

    env_type: ClassVar[str] = "guess_number"
    success_means: ClassVar[str] = "the secret number is guessed within the action budget."
    #: a plug-in's catalogue entry: registering the class makes "guess_number" a tag
    default_spec: ClassVar[dict[str, Any]] = {
        "env_instruction": "Guess my secret number. Answer with one number, like <answer>50</answer>.",
        "max_actions_per_traj": 7,
        "max_turn": 7,
    }

    def __init__(self, hi: int = 100) -> None:
        self.hi = hi
        self.actions = None  # free text: the answer is the guess
        self.secret, self.low, self.high = 0, 1, hi
        self.text = ""

    def reset(self, seed: int) -> str:
        self.secret = random.Random(seed).randint(1, self.hi)  # a local RNG: same seed, same number
        self.low, self.high = 1, self.hi
        self.text = f"I think of a number between 1 and {self.hi}."
        return self.text

    def step(self, action: str) -> StepResult:
        try:
            guess = int(action.strip())
        except ValueError:
            return invalid_step(self.text)
        if guess < self.secret:
            self.low, self.text = max(self.low, guess + 1), f"{guess} is too low."
        elif guess > self.secret:
            self.high, self.text = min(self.high, guess - 1), f"{guess} is too high."
        else:
            self.text = f"{guess} is right!"
        ok = guess == self.secret
        info = {"success": ok, "action_is_valid": True, "action_is_effective": True}
        return StepResult(self.text, 1.0 if ok else 0.0, ok, info)

    def render(self) -> str:
        return self.text

    def oracle_actions(self, actions_left: int, max_actions: int, turns_left: int) -> list[str]:
        """Halve what is still possible; one guess per turn, since the next one needs the feedback."""
        return [str((self.low + self.high) // 2)]

    def think_text(self, actions: Sequence[str]) -> str:
        first = actions[0] if actions else ""
        return f"It is between {self.low} and {self.high}, so I guess {first}."


def test_the_oracle_always_wins() -> None:
    env = GuessNumberEnv()
    for seed in range(100):
        env.reset(seed)
        for left in range(7, 0, -1):  # 7 guesses: 2**7 > 100
            (guess,) = oracle_actions(env, left, max_actions=1, turns_left=left)
            if env.step(guess).done:
                break
        assert env.render().endswith("is right!"), seed


@pytest.fixture
def registered() -> Iterator[None]:
    """The type registered for one test only: later tests in this process see the shipped tags alone."""
    envs.register_type("guess_number", GuessNumberEnv)
    try:
        yield
    finally:
        registry._types.pop("guess_number", None)
        registry._tags.pop("guess_number", None)


@pytest.mark.usefixtures("registered")
def test_registered_env_plays_through_the_protocol() -> None:
    """Registered at run time (what an entry point does at load), played as a rollout would be."""
    assert envs.spec("guess_number").max_actions_per_traj == 7
    protocol = ProtocolConfig(max_turn=7)
    config = EnvGroupsConfig(tags=["guess_number"], n_groups=[16], group_size=1)
    groups = EnvGroups(config, protocol, mode="val")
    groups.reset()
    while groups.active_ids():
        answers = {}
        for i in groups.active_ids():
            env, actions_left = groups.env(i), groups.history(i)[-1].actions_left
            (guess,) = oracle_actions(env, actions_left, protocol.max_actions_per_turn)
            answers[i] = (
                forced_prefix(protocol) + f"{env.think_text([guess])}</think><answer>{guess}</answer>"
            )
        groups.step(answers)
    metrics = groups.metrics()
    assert metrics["guess_number/success"] == 1.0
    assert metrics["guess_number/format_penalty"] == 0.0
    env = GuessNumberEnv()
    env.reset(0)
    assert env.random_answer(["50"], 1, random.Random(0)) != ["50"]  # the base class's noisy answer


@pytest.mark.usefixtures("registered")
def test_the_example_behind_a_server_plays_as_in_process() -> None:
    """The third way: the class behind a server (what `ragen env serve guess_number` runs), played by
    env groups through `remote`, answers turn by turn as the class in this process does."""
    from envs.wire.server import create_app, running
    from ragen_core.env_groups import RemoteEnvConfig

    protocol = ProtocolConfig(max_turn=7)
    with running(create_app("guess_number")) as server:
        remote = {"guess_number": RemoteEnvConfig(url=server.url)}
        plays = [
            EnvGroups(
                EnvGroupsConfig(tags=["guess_number"], n_groups=[8], group_size=1, remote=r), protocol, "val"
            )
            for r in ({}, remote)
        ]
        local, served = plays
        try:
            assert served.spec(0) == local.spec(0)
            assert local.reset() == served.reset()
            while local.active_ids():
                answers = {}
                for i in local.active_ids():
                    (guess,) = oracle_actions(local.env(i), local.history(i)[-1].actions_left, 1)
                    answers[i] = forced_prefix(protocol) + f"</think><answer>{guess}</answer>"
                local.step(answers)
                served.step(answers)
            assert served.trajectories() == local.trajectories()
            assert local.metrics()["guess_number/success"] == 1.0
        finally:
            served.close()


def test_the_environments_doc_shows_this_example() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text()
    assert inspect.getsource(GuessNumberEnv) in doc
    assert inspect.getsource(test_the_oracle_always_wins) in doc
    # the third way's example: an environment on openenv-core's own server (test_openenv_interop.py)
    server = Path(__file__).with_name("openenv_side") / "serve_with_openenv_server.py"
    body = server.read_text().split('"""', 2)[2].strip()
    assert body in doc
