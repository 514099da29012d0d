"""FrozenLake: maps, gymnasium-exact dynamics, render symbols, the oracle, speed.

See docs/architecture.md, "Environment API".
"""

from __future__ import annotations

import itertools
from collections import Counter, deque

import gymnasium
import numpy as np
import pytest

import envs
from envs.frozen_lake import ACTIONS, FrozenLakeEnv, optimal_policy, policy_action, solve
from envs.frozen_lake_maps import clear_caches, generate_map, has_path

BUDGET = 10


def reachable(desc: list[str]) -> bool:
    """Independent BFS: a 4-connected hole-free path from S to G."""
    n, m = len(desc), len(desc[0])
    cells = {(r, c): desc[r][c] for r in range(n) for c in range(m)}
    start = next(k for k, v in cells.items() if v == "S")
    queue, seen = deque([start]), {start}
    while queue:
        r, c = queue.popleft()
        if cells[(r, c)] == "G":
            return True
        for nb in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if nb in cells and nb not in seen and cells[nb] != "H":
                seen.add(nb)
                queue.append(nb)
    return False


def ragen_map(size: int, p: float, seed: int) -> list[str]:
    """RAGEN's generator, numpy call for call (the reference our faster generator must equal)."""
    rng = np.random.default_rng(seed)
    while True:
        board = rng.choice(["F", "H"], (size, size), p=[p, 1 - p])
        while True:
            start_r, start_c = rng.integers(0, size), rng.integers(0, size)
            goal_r, goal_c = rng.integers(0, size), rng.integers(0, size)
            if (start_r, start_c) != (goal_r, goal_c):
                break
        board[start_r][start_c] = "S"
        board[goal_r][goal_c] = "G"
        desc = ["".join(row) for row in board.tolist()]
        if reachable(desc):
            return desc


def gym_env(desc: list[str], is_slippery: bool = True) -> gymnasium.Env:
    return gymnasium.make("FrozenLake-v1", desc=desc, is_slippery=is_slippery).unwrapped


def test_every_map_has_a_path_and_distinct_start_and_goal() -> None:
    env = envs.make("FrozenLake")
    for seed in range(500):
        state = env.reset(seed)
        desc = env.desc
        flat = "".join(desc)
        assert len(desc) == 4 and all(len(row) == 4 for row in desc)
        assert set(flat) <= set("SFHG") and flat.count("S") == 1 and flat.count("G") == 1
        assert flat.index("S") != flat.index("G") == min(env.goal_states)
        assert reachable(desc), (seed, desc)
        assert state.count("P") == 1 and state.index("P") == flat.index("S") + flat.index("S") // 4
        assert generate_map(4, 0.8, seed) == desc
    # The map depends on the seed.
    assert len({tuple(generate_map(4, 0.8, s)) for s in range(50)}) > 40


@pytest.mark.parametrize(
    ("size", "p", "seeds"),
    [
        (4, 0.8, 3000),
        (2, 0.8, 300),
        (3, 0.5, 500),
        (5, 0.95, 300),
        (6, 0.8, 300),
        (7, 0.3, 200),
        (8, 1.0, 100),
    ],
)
def test_maps_equal_ragens_numpy_calls(size: int, p: float, seeds: int) -> None:
    """The generator redoes numpy's ``choice``/``integers`` arithmetic on the raw stream: same maps."""
    clear_caches()
    for seed in range(seeds):
        assert generate_map(size, p, seed) == ragen_map(size, p, seed), (size, p, seed)


def test_has_path_equals_bfs_on_random_boards() -> None:
    rng = np.random.default_rng(0)
    for _ in range(3000):
        rows, cols = (int(x) for x in rng.integers(1, 7, size=2))
        cells = rng.choice(list("FFFHG"), size=rows * cols).tolist()
        cells[int(rng.integers(rows * cols))] = "S"
        desc = ["".join(cells[r * cols : (r + 1) * cols]) for r in range(rows)]
        assert has_path(desc) == reachable(desc), desc


