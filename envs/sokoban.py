"""Sokoban: a multi-turn, deterministic puzzle; push every box onto a target.

Dynamics, rewards and rendering follow RAGEN (which wraps ``gym_sokoban``; see
docs/architecture.md, "Environment API"): actions ``Up/Down/Left/Right`` are *push* actions (walk,
or push the box in front if the cell beyond it is free; never pull); each step costs 0.1, a box
pushed onto a target earns +1, off a target -1, and solving earns +10, so one box solved in ``n``
actions totals ``11 - 0.1 n``.

Rooms are generated from the seed alone, in the spirit of ``gym_sokoban``'s generator:

1. *Topology*: a random walk of ``int(1.7 (h + w))`` steps (turning with probability 0.35) stamps
   one of five 3x3 floor masks at each position; the border is wall.
2. *Placement*: the player, then each target, on a uniform free floor cell.
3. *Reverse play*: boxes start on their targets; a depth-first search (depth ``search_depth``,
   at most 300,000 states) moves the player and *pulls* any box it walks away from. Each state
   scores ``box_swaps x sum of box displacements`` (0 unless every target is uncovered); the best
   state becomes the puzzle, so it is solvable by construction. Up to 4 topologies per attempt.
4. *Player shuffle*: with probability 0.8 (box displaced by 1) else 0.5, the player walks 1-3 random
   steps, so it does not always start next to the box it last pulled.

Where we depart from the reference, and why (listed with the others in docs/architecture.md,
"Deliberate differences from RAGEN"):

- Each attempt draws from its own local ``random.Random`` seeded by a hash of ``(seed, attempt)``
  (``blake2b``, not Python's per-process ``hash``): a failed attempt retries with the next derived
  seed, so a seed gives the same room in every process, and the global RNG is never touched.
- The search runs on compact states (player index, tuple of box indices) with an explicit stack
  instead of copying numpy arrays per node: several times faster, same visiting order.
- ``max_solution_length`` (optional) rejects rooms whose optimal solution is longer than that many
  actions (checked with :func:`envs.sokoban_solver.solve`) and retries with the next derived seed.
  Set it to the tag's action budget so that every room can be solved within the budget; without it a
  6x6 room may need more actions than a 10-action episode allows.
- SokobanNewVocab's legend (``grid_vocab``) names the symbols actually drawn (item "Grid legend"
  there).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from envs.base import (
    Env,
    StepResult,
    cell_label,
    cell_separator_setting,
    invalid_step,
    moves_between,
    observation_flag,
    separate_cells,
)
from envs.sokoban_solver import solve
from envs.sokoban_state import (
    ACTIONS,
    CELL_MEANINGS,
    DEFAULT_GRID_LOOKUP,
    DIRECTIONS,
    SokobanState,
    render_room,
)

__all__ = [
    "ACTIONS",
    "CELL_MEANINGS",
    "DEFAULT_GRID_LOOKUP",
    "SokobanEnv",
    "SokobanState",
    "derive_seed",
    "generate_room",
]

# The five 3x3 floor masks of gym_sokoban, as (row, col) offsets from the walk position.
_MASKS: tuple[tuple[tuple[int, int], ...], ...] = (
    ((0, -1), (0, 0), (0, 1)),  # horizontal bar
    ((-1, 0), (0, 0), (1, 0)),  # vertical bar
    ((0, -1), (0, 0), (1, 0)),  # L-shape
    ((0, -1), (0, 0), (1, -1), (1, 0)),  # 2x2 block
    ((0, 0), (0, 1), (1, 0)),  # mirrored L-shape
)
_WALK_DIRECTIONS: tuple[tuple[int, int], ...] = ((1, 0), (0, 1), (-1, 0), (0, -1))
_P_CHANGE_DIRECTION = 0.35
_TOPOLOGY_TRIES = 4
_MAX_EXPLORED_STATES = 300_000
_MAX_ATTEMPTS = 1_000


# Generation ---------------------------------------------------------------------------------------
def derive_seed(seed: int, attempt: int) -> int:
    """The RNG seed of generation attempt ``attempt`` for ``seed``: the same in every process."""
    digest = hashlib.blake2b(f"ragen-flow/sokoban/{int(seed)}/{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _topology(rng: random.Random, h: int, w: int, num_steps: int) -> bytearray:
    """Random-walk floor plan (1 = floor) with a wall border."""
    level = bytearray(h * w)
    direction = rng.choice(_WALK_DIRECTIONS)
    r, c = rng.randint(1, h - 1), rng.randint(1, w - 1)
    for _ in range(num_steps):
        if rng.random() < _P_CHANGE_DIRECTION:
            direction = rng.choice(_WALK_DIRECTIONS)
        r = max(min(r + direction[0], h - 2), 1)
        c = max(min(c + direction[1], w - 2), 1)
        for dr, dc in rng.choice(_MASKS):
            level[(r + dr) * w + c + dc] = 1
    for c in range(w):
        level[c] = level[(h - 1) * w + c] = 0
    for r in range(h):
        level[r * w] = level[r * w + w - 1] = 0
    return level


def _reverse_play(
    floor: bytes | bytearray, w: int, targets: Sequence[int], player: int, search_depth: int
) -> tuple[int, tuple[int, ...], int] | None:
    """Best reverse-play state ``(player, boxes by origin target, displacement)``, or None if no state
    with all targets uncovered scores above 0.

    Iterative pre-order DFS whose visiting order equals RAGEN's recursive one (pull-moves only,
    children in Up, Down, Left, Right order); a state is keyed by the player and the *set* of boxes,
    as the reference keys on the room array, while box identities ride along for the displacement
    and swap counts.
    """
    n_cells = len(floor)
    offsets = (-w, w, -1, 1)
    rows = [i // w for i in range(n_cells)]
    cols = [i % w for i in range(n_cells)]
    target_set = frozenset(targets)
    t_rc = [(rows[t], cols[t]) for t in targets]
    explored: set[int] = set()
    best_score, best = 0, None
    # (player, boxes (index i came from targets[i]), box_swaps, last pulled box, ttl)
    stack: list[tuple[int, tuple[int, ...], int, int, int]] = [(player, tuple(targets), 0, -1, search_depth)]
    while stack:
        p, boxes, swaps, last, ttl = stack.pop()
        ttl -= 1
        if ttl <= 0 or len(explored) >= _MAX_EXPLORED_STATES:
            continue
        key = p
        for b in sorted(boxes):
            key = key * n_cells + b
        if key in explored:
            continue
        explored.add(key)
        if swaps and p not in target_set and target_set.isdisjoint(boxes):
            disp = 0
            for b, (tr, tc) in zip(boxes, t_rc, strict=True):
                disp += abs(rows[b] - tr) + abs(cols[b] - tc)
            score = swaps * disp
            if score > best_score:
                best_score, best = score, (p, boxes, disp)
        children = []
        for o in offsets:
            q = p + o
            if not floor[q] or q in boxes:
                continue  # blocked: the reference recurses into the same (explored) state, a no-op
            pulled = p - o
            if pulled in boxes:
                i = boxes.index(pulled)
                children.append((q, (*boxes[:i], p, *boxes[i + 1 :]), swaps + (i != last), i, ttl))
            else:
                children.append((q, boxes, swaps, last, ttl))
        stack.extend(reversed(children))
    return best


def _shuffle_player(
    rng: random.Random, floor: bytes | bytearray, w: int, boxes: Sequence[int], player: int, displacement: int
) -> int:
    """RAGEN's random player walk: 1-3 steps onto free cells, never revisiting one."""
    move_probability = 0.8 if displacement == 1 else 0.5
    if rng.random() > move_probability:
        return player
    visited = [player]
    steps = 0
    while steps < 3:
        moves = [q for q in (player - w, player + w, player - 1, player + 1) if floor[q] and q not in boxes]
        moves = [q for q in moves if q not in visited]
        if not moves:
            break
        player = rng.choice(moves)
        visited.append(player)
        steps += 1
        if steps >= 3 or rng.random() > 0.5:
            break
    return player


