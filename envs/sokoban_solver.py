"""Optimal Sokoban oracle: the shortest sequence of *actions* (moves and pushes alike) to solve.

The episode budget counts actions, so the search minimises actions, not pushes: a breadth-first
search over ``(player, boxes)`` positions, one layer per action. Two cheap prunings keep it fast
without losing optimality:

- *dead squares*: a box pushed onto a cell from which no sequence of pushes (ignoring other boxes)
  can bring it to any target makes the position unsolvable, so that push is never expanded;
- the goal test runs when a child is generated, saving the last layer.

Used by the generator (to bound solution length), by the tests, and to make SFT demonstrations.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envs.sokoban_state import ACTIONS, SokobanState


def _as_state(env_or_state: Any) -> SokobanState:
    if isinstance(env_or_state, SokobanState):
        return env_or_state
    if isinstance(env_or_state, tuple) and len(env_or_state) == 2:
        room_fixed, room_state = env_or_state
        return SokobanState.from_arrays(np.asarray(room_fixed), np.asarray(room_state))
    state = getattr(env_or_state, "state", None)
    if isinstance(state, SokobanState):
        return state
    raise TypeError(
        "solve() takes a SokobanEnv, a SokobanState or a (room_fixed, room_state) pair of arrays, "
        f"not {type(env_or_state).__name__}"
    )


def live_squares(state: SokobanState) -> bytearray:
    """1 for each cell from which a lone box can still be pushed onto some target.

    Computed backwards from the targets: a box at ``y`` can have come from ``x = y - o`` when the
    player had room to stand at ``x - o``.
    """
    w, floor = state.width, state.floor
    live = bytearray(len(floor))
    todo = list(state.targets)
    for t in todo:
        live[t] = 1
    while todo:
        y = todo.pop()
        for o in (-w, w, -1, 1):
            x = y - o
            if floor[x] and not live[x] and floor[x - o]:
                live[x] = 1
                todo.append(x)
    return live


def solve(env_or_state: Any, max_depth: int = 100) -> list[str] | None:
    """Shortest action sequence (``"Up"``, ...) from the current position to solved, or None when
    none exists within ``max_depth`` actions. ``[]`` if the position is already solved.

    ``env_or_state``: a :class:`~envs.sokoban.SokobanEnv`, a :class:`~envs.sokoban.SokobanState`, or
    gym_sokoban's ``(room_fixed, room_state)`` arrays.
    """
    state = _as_state(env_or_state)
    targets = frozenset(state.targets)
    if set(state.boxes) == targets:
        return []
    w, floor, n = state.width, state.floor, len(state.floor)
    live = live_squares(state)
    if not all(live[b] for b in state.boxes):
        return None
    offsets = (-w, w, -1, 1)

    def key_of(player: int, boxes: tuple[int, ...]) -> int:
        k = player
        for b in boxes:
            k = k * n + b
        return k

    start_key = key_of(state.player, state.boxes)
    parent: dict[int, tuple[int, int]] = {start_key: (-1, -1)}
    frontier: list[tuple[int, tuple[int, ...], int]] = [(state.player, state.boxes, start_key)]
    for _ in range(max_depth):
        nxt: list[tuple[int, tuple[int, ...], int]] = []
        for p, boxes, k in frontier:
            for a, o in enumerate(offsets):
                q = p + o
                if not floor[q]:
                    continue
                if q in boxes:
                    r = q + o
                    if not floor[r] or not live[r] or r in boxes:
                        continue
                    new_boxes = tuple(sorted(r if b == q else b for b in boxes))
                    nk = key_of(q, new_boxes)
                    if nk in parent:
                        continue
                    parent[nk] = (k, a)
                    if targets.issuperset(new_boxes):
                        return _path(parent, nk)
                    nxt.append((q, new_boxes, nk))
                else:
                    nk = key_of(q, boxes)
                    if nk in parent:
                        continue
                    parent[nk] = (k, a)
                    nxt.append((q, boxes, nk))
        if not nxt:
            return None
        frontier = nxt
    return None


def _path(parent: dict[int, tuple[int, int]], key: int) -> list[str]:
    actions: list[str] = []
    k, a = parent[key]
    while a >= 0:
        actions.append(ACTIONS[a])
        k, a = parent[k]
    actions.reverse()
    return actions
