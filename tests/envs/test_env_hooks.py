"""The environments' own hooks: ``oracle_actions``, ``think_text``, ``random_answer``, ``success_means``.

The warm start builds its demonstrations from these hooks, so their outputs are pinned exactly: every
built-in tag is played over a few seeds and each hook's output (and, for ``random_answer``, how many
draws it took from the generator) is compared with ``env_hooks_golden.json``. That file was recorded by
:func:`record` from the functions the hooks replaced (the ``kind ==`` switches of ``envs.oracles`` and
``ragen_core.learner.sft``): a change there changes the demonstrations, hence every warm-started run, so the
file is a specification, not a snapshot to refresh.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

import envs
from envs.base import Env, NoOracleError, StepResult
from envs.oracles import oracle_actions

GOLDEN = Path(__file__).with_name("data") / "env_hooks_golden.json"
TAGS = ["SimpleSokoban", "LargerSokoban", "SokobanNewVocab", "FrozenLake", "Bandit", "BanditTest"]
TAGS += ["Countdown", "MathQA"]
SEEDS = range(4)
#: (max_actions, turns_left) pairs asked of the oracle at every turn
ORACLE_ASKS = [(5, 5), (3, 1), (1, 2), (10, 1), (0, 1)]
#: oracle plans handed to random_answer besides the real one: none, an integer, a decimal, no number
PLANS: dict[str, list[str]] = {"empty": [], "int": ["42"], "float": ["2.5"], "text": ["x+1", "y"]}

Oracle = Callable[[Env, int, int, int], list[str]]
Think = Callable[[Env, Sequence[str]], str]
Random = Callable[[Env, list[str], int, random.Random], list[str]]


def _turn(env: Env, seed: int, turn: int, actions_left: int, hooks: tuple[Oracle, Think, Random]) -> dict:
    """Every hook's output in the current state (random answers with the next draw after them)."""
    oracle, think, rand = hooks
    rec: dict[str, Any] = {"actions_left": actions_left}
    for max_actions, turns_left in ORACLE_ASKS:
        rec[f"oracle/{max_actions}/{turns_left}"] = oracle(env, actions_left, max_actions, turns_left)
    plan = oracle(env, actions_left, 5, 5 - turn)
    rec["think/plan"] = think(env, plan)
    rec["think/empty"] = think(env, [])
    rec["think/odd"] = think(env, [" Up ", "Left"])
    rec["think/each"] = [think(env, [a]) for a in env.actions or []]
    for cap in (1, 3, 5):
        for name, p in {"plan": plan, **PLANS}.items():
            rng = random.Random(seed * 1000 + cap)
            rec[f"random/{cap}/{name}"] = [rand(env, list(p), cap, rng), rng.random()]
    return rec


def record(oracle: Oracle, think: Think, rand: Random) -> list[dict]:
    """Play every tag over ``SEEDS``; a turn takes the oracle's plan, every third one a random answer."""
    out = []
    for tag in TAGS:
        env = envs.make(tag)
        for seed in SEEDS:
            env.reset(seed)
            actions_left = env.spec.max_actions_per_traj  # type: ignore[attr-defined]
            turns = []
            for turn in range(5):
                turns.append(_turn(env, seed, turn, actions_left, (oracle, think, rand)))
                plan = oracle(env, actions_left, 5, 5 - turn)
                cap = max(1, min(5, actions_left))
                use_plan = (turn + seed) % 3 and plan
                chosen = plan if use_plan else rand(env, plan, cap, random.Random(seed + turn))
                results = [env.step(a) for a in chosen[:actions_left]]
                actions_left -= len(results)
                if any(r.done for r in results) or actions_left <= 0:
                    break
            out.append({"tag": tag, "seed": seed, "turns": turns})
    return out