def _generate_once(
    rng: random.Random, h: int, w: int, num_boxes: int, search_depth: int, num_gen_steps: int
) -> SokobanState | None:
    """One attempt of the reference algorithm; None where the reference would raise."""
    for _ in range(_TOPOLOGY_TRIES):
        floor = _topology(rng, h, w, num_gen_steps)
        free = [i for i, f in enumerate(floor) if f]
        if len(free) <= num_boxes + 1:
            return None  # the reference raises "not enough free spots"; the env then reseeds
        player = free.pop(rng.randrange(len(free)))
        targets = [free.pop(rng.randrange(len(free))) for _ in range(num_boxes)]
        best = _reverse_play(floor, w, targets, player, search_depth)
        if best is not None:
            break
    else:
        return None
    end_player, boxes, displacement = best
    start = _shuffle_player(rng, floor, w, boxes, end_player, displacement)
    return SokobanState(h, w, bytes(floor), tuple(sorted(targets)), tuple(sorted(boxes)), start)


def generate_room(
    seed: int,
    dim_room: tuple[int, int] = (6, 6),
    num_boxes: int = 1,
    search_depth: int = 300,
    max_solution_length: int | None = None,
    num_gen_steps: int | None = None,
) -> SokobanState:
    """The room of ``seed``: deterministic, solvable, and (optionally) solvable in a bounded number
    of actions. Attempt ``k`` uses ``random.Random(derive_seed(seed, k))``."""
    h, w = dim_room
    steps = int(1.7 * (h + w)) if num_gen_steps is None else num_gen_steps
    for attempt in range(_MAX_ATTEMPTS):
        rng = random.Random(derive_seed(seed, attempt))
        state = _generate_once(rng, h, w, num_boxes, search_depth, steps)
        if state is None:
            continue
        if max_solution_length is not None and solve(state, max_depth=max_solution_length) is None:
            continue
        return state
    raise RuntimeError(
        f"no Sokoban room for seed {seed} after {_MAX_ATTEMPTS} attempts (dim_room={dim_room}, "
        f"num_boxes={num_boxes}, search_depth={search_depth}, max_solution_length={max_solution_length})"
    )