def test_caches_and_shared_maps_change_nothing() -> None:
    """Maps and map data are cached and shared between envs; episodes must not notice."""

    def script(seed: int, k: int) -> list[str]:
        return [ACTIONS[(seed + k * i + i * i) % 4] for i in range(45)]  # 45: past a raw-output block

    def alone(seed: int, actions: list[str]) -> list[object]:
        env = FrozenLakeEnv()
        return [env.reset(seed), *((env.step(a), env.state, env.done) for a in actions)]

    clear_caches()
    cold = {(seed, k): alone(seed, script(seed, k)) for seed in range(40) for k in (1, 2)}
    assert cold == {(seed, k): alone(seed, script(seed, k)) for seed in range(40) for k in (1, 2)}
    clear_caches()
    a, b = FrozenLakeEnv(), FrozenLakeEnv()  # a group: same seed, one shared map, interleaved steps
    for seed in range(40):
        got_a, got_b = [a.reset(seed)], [b.reset(seed)]
        assert a.desc is b.desc
        for x, y in zip(script(seed, 1), script(seed, 2), strict=True):
            got_a.append((a.step(x), a.state, a.done))
            got_b.append((b.step(y), b.state, b.done))
        assert (got_a, got_b) == (cold[seed, 1], cold[seed, 2])
    env = FrozenLakeEnv()
    env.reset(3)
    first = env.transition_table()
    first[0][0].clear()  # a copy: the cached table is untouched
    assert env.transition_table() == gym_env(env.desc).P


@pytest.mark.parametrize("is_slippery", [True, False])
def test_transition_table_equals_gymnasium(is_slippery: bool) -> None:
    env = FrozenLakeEnv(is_slippery=is_slippery)
    for seed in range(50):
        env.reset(seed)
        ours, theirs = env.transition_table(), gym_env(env.desc, is_slippery).P
        assert ours.keys() == theirs.keys()
        for s in theirs:
            for a in range(4):
                assert ours[s][a] == theirs[s][a], (seed, s, a)


def test_trajectories_equal_gymnasium_with_the_same_seed() -> None:
    """Same map and same slip stream: a seed and an action sequence give gymnasium's trajectory."""
    env = envs.make("FrozenLake")
    rng = np.random.default_rng(123)
    for seed in range(100):
        env.reset(seed)
        ref = gym_env(env.desc)
        s, _ = ref.reset(seed=seed)
        assert s == env.state
        for _ in range(40):  # past the first batch of pre-drawn uniforms
            a = int(rng.integers(4))
            s, r, terminated, _, _ = ref.step(a)
            res = env.step(ACTIONS[a])
            assert (env.state, res.reward, res.done) == (s, r, terminated)


def test_same_seed_same_episode_in_fresh_instances() -> None:
    a, b = FrozenLakeEnv(), FrozenLakeEnv()
    for seed in (0, 7, 31):
        assert a.reset(seed) == b.reset(seed)
        for i in range(BUDGET):
            ra, rb = a.step(ACTIONS[i % 4]), b.step(ACTIONS[i % 4])
            assert ra == rb


def test_render_symbols_and_infos() -> None:
    env = FrozenLakeEnv(is_slippery=False, desc=["SFG", "HFF", "FFF"])
    assert env.grid_vocab == {
        "P": "player",
        "_": "empty",
        "O": "hole",
        "G": "goal",
        "X": "player in hole",
        "√": "player on goal",
    }
    assert env.reset(0) == "P_G\nO__\n___"
    bump = env.step("Up")
    assert bump.observation == "P_G\nO__\n___" and not bump.done
    assert bump.info == {"success": False, "action_is_valid": True, "action_is_effective": False}
    move = env.step(" right ")
    assert move.observation == "_PG\nO__\n___" and move.reward == 0.0 and not move.done
    assert move.info["action_is_effective"]
    goal = env.step("RIGHT")
    assert goal.observation == "__\u221a\nO__\n___" and goal.reward == 1.0 and goal.done
    assert goal.info == {"success": True, "action_is_valid": True, "action_is_effective": True}
    absorbed = env.step("Left")  # goal is absorbing: nothing moves, nothing more is paid
    assert absorbed.observation == goal.observation and absorbed.reward == 0.0 and absorbed.done
    assert absorbed.info["success"] and not absorbed.info["action_is_effective"]

    env.reset(1)
    hole = env.step("Down")
    assert hole.observation == "__G\nX__\n___" and hole.done and hole.reward == 0.0
    assert hole.info == {"success": False, "action_is_valid": True, "action_is_effective": True}
    stuck = env.step("Up")
    assert stuck.observation == hole.observation and stuck.done and not stuck.info["action_is_effective"]

    env.reset(2)
    bad = env.step("Jump")
    assert bad.observation == "P_G\nO__\n___" and bad.reward == 0.0 and not bad.done
    assert bad.info == {"success": False, "action_is_valid": False, "action_is_effective": False}


