"""Same seed, same episode: in this process and in a freshly spawned one (another hash seed)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import envs

ROOT = Path(__file__).resolve().parents[2]
TAGS = [
    "SimpleSokoban",
    "LargerSokoban",
    "SokobanNewVocab",
    "FrozenLake",
    "Bandit",
    "BanditTest",
    "Countdown",
    "MathQA",
]
N_SEEDS = 200


def scripted_actions(env: envs.Env, seed: int, budget: int) -> list[str]:
    """A fixed, seed-dependent script: cycles the action vocabulary, or a fixed free-text answer."""
    if env.actions:
        return [env.actions[(seed * 7 + 3 * i) % len(env.actions)] for i in range(budget)]
    return [getattr(env, "solution", None) or "1 + 2", "42"][:budget]


def fingerprint(tag: str, seeds: list[int]) -> str:
    """Digest of every initial render and every step of the scripted episode for each seed."""
    env = envs.make(tag)
    budget = env.spec.max_actions_per_traj
    h = hashlib.sha256()
    for seed in seeds:
        h.update(env.reset(seed).encode())
        for action in scripted_actions(env, seed, budget):
            r = env.step(action)
            h.update(
                json.dumps(
                    [action, r.observation, r.reward, r.done, sorted(r.info.items())], default=str
                ).encode()
            )
            if r.done:
                break
    return h.hexdigest()


def test_fingerprints_match_in_a_fresh_process() -> None:
    seeds = list(range(N_SEEDS))
    here = {tag: fingerprint(tag, seeds) for tag in TAGS}
    code = (
        "import json; from tests.envs.test_determinism import fingerprint, TAGS;"
        f"print(json.dumps({{t: fingerprint(t, list(range({N_SEEDS}))) for t in TAGS}}))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    there = json.loads(out.stdout.strip().splitlines()[-1])
    assert there == here


@pytest.mark.parametrize("tag", TAGS)
def test_seeds_give_different_states(tag: str) -> None:
    env = envs.make(tag)
    states = {env.reset(seed) for seed in range(50)}
    # Bandit has only two initial states (the arm order); everything else varies a lot.
    assert len(states) >= (2 if tag.startswith("Bandit") else 25)


@pytest.mark.parametrize("tag", TAGS)
def test_reset_does_not_touch_global_rng(tag: str) -> None:
    import random

    import numpy as np

    random.seed(0)
    np.random.seed(0)
    a = (random.random(), np.random.rand())
    random.seed(0)
    np.random.seed(0)
    env = envs.make(tag)
    env.reset(7)
    for action in scripted_actions(env, 7, 3):
        if env.step(action).done:
            break
    assert (random.random(), np.random.rand()) == a
