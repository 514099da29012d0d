"""Environment throughput against the reference packages, measured in the same run.

- Sokoban room generation (rooms per second) of ``envs.sokoban.generate_room`` vs ``gym_sokoban``'s
  ``room_utils.generate_room`` (PyPI ``gym-sokoban==0.0.6``, the generator RAGEN's is adapted from),
  with the same room size, box count and number of walk steps; plus how hard the rooms are (mean
  optimal solution length in actions, both solved by ``envs.sokoban_solver.solve``), because a fast
  generator of trivial rooms would be no win.
- FrozenLake steps per second (random actions, a reset whenever an episode ends or reaches 100 steps)
  of ``envs.make("FrozenLake")`` vs gymnasium's ``FrozenLake-v1``.

Usage: ``python benchmarks/envs.py [--quick]``. The last lines read
``BENCH <name> ratio=<ours/reference> target=>=<y> PASS|MISS``.

gym_sokoban's package ``__init__`` imports the old ``gym``; its ``room_utils`` needs only numpy, so
it is loaded straight from its file and ``gym`` is not needed (install with
``pip install --no-deps gym-sokoban==0.0.6``). Its generator has no search-depth argument (the DFS
depth is fixed at 300); for the LargerSokoban setting (depth 10) the benchmark wraps its DFS to cap
the depth, which is the same change RAGEN made to its copy.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import envs
from envs import frozen_lake_maps
from envs.sokoban import SokobanState, generate_room
from envs.sokoban_solver import solve

Result = tuple[str, float, float]
"""(headline name, ours / reference, target ratio)"""


def load_gym_room_utils() -> ModuleType:
    """gym_sokoban's ``room_utils`` module, loaded from its file without the package's ``gym`` import."""
    spec = importlib.util.find_spec("gym_sokoban")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("gym-sokoban is not installed: pip install --no-deps gym-sokoban==0.0.6")
    path = os.path.join(next(iter(spec.submodule_search_locations)), "envs", "room_utils.py")
    mod_spec = importlib.util.spec_from_file_location("gym_sokoban_room_utils", path)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def cap_gym_depth(room_utils: ModuleType, depth: int) -> Callable[[], None]:
    """Make gym_sokoban's recursive DFS stop at ``depth`` (its ttl is hard-wired to 300); returns undo."""
    original = room_utils.depth_first_search

    def capped(*args: Any, **kwargs: Any) -> Any:
        if "ttl" in kwargs:
            kwargs["ttl"] = min(kwargs["ttl"], depth)
        elif len(args) >= 6:
            args = (*args[:5], min(args[5], depth), *args[6:])
        return original(*args, **kwargs)

    room_utils.depth_first_search = capped

    def undo() -> None:
        room_utils.depth_first_search = original

    return undo


def gym_rooms(
    room_utils: ModuleType, dim: tuple[int, int], num_boxes: int, n: int
) -> tuple[float, list[SokobanState]]:
    """``n`` rooms from gym_sokoban (seeding the global RNGs per room, as RAGEN does); rooms/s."""
    states: list[tuple[np.ndarray, np.ndarray]] = []
    seed = 0
    start = time.perf_counter()
    while len(states) < n:
        random.seed(seed)
        np.random.seed(seed)
        seed += 1
        try:
            fixed, state, _ = room_utils.generate_room(
                dim=dim, num_steps=int(1.7 * sum(dim)), num_boxes=num_boxes
            )
        except (RuntimeError, RuntimeWarning):
            continue  # RAGEN reseeds and tries again; the failed attempt's time counts
        states.append((fixed, state))
    elapsed = time.perf_counter() - start
    return n / elapsed, [SokobanState.from_arrays(f, s) for f, s in states]


def our_rooms(dim: tuple[int, int], num_boxes: int, depth: int, n: int) -> tuple[float, list[SokobanState]]:
    start = time.perf_counter()
    states = [generate_room(seed, dim, num_boxes, depth) for seed in range(n)]
    return n / (time.perf_counter() - start), states


def mean_solution_length(states: list[SokobanState]) -> tuple[float, int]:
    """Mean optimal solution length in actions, and how many rooms the solver could not solve."""
    lengths, unsolved = [], 0
    for state in states:
        actions = solve(state, max_depth=500)
        if actions is None:
            unsolved += 1
        else:
            lengths.append(len(actions))
    return statistics.fmean(lengths), unsolved


def bench_sokoban(
    room_utils: ModuleType,
    name: str,
    dim: tuple[int, int],
    num_boxes: int,
    depth: int,
    n_gym: int,
    n_ours: int,
) -> list[Result]:
    undo = cap_gym_depth(room_utils, depth) if depth != 300 else (lambda: None)
    try:
        gym_rate, gym_states = gym_rooms(room_utils, dim, num_boxes, n_gym)
    finally:
        undo()
    our_rate, our_states = our_rooms(dim, num_boxes, depth, n_ours)
    gym_len, gym_unsolved = mean_solution_length(gym_states)
    our_len, our_unsolved = mean_solution_length(our_states)
    print(
        f"sokoban {name}: {dim[0]}x{dim[1]}, {num_boxes} box(es), search depth {depth}\n"
        f"  gym_sokoban  {gym_rate:10.1f} rooms/s  ({n_gym} rooms)   mean optimal length {gym_len:5.2f}"
        f"  unsolved {gym_unsolved}\n"
        f"  ragen-flow   {our_rate:10.1f} rooms/s  ({n_ours} rooms)   mean optimal length {our_len:5.2f}"
        f"  unsolved {our_unsolved}"
    )
    return [
        (f"sokoban_gen_{name}", our_rate / gym_rate, 2.0),
        (f"sokoban_hardness_{name}", our_len / gym_len, 1.0),
    ]