def test_map_seed_fixes_the_map() -> None:
    env = envs.make("FrozenLake", map_seed=11)
    maps = set()
    for seed in range(20):
        env.reset(seed)
        maps.add(tuple(env.desc))
    assert maps == {tuple(generate_map(4, 0.8, 11))}


def test_slips_are_one_third_each() -> None:
    """Intended Down from the centre of an open 5x5 lake: Down, Left, Right about 1/3 each."""
    env = FrozenLakeEnv(desc=["FFFFF", "FFFFF", "FFSFF", "FFFFF", "FFFFG"])
    n = 3000
    counts: Counter[int] = Counter()
    for seed in range(n):
        env.reset(seed)
        env.step("Down")
        counts[env.state] += 1
    centre = 2 * 5 + 2
    assert set(counts) == {centre + 5, centre - 1, centre + 1}
    for state in counts:
        assert abs(counts[state] / n - 1 / 3) < 0.035, counts


def run_oracle_episode(env: FrozenLakeEnv, seed: int) -> tuple[bool, float]:
    """One budgeted episode of the oracle's policy; returns (success, its computed probability)."""
    env.reset(seed)
    table, prob = optimal_policy(env, horizon=BUDGET)
    res = None
    for steps_left in range(BUDGET, 0, -1):
        res = env.step(ACTIONS[policy_action(table, env.state, steps_left)])
        if res.done:
            break
    assert res is not None
    return bool(res.info["success"]), prob


def test_oracle_success_matches_its_computed_probability() -> None:
    env = envs.make("FrozenLake")
    results = [run_oracle_episode(env, seed) for seed in range(2000)]
    measured = np.mean([ok for ok, _ in results])
    computed = np.mean([p for _, p in results])
    print(f"oracle success over 2000 episodes: measured {measured:.4f}, computed {computed:.4f}")
    assert abs(measured - computed) < 0.03
    assert 0.3 < computed < 0.8


def test_oracle_value_iteration_properties() -> None:
    # Deterministic corridor: the goal is 4 moves away, so success is certain with >= 4 actions only.
    corridor = ["SFFFG"]
    for horizon, expected in ((3, 0.0), (4, 1.0), (10, 1.0)):
        table, prob = optimal_policy(corridor, horizon=horizon, is_slippery=False)
        assert prob == expected and len(table) == horizon
    table, _ = optimal_policy(corridor, horizon=10, is_slippery=False)
    assert [ACTIONS[policy_action(table, s, 10)] for s in range(4)] == ["Right"] * 4

    env = envs.make("FrozenLake")
    for seed in range(30):
        env.reset(seed)
        probs = [optimal_policy(env, horizon=h)[1] for h in (1, 5, 10, 20)]
        assert all(0.0 <= x <= y + 1e-12 <= 1.0 + 1e-12 for x, y in itertools.pairwise(probs))
        table, unbounded = optimal_policy(env, horizon=None, gamma=0.99)
        assert len(table) == 1 and unbounded >= probs[2] - 1e-9
        best = optimal_policy(env)[0]
        act = solve(env, budget=BUDGET)
        for steps_left in range(BUDGET, 0, -1):
            expected = ACTIONS[policy_action(best, env.state, steps_left)]
            assert act(steps_left) == env.oracle_action(steps_left) == expected
            if env.step(expected).done:
                break
    with pytest.raises(ValueError):
        optimal_policy(env, horizon=None, gamma=1.0)