def test_hooks_reproduce_the_recorded_outputs_of_every_builtin_env() -> None:
    got = record(
        oracle_actions,
        lambda env, actions: env.think_text(actions),
        lambda env, plan, cap, rng: env.random_answer(plan, cap, rng),
    )
    want = json.loads(GOLDEN.read_text())
    assert [(r["tag"], r["seed"]) for r in got] == [(r["tag"], r["seed"]) for r in want]
    for g, w in zip(got, want, strict=True):
        assert g == w, f"{g['tag']} seed {g['seed']}"


# Readable spot checks of the same behaviour -----------------------------------------------------
def test_think_text_describes_the_state() -> None:
    sokoban = envs.make("SimpleSokoban")
    sokoban.reset(0)
    assert sokoban.think_text(["Up"]) == "Player (1,2), box (2,2), target (4,4). I should go Up."
    larger = envs.make("LargerSokoban")
    larger.reset(0)
    want = "Player (4,2), boxes (3,3) and (4,4), targets (2,3) and (4,6). I should go Left."
    assert larger.think_text(["Left", "Up"]) == want
    lake = envs.make("FrozenLake")
    lake.reset(0)
    assert lake.think_text(["Left", "Up"]) == "Player (0,3), goal (0,2). I should go Left."
    bandit = envs.make("Bandit")
    bandit.reset(0)
    assert (
        bandit.think_text([" dragon "])
        == "Dragon sounds bold and may pay more than Phoenix, so I pick Dragon."
    )
    assert bandit.think_text(["Phoenix"]) == "Phoenix sounds safe and steady, so I pick Phoenix."
    countdown = envs.make("Countdown")
    countdown.reset(0)
    assert countdown.think_text(["1 + 2"]) == "Target 7, nums [98, 54, 6, 34]. I try 1 + 2."
    mathqa = envs.make("MathQA")
    mathqa.reset(0)
    assert mathqa.think_text(["12"]) == "The answer is 12."
    assert mathqa.think_text([]) == "The answer is ."


def test_frozenlake_think_text_names_the_holes_next_to_the_player() -> None:
    """``think_holes``: the moves that would fall into a hole, in action order; the board's edge is
    not a hole, and the default text (the golden file's) is unchanged."""
    rows = ["SFH", "HFF", "HFG"]
    lake = envs.make("FrozenLake", desc=rows, is_slippery=False, think_holes=True)
    lake.reset(0)
    assert lake.think_text(["Right"]) == "Player (0,0), goal (2,2). Holes: Down. I should go Right."
    lake.step("Right")
    assert lake.think_text(["Down"]) == "Player (0,1), goal (2,2). Holes: Right. I should go Down."
    lake.step("Down")
    assert lake.think_text(["Left"]) == "Player (1,1), goal (2,2). Holes: Left. I should go Left."
    lake.step("Right")
    assert lake.think_text(["Down"]) == "Player (1,2), goal (2,2). Holes: Up. I should go Down."
    assert lake.hole_moves() == [3]  # Up, as an index into ACTIONS
    open_lake = envs.make("FrozenLake", desc=["SF", "FG"], is_slippery=False, think_holes=True)
    open_lake.reset(0)
    assert open_lake.think_text(["Down"]) == "Player (0,0), goal (1,1). Holes: none. I should go Down."
    plain = envs.make("FrozenLake", desc=rows, is_slippery=False)
    plain.reset(0)
    assert plain.think_text(["Right"]) == "Player (0,0), goal (2,2). I should go Right."
    with pytest.raises(RuntimeError, match="before reset"):
        envs.make("FrozenLake", think_holes=True).hole_moves()