def steps_per_second(
    reset: Callable[[int], Any],
    step: Callable[[int], bool],
    n_steps: int,
    repeats: int = 3,
    prepare: Callable[[], None] = lambda: None,
) -> float:
    """Random actions (fixed sequence) with a reset when an episode ends or reaches 100 steps.

    Best of ``repeats`` runs: the machine's cores are shared, and the fastest run is the one least
    disturbed by other processes (the same rule for both sides). ``prepare`` runs before each run,
    untimed (ours empties its map caches, so every run sees only new maps, like the first).
    """
    actions = np.random.default_rng(0).integers(0, 4, size=n_steps).tolist()
    best = 0.0
    for _ in range(repeats):
        prepare()
        seed, t = 0, 0
        start = time.perf_counter()
        reset(seed)
        for a in actions:
            t += 1
            if step(a) or t == 100:
                seed += 1
                t = 0
                reset(seed)
        best = max(best, n_steps / (time.perf_counter() - start))
    return best


def bench_frozen_lake(n_steps: int) -> list[Result]:
    import gymnasium

    ours = envs.make("FrozenLake")
    names = list(ours.actions or [])
    # Every run replays seeds 0, 1, ...: without emptying the caches (maps by seed, map data by map)
    # runs 2 and 3 would only look maps up.
    ours_rate = steps_per_second(
        ours.reset, lambda a: ours.step(names[a]).done, n_steps, prepare=frozen_lake_maps.clear_caches
    )

    wrapped = gymnasium.make("FrozenLake-v1")

    def gym_step(a: int) -> bool:
        _, _, terminated, truncated, _ = wrapped.step(a)
        return terminated or truncated

    gym_rate = steps_per_second(lambda s: wrapped.reset(seed=s), gym_step, n_steps)

    core = gymnasium.make("FrozenLake-v1").unwrapped

    def core_step(a: int) -> bool:
        return core.step(a)[2]

    core_rate = steps_per_second(lambda s: core.reset(seed=s), core_step, n_steps)

    # RAGEN's own FrozenLake: gymnasium's class rebuilt on a new random map at every reset.
    from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv, generate_random_map

    ragen_style: list[Any] = [None]

    def ragen_reset(seed: int) -> None:
        ragen_style[0] = FrozenLakeEnv(desc=generate_random_map(size=4, p=0.8, seed=seed), is_slippery=True)
        ragen_style[0].reset(seed=seed)

    def ragen_step(a: int) -> bool:
        return ragen_style[0].step(a)[2]

    ragen_rate = steps_per_second(ragen_reset, ragen_step, n_steps)
    print(
        f"frozen_lake: {n_steps} random steps (best of 3 runs), reset at episode end or 100 steps\n"
        f"  gymnasium FrozenLake-v1 (gymnasium.make) {gym_rate:10.0f} steps/s   (fixed 4x4 map, int observations)\n"
        f"  gymnasium FrozenLakeEnv (unwrapped)      {core_rate:10.0f} steps/s\n"
        f"  gymnasium FrozenLakeEnv, new random map  {ragen_rate:10.0f} steps/s   (RAGEN's workload)\n"
        f"  ragen-flow FrozenLake                    {ours_rate:10.0f} steps/s   "
        "(a new random map per reset, text observations)"
    )
    return [("frozenlake_steps", ours_rate / gym_rate, 1.0)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small samples (about 15 s)")
    args = parser.parse_args()
    scale = 0.25 if args.quick else 1.0

    def n(count: int) -> int:
        return max(4, int(count * scale))

    room_utils = load_gym_room_utils()
    # The three catalogue settings (SimpleSokoban, SokobanNewVocab, LargerSokoban), then gym_sokoban's
    # own fixed depth 300 at 8x8 with 2 boxes.
    results = [
        *bench_sokoban(room_utils, "6x6_1box", (6, 6), 1, 300, n(400), n(2000)),
        *bench_sokoban(room_utils, "6x6_1box_depth30", (6, 6), 1, 30, n(400), n(2000)),
        *bench_sokoban(room_utils, "8x8_2box_depth10", (8, 8), 2, 10, n(600), n(2000)),
        *bench_sokoban(room_utils, "8x8_2box", (8, 8), 2, 300, n(60), n(600)),
        *bench_frozen_lake(n(40_000)),
    ]
    print()
    for name, ratio, target in results:
        print(f"BENCH {name} ratio={ratio:.2f} target=>={target:g} {'PASS' if ratio >= target else 'MISS'}")


if __name__ == "__main__":
    main()
