"""An environment served by openenv-core's own server: guess a number from 0 to 9 drawn from the seed,
told "higher" or "lower" (deterministic per seed).

Usage: python serve_with_openenv_server.py PORT
"""

from __future__ import annotations

import random
import sys
import uuid
from typing import Any

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    text: str


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self._target = 0

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._target = random.Random(seed).randrange(10)
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return GuessObservation(text="Guess a number from 0 to 9.", done=False, reward=None)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        try:
            guess = int(action.message.strip())
        except ValueError:
            return GuessObservation(text=f"{action.message!r} is not a number.", done=False, reward=0.0)
        if guess == self._target:
            return GuessObservation(text="Right!", done=True, reward=1.0)
        hint = "higher" if guess < self._target else "lower"
        return GuessObservation(text=f"{guess}: {hint}.", done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnv, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