def test_random_answer_draws_in_a_fixed_order() -> None:
    lake = envs.make("FrozenLake")
    lake.reset(0)
    rng, ref = random.Random(7), random.Random(7)
    assert lake.random_answer(["Up", "Up"], 5, rng) == [ref.choice(lake.actions), ref.choice(lake.actions)]
    k = ref.randint(1, 3)  # no plan: 1..min(3, cap) actions
    assert lake.random_answer([], 5, rng) == [ref.choice(lake.actions) for _ in range(k)]
    mathqa = envs.make("MathQA")
    mathqa.reset(0)
    assert mathqa.random_answer(["40"], 1, rng) == [str(40 + ref.choice([-3, -2, -1, 1, 2, 3]))]
    assert mathqa.random_answer(["x"], 1, rng) == ["x"]  # no number to perturb: the plan itself
    assert mathqa.random_answer([], 1, rng) == [str(ref.randint(0, 100))]
    countdown = envs.make("Countdown")
    countdown.reset(0)
    (expr,) = countdown.random_answer(["unused"], 1, rng)
    assert sorted(int(t) for t in expr.split()[::2]) == sorted(countdown.nums)


def test_oracle_entry_point_caps_the_turn() -> None:
    sokoban = envs.make("SimpleSokoban")
    sokoban.reset(0)
    assert oracle_actions(sokoban, 10, 10, 1) == ["Down", "Down", "Left", "Down", "Right", "Right"]
    assert oracle_actions(sokoban, 10, 2, 5) == ["Down", "Down"]
    assert oracle_actions(sokoban, 3, 5, 1) == []  # no solution within 3 actions
    assert oracle_actions(sokoban, 0, 5, 1) == []


class Silent(Env):
    """An environment that implements only the abstract methods: no oracle, default hooks."""

    def __init__(self) -> None:
        self.actions = ["a", "b"]

    def reset(self, seed: int) -> str:
        return "state"

    def step(self, action: str) -> StepResult:
        return StepResult(
            "state", 0.0, True, {"success": False, "action_is_valid": True, "action_is_effective": True}
        )

    def render(self) -> str:
        return "state"


def test_defaults_of_an_env_without_hooks() -> None:
    env = Silent()
    with pytest.raises(NoOracleError, match="'Silent' has no oracle"):
        oracle_actions(env, 3, 5, 1)
    assert oracle_actions(env, 0, 5, 1) == []  # nothing left to do: no oracle needed
    assert env.think_text(["b"]) == "The answer is b."
    assert env.random_answer(["a"], 1, random.Random(0)) in (["a"], ["b"])
    assert env.success_means


@pytest.mark.parametrize("tag", TAGS)
def test_every_builtin_env_says_what_success_means(tag: str) -> None:
    cls = type(envs.make(tag))
    assert cls.success_means is not Env.success_means
    assert cls.success_means.endswith(".") and cls.success_means[0].islower()


def test_frozenlake_coordinates_name_the_goal_the_player_and_the_holes_under_the_grid():
    """``coordinates``: RAGEN's grid-plus-coordinates observation, zero-indexed (row, column)."""
    lake = envs.make("FrozenLake", desc=["SFH", "FHF", "FFG"], is_slippery=False, coordinates=True)
    first = lake.reset(0)
    grid, extra = first.split("\nBoard size")
    assert grid == envs.make("FrozenLake", desc=["SFH", "FHF", "FFG"], is_slippery=False).reset(0)
    assert extra.splitlines() == [
        ": 3 rows x 3 cols (zero-indexed).",
        "Goal: (2, 2)",
        "Player: (0, 0)",
        "Holes: (0, 2), (1, 1)",
    ]
    assert lake.step("Down").observation.endswith("Player: (1, 0)\nHoles: (0, 2), (1, 1)")
    assert "Player in hole: (1, 1)" in lake.step("Right").observation