# The environment ----------------------------------------------------------------------------------
class SokobanEnv(Env):
    """RAGEN's Sokoban with text observations; see the module docstring for generation.

    The live position is kept compact (``player`` index, set of box indices) for speed;
    ``room_fixed``, ``room_state`` and ``player_position`` give gym_sokoban's array views, and
    ``state`` a :class:`SokobanState` for the solver.
    """

    env_type: ClassVar[str] = "sokoban"
    success_means: ClassVar[str] = "every box is on a target within the action budget."

    def __init__(
        self,
        dim_room: Sequence[int] = (6, 6),
        num_boxes: int = 1,
        max_steps: int = 100,
        search_depth: int = 300,
        grid_lookup: Mapping[int | str, str] | None = None,
        dim_x: int | None = None,
        dim_y: int | None = None,
        max_solution_length: int | None = None,
        cell_separator: str = "",
        directions: bool = False,
    ) -> None:
        """``cell_separator`` goes between the cells of each row (``" "``: one token per cell for a BPE
        tokenizer, which otherwise merges runs like ``####``); ``""`` is RAGEN's rendering. ``directions``
        adds the room as the player sees it (not RAGEN's): the box as moves from the player, the target as
        moves from the box, and which moves walk into a wall, so that a policy can act on the text without
        locating cells in the grid (one box only)."""
        rows, cols = (int(d) for d in dim_room)
        self.dim_room: tuple[int, int] = (
            rows if dim_x is None else int(dim_x),
            cols if dim_y is None else int(dim_y),
        )
        if min(self.dim_room) < 3:
            raise ValueError(f"dim_room must be at least 3x3, got {self.dim_room}")
        if num_boxes < 1:
            raise ValueError(f"num_boxes must be >= 1, got {num_boxes}")
        self.directions = observation_flag("directions", directions)
        if self.directions and num_boxes != 1:
            raise ValueError(
                f"directions describes one box and its target, got num_boxes={num_boxes}: set num_boxes: 1 "
                "or directions: false"
            )
        if max_solution_length is not None and max_solution_length < 1:
            raise ValueError(f"max_solution_length must be >= 1 or None, got {max_solution_length}")
        self.num_boxes = int(num_boxes)
        self.max_steps = int(max_steps)
        self.search_depth = int(search_depth)
        self.max_solution_length = max_solution_length
        self.cell_separator = cell_separator_setting(cell_separator)
        # YAML gives int keys, JSON str keys: accept both.
        lookup = {int(k): str(v) for k, v in (grid_lookup or DEFAULT_GRID_LOOKUP).items()}
        if sorted(lookup) != list(range(7)) or len(set(lookup.values())) != 7:
            raise ValueError(f"grid_lookup must map 0..6 to 7 distinct symbols, got {grid_lookup}")
        self.grid_lookup: dict[int, str] = lookup
        self.grid_vocab = {lookup[code]: CELL_MEANINGS[code] for code in range(7)}
        self.actions = list(ACTIONS)
        self._height, self._width = self.dim_room
        self._floor: bytes = b""
        self._targets: frozenset[int] = frozenset()
        self._boxes: set[int] = set()
        self._player = -1
        self.num_env_steps = 0
        self.boxes_on_target = 0

    # State access ---------------------------------------------------------------------------------
    def set_state(self, state: SokobanState) -> None:
        """Load a position (a generated or hand-built room) and restart the step count."""
        self._height, self._width = state.height, state.width
        self._floor = state.floor
        self._targets = frozenset(state.targets)
        self._boxes = set(state.boxes)
        self._player = state.player
        self.num_env_steps = 0
        self.boxes_on_target = len(self._boxes & self._targets)

    @property
    def state(self) -> SokobanState:
        self._require_room()
        return SokobanState(
            self._height,
            self._width,
            self._floor,
            tuple(sorted(self._targets)),
            tuple(sorted(self._boxes)),
            self._player,
        )

    @property
    def room_fixed(self) -> np.ndarray:
        return self.state.room_fixed()

    @property
    def room_state(self) -> np.ndarray:
        return self.state.room_state()

    @property
    def player_position(self) -> np.ndarray:
        self._require_room()
        return np.array(divmod(self._player, self._width))

    def _require_room(self) -> None:
        if self._player < 0:
            raise RuntimeError("SokobanEnv: call reset(seed) (or set_state) before using the room")

    # Env API -------------------------------------------------------------------------------------
    def reset(self, seed: int) -> str:
        self.set_state(
            generate_room(
                seed,
                self.dim_room,
                self.num_boxes,
                self.search_depth,
                max_solution_length=self.max_solution_length,
            )
        )
        return self.render()

    def step(self, action: str) -> StepResult:
        idx = self.match_action(action)
        if idx is None:
            return invalid_step(self.render())
        self._require_room()
        dr, dc = DIRECTIONS[idx]
        offset = dr * self._width + dc
        before = self._player
        nxt = before + offset
        if nxt in self._boxes:
            beyond = nxt + offset
            if self._floor[beyond] and beyond not in self._boxes:
                self._boxes.remove(nxt)
                self._boxes.add(beyond)
                self._player = nxt
        elif self._floor[nxt]:
            self._player = nxt
        self.num_env_steps += 1

        reward = -0.1
        on_target = len(self._boxes & self._targets)
        if on_target > self.boxes_on_target:
            reward += 1.0
        elif on_target < self.boxes_on_target:
            reward -= 1.0
        self.boxes_on_target = on_target
        success = on_target == len(self._targets)
        if success:
            reward += 10.0
        done = success or self.num_env_steps == self.max_steps
        info: dict[str, Any] = {
            "success": success,
            "action_is_valid": True,
            "action_is_effective": self._player != before,
        }
        return StepResult(observation=self.render(), reward=reward, done=done, info=info)

    def render(self) -> str:
        self._require_room()
        grid = render_room(
            self._height, self._width, self._floor, self._targets, self._boxes, self._player, self.grid_lookup
        )
        grid = separate_cells(grid, self.cell_separator)
        return "\n".join([grid, *_direction_lines(self.state)]) if self.directions else grid

    # Oracle and demonstrations ------------------------------------------------------------------------
    def oracle_actions(self, actions_left: int, max_actions: int, turns_left: int) -> list[str]:
        """The next turn's part of a shortest solution within the budget (``[]`` if none fits).

        Sokoban is deterministic, so the first ``max_actions`` actions of an optimal plan are the
        best turn whatever ``turns_left`` is.
        """
        plan = solve(self, max_depth=actions_left)
        return (plan or [])[: max(0, min(max_actions, actions_left))]

    def think_text(self, actions: Sequence[str]) -> str:
        """``Player (r,c), box (r,c), target (r,c). I should go Up.`` (0-based cells)."""
        first = actions[0] if actions else ""
        st = self.state
        boxes = " and ".join(cell_label(b, st.width) for b in st.boxes)
        targets = " and ".join(cell_label(t, st.width) for t in st.targets)
        b_word, t_word = ("box", "target") if len(st.boxes) == 1 else ("boxes", "targets")
        return (
            f"Player {cell_label(st.player, st.width)}, {b_word} {boxes}, {t_word} {targets}. "
            f"I should go {first}."
        )


def _direction_lines(state: SokobanState) -> list[str]:
    """``Box: 1 Up, 1 Right.``, ``Target: 2 Down from the box.`` and ``Walls next to you: Left.`` (moves
    in ``ACTIONS`` order, or ``none``); ``The box is on the target.`` once it is."""
    (box,), (target,), w = state.boxes, state.targets, state.width
    if box == target:
        return ["The box is on the target."]
    walls = [
        a
        for a, (dr, dc) in zip(ACTIONS, DIRECTIONS, strict=True)
        if not state.floor[state.player + dr * w + dc]
    ]
    return [
        f"Box: {moves_between(state.player, box, w)}.",
        f"Target: {moves_between(box, target, w)} from the box.",
        f"Walls next to you: {' '.join(walls) or 'none'}.",
    ]