def test_frozenlake_directions_give_the_goal_and_the_holes_as_moves_from_the_player():
    """``directions``: the goal as counts of moves and the neighbouring holes as moves, recomputed each step;
    the grid above them and the dynamics are RAGEN's."""
    desc = ["SFH", "FHF", "FFG"]
    lake = envs.make("FrozenLake", desc=desc, is_slippery=False, directions=True)
    plain = envs.make("FrozenLake", desc=desc, is_slippery=False)
    first = lake.reset(0)
    assert first.splitlines()[:3] == plain.reset(0).splitlines()
    assert first.splitlines()[3:] == ["Goal: 2 Down, 2 Right.", "Holes next to you: none."]
    step = lake.step("Down")
    assert step.observation.splitlines()[3:] == ["Goal: 1 Down, 2 Right.", "Holes next to you: Right."]
    assert step.observation.splitlines()[:3] == plain.step("Down").observation.splitlines()
    assert lake.step("Right").observation.endswith("\nYou fell into a hole.")
    lake.reset(0)
    for move in ["Down", "Down", "Right"]:
        lake.step(move)
    assert lake.step("Right").observation.endswith("\nGoal: reached.") and lake.success
    goal_above = envs.make("FrozenLake", desc=["FG", "SH"], is_slippery=False, directions=True)
    assert goal_above.reset(0).splitlines()[2:] == ["Goal: 1 Up, 1 Right.", "Holes next to you: Right."]


def test_sokoban_directions_give_the_box_the_target_and_the_walls_as_moves():
    """``directions``: the box as moves from the player, the target as moves from the box and the walls next to
    the player, recomputed each step; the grid above them and the dynamics are RAGEN's."""
    from envs.sokoban_state import SokobanState

    floor = bytes(1 if 0 < r < 4 and 0 < c < 4 else 0 for r in range(5) for c in range(5))
    room = SokobanState(
        5, 5, floor, targets=(18,), boxes=(12,), player=6
    )  # player (1,1), box (2,2), target (3,3)
    sokoban, plain = envs.make("SimpleSokoban", directions=True), envs.make("SimpleSokoban")
    sokoban.set_state(room)
    plain.set_state(room)
    first = sokoban.render().splitlines()
    assert first[:5] == plain.render().splitlines()
    assert first[5:] == [
        "Box: 1 Down, 1 Right.",
        "Target: 1 Down, 1 Right from the box.",
        "Walls next to you: Up Left.",
    ]
    sokoban.step("Right")
    assert sokoban.step("Down").observation.splitlines()[5:] == [
        "Box: 1 Down.",
        "Target: 1 Right from the box.",
        "Walls next to you: none.",
    ]
    for move in ["Left", "Down"]:
        sokoban.step(move)
    solved = sokoban.step("Right")
    assert solved.observation.endswith("\nThe box is on the target.") and solved.info["success"]
    with pytest.raises(ValueError, match="num_boxes: 1"):
        envs.make("SimpleSokoban", num_boxes=2, directions=True)
    for tag in ("SimpleSokoban", "FrozenLake"):
        with pytest.raises(ValueError, match="directions must be true or false, got 'false'"):
            envs.make(tag, directions="false")


@pytest.mark.parametrize(
    ("tag", "kwargs"),
    [("FrozenLake", {"desc": ["SFH", "FHF", "FFG"], "is_slippery": False}), ("SimpleSokoban", {})],
)
def test_cell_separator_puts_one_between_the_cells_of_each_row_and_nothing_else_changes(tag, kwargs):
    """``cell_separator: " "``: ``_ _ O`` rows (a BPE tokenizer merges ``__O``-like runs into tokens that hide
    the columns); the default is RAGEN's rendering, and the dynamics are the same step for step."""
    plain, spaced = envs.make(tag, **kwargs), envs.make(tag, cell_separator=" ", **kwargs)
    for obs, spaced_obs in [(plain.reset(3), spaced.reset(3))] + [
        (plain.step(a).observation, spaced.step(a).observation) for a in ("Down", "Right", "Up", "Left")
    ]:
        assert spaced_obs.splitlines() == [" ".join(row) for row in obs.splitlines()]
        assert all(len(row) == 2 * len(obs.splitlines()[0]) - 1 for row in spaced_obs.splitlines())
    with pytest.raises(ValueError, match="cell_separator"):
        envs.make(tag, cell_separator="\n", **kwargs)
